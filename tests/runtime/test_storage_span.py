"""Packing a tensor by its storage span and seeing it again with its strides (runtime/storage_span.py), on the
layout that vLLM's DeepGEMM path leaves on SM100: packed UE8M0 scales, int32 [N, ⌈K/512⌉] with strides
(1, align(N, 4)), which DeepGEMM asserts at every GEMM."""

from __future__ import annotations

import pytest
import torch

from shardprep.runtime.storage_span import rebind, row_major, span_bytes, span_elements, stride_problem


def deep_gemm_sm100_scale(n: int, k: int) -> torch.Tensor:
    """A packed scale as DeepGEMM lays it out: storage align(N, 4)·⌈K/512⌉ int32, MN-major, padding rows unset."""
    aligned, packed_k = (n + 3) // 4 * 4, (k + 511) // 512
    storage = torch.full((packed_k, aligned), -1, dtype=torch.int32)  # the padding rows: not the tensor's
    scale = storage.t()[:n]
    scale.copy_(torch.arange(n * packed_k, dtype=torch.int32).view(packed_k, n).t())
    return scale


@pytest.mark.parametrize("n, k", [(6, 1536), (704, 256), (256, 512)])
def test_a_deep_gemm_scale_seen_again_over_its_span_has_its_shape_strides_and_values(n, k):
    scale = deep_gemm_sm100_scale(n, k)
    aligned = (n + 3) // 4 * 4
    assert scale.stride() == (1, aligned)
    gathered = span_bytes(scale).clone()  # what a gather hands back: the span's bytes, elsewhere
    again = rebind(gathered.view(torch.int32), scale.shape, scale.stride())
    assert again.shape == scale.shape and again.stride() == (1, aligned) and again.dtype == torch.int32
    assert torch.equal(again, scale)
    assert again.data_ptr() == gathered.data_ptr()  # a view of the gathered bytes, no copy


def test_the_k_up_to_512_scale_keeps_its_stride_that_torch_calls_contiguous():
    scale = deep_gemm_sm100_scale(6, 512)  # [6, 1], stride (1, 8)
    assert scale.is_contiguous() and scale.stride() == (1, 8)
    assert row_major(scale.shape) == (1, 1)  # what a contiguous packing would give: DeepGEMM's assert fails
    assert rebind(span_bytes(scale).clone().view(torch.int32), scale.shape, scale.stride()).stride() == (1, 8)


def test_the_gaps_of_a_span_are_zeroed_so_that_every_rank_packs_the_same_bytes():
    scale = deep_gemm_sm100_scale(6, 1536)  # 3 columns 8 apart, rows 6 and 7 of each padding (-1)
    assert span_elements(scale.shape, scale.stride()) == 6 + 2 * 8
    packed = span_bytes(scale).view(torch.int32)
    assert packed[6:8].tolist() == [0, 0] and packed[14:16].tolist() == [0, 0]


@pytest.mark.parametrize("shape, stride, says", [
    ((4, 4), (0, 1), "its elements overlap (stride 0 over 4 elements)"),
    ((4, 4), (2, 1), "its elements overlap (stride 2 over 4 elements)"),
    ((4,), (-1,), "a negative stride (-1)"),
])
def test_layouts_whose_elements_overlap_cannot_be_packed_by_their_span(shape, stride, says):
    assert stride_problem(shape, stride) == says


@pytest.mark.parametrize("shape, stride", [((4, 4), (4, 1)), ((4, 4), (1, 4)), ((6, 3), (1, 8)), ((5, 1), (1, 8)),
                                           ((2, 1, 3), (3, 100, 1))])
def test_layouts_without_overlap_can(shape, stride):
    assert stride_problem(shape, stride) is None
