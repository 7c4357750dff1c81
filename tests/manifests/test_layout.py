"""Pure layout math: offsets, alignment, padding, chunking, fused groups."""

import pytest

from shardprep.errors import LayoutError
from shardprep.manifests.layout import (
    FusedGroup,
    TensorSpec,
    align_up,
    chunk_range,
    plan_file_offsets,
    plan_layer,
)


def specs(*items):
    return [TensorSpec(n, d, s) for n, d, s in items]


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_entries_are_aligned_disjoint_and_total_is_padded_to_16n(world_size):
    tensors = specs(("l.1.c", "BF16", (7, 3)), ("l.1.a", "F32", (5,)), ("l.1.b", "U8", (1,)), ("l.1.d", "F16", (33,)))
    lay = plan_layer(1, tensors, world_size)
    assert [e.name for e in lay.entries] == ["l.1.a", "l.1.b", "l.1.c", "l.1.d"]
    end = 0
    for e in lay.entries:
        assert e.offset % 16 == 0
        assert e.offset >= end
        end = e.offset + e.nbytes
    assert lay.total_bytes % (16 * world_size) == 0
    assert lay.total_bytes >= end and lay.total_bytes - end < 16 * world_size
    assert lay.chunk_bytes * world_size == lay.total_bytes


def test_chunk_boundaries_ignore_tensor_boundaries():
    # 3 rows of 16 bytes across N = 2: rank 0's chunk ends in the middle of row 1.
    lay = plan_layer(0, specs(("l.0.w", "U8", (3, 16))), world_size=2)
    assert lay.total_bytes == 64 and lay.chunk_bytes == 32
    assert chunk_range(1, lay.chunk_bytes) == (32, 64)


def test_fused_members_are_adjacent_in_declared_order_and_view_spans_them():
    tensors = specs(("p.1.q", "BF16", (8, 4)), ("p.1.k", "BF16", (4, 4)), ("p.1.v", "BF16", (4, 4)),
                    ("p.1.a", "BF16", (2, 4)), ("p.1.z", "BF16", (2, 4)))
    group = FusedGroup("p.1.qkv", ("p.1.q", "p.1.k", "p.1.v"))
    lay = plan_layer(1, tensors, 4, [group])
    order = [e.name for e in lay.entries]
    assert order == ["p.1.a", "p.1.q", "p.1.k", "p.1.v", "p.1.z"]
    at = {e.name: e for e in lay.entries}
    assert at["p.1.k"].offset == at["p.1.q"].offset + at["p.1.q"].nbytes
    assert at["p.1.v"].offset == at["p.1.k"].offset + at["p.1.k"].nbytes
    (view,) = lay.views
    assert view.offset == at["p.1.q"].offset and view.shape == (16, 4) and view.nbytes == 16 * 4 * 2


def test_fused_members_with_different_dtypes_are_refused():
    tensors = specs(("p.q", "BF16", (8, 4)), ("p.k", "F32", (8, 4)))
    with pytest.raises(LayoutError, match="'p.k' is F32"):
        plan_layer(1, tensors, 2, [FusedGroup("p.qk", ("p.q", "p.k"))])


def test_fused_members_with_incompatible_shapes_are_refused():
    tensors = specs(("p.q", "BF16", (8, 4)), ("p.k", "BF16", (8, 5)))
    with pytest.raises(LayoutError, match="cannot be concatenated"):
        plan_layer(1, tensors, 2, [FusedGroup("p.qk", ("p.q", "p.k"))])


def test_fused_member_that_would_leave_a_gap_is_refused():
    tensors = specs(("p.q", "U8", (3, 3)), ("p.k", "U8", (3, 3)))
    with pytest.raises(LayoutError, match="not a multiple of 16"):
        plan_layer(1, tensors, 2, [FusedGroup("p.qk", ("p.q", "p.k"))])


def test_world_size_below_one_is_refused():
    with pytest.raises(LayoutError, match=">= 1"):
        plan_layer(1, specs(("a", "U8", (16,))), 0)


def test_file_offsets_are_4096_aligned_and_disjoint():
    sizes = [1, 4096, 4097, 10]
    offs = plan_file_offsets(sizes)
    assert all(o % 4096 == 0 for o in offs)
    for (o0, s0), o1 in zip(zip(offs, sizes), offs[1:]):
        assert o1 >= o0 + s0
    assert align_up(0, 16) == 0 and align_up(16, 16) == 16


def test_a_fused_view_with_a_row_multiple_covers_zero_pad_rows_that_the_next_entry_does_not_overlap():
    # Kimi K3's in_proj_qkvgfab in miniature: 3 + 2 rows of 16 bytes, padded to a multiple of 4 rows (3 pad rows),
    # then a tensor that sorts after the group's members.
    tensors = specs(("l.0.a", "BF16", (3, 8)), ("l.0.b", "BF16", (2, 8)), ("l.0.c", "BF16", (1, 8)))
    lay = plan_layer(0, tensors, 2, groups=[FusedGroup("l.0.ab", ("l.0.a", "l.0.b"), row_multiple=4)])
    (view,) = lay.views
    at = {e.name: e for e in lay.entries}
    assert (view.shape, view.pad_rows, view.offset) == ((8, 8), 3, 0)
    assert at["l.0.b"].offset == at["l.0.a"].nbytes  # members back to back, as without padding
    assert at["l.0.c"].offset >= view.offset + view.nbytes  # the pad rows belong to no entry
    assert lay.total_bytes >= at["l.0.c"].offset + at["l.0.c"].nbytes


def test_a_view_whose_rows_are_already_a_multiple_gets_no_pad_rows():
    tensors = specs(("l.0.a", "BF16", (12, 8)), ("l.0.b", "BF16", (4, 8)))
    lay = plan_layer(0, tensors, 2, groups=[FusedGroup("l.0.ab", ("l.0.a", "l.0.b"), row_multiple=16)])
    assert (lay.views[0].shape, lay.views[0].pad_rows) == ((16, 8), 0)


def test_a_row_multiple_below_one_is_refused_naming_the_view():
    tensors = specs(("l.0.a", "BF16", (2, 8)), ("l.0.b", "BF16", (2, 8)))
    with pytest.raises(LayoutError, match="fused view 'l.0.ab': row_multiple"):
        plan_layer(0, tensors, 2, groups=[FusedGroup("l.0.ab", ("l.0.a", "l.0.b"), row_multiple=0)])


def test_pad_rows_after_a_last_member_without_rows_take_the_members_row_size():
    tensors = specs(("l.0.a", "BF16", (3, 8)), ("l.0.b", "BF16", (0, 8)), ("l.0.c", "BF16", (1, 8)))
    lay = plan_layer(0, tensors, 1, groups=[FusedGroup("l.0.ab", ("l.0.a", "l.0.b"), row_multiple=4)])
    assert (lay.views[0].shape, lay.views[0].pad_rows, lay.views[0].nbytes) == ((4, 8), 1, 64)
    assert {e.name: e.offset for e in lay.entries}["l.0.c"] == 64


def test_a_view_inside_a_wider_one_places_nothing_and_names_a_run_of_its_bytes():
    # vLLM's K3 in_proj_qkvgfab (q, k, v, g, f_a, b, padded) and SGLang's fused_qkvg_proj (q, k, v, g) in miniature.
    tensors = specs(("l.0.q", "BF16", (4, 8)), ("l.0.k", "BF16", (4, 8)), ("l.0.f", "BF16", (1, 8)),
                    ("l.0.b", "BF16", (1, 8)), ("l.0.z", "BF16", (1, 8)))
    wide = FusedGroup("l.0.qkfb", ("l.0.q", "l.0.k", "l.0.f", "l.0.b"), row_multiple=4)
    alone = plan_layer(0, tensors, 2, groups=[wide])
    lay = plan_layer(0, tensors, 2, groups=[wide, FusedGroup("l.0.qk", ("l.0.q", "l.0.k")),
                                             FusedGroup("l.0.fb", ("l.0.f", "l.0.b"))])
    assert lay.entries == alone.entries and lay.total_bytes == alone.total_bytes  # the same bytes, in the same places
    views = {v.name: v for v in lay.views}
    assert (views["l.0.qkfb"].shape, views["l.0.qkfb"].pad_rows) == ((12, 8), 2)
    at = {e.name: e.offset for e in lay.entries}
    assert (views["l.0.qk"].offset, views["l.0.qk"].shape, views["l.0.qk"].pad_rows) == (at["l.0.q"], (8, 8), 0)
    assert (views["l.0.fb"].offset, views["l.0.fb"].shape) == (at["l.0.f"], (2, 8))
    assert at["l.0.z"] >= views["l.0.qkfb"].offset + views["l.0.qkfb"].nbytes  # the wide view's pad rows stay


def test_a_view_that_overlaps_another_without_lying_inside_it_is_refused():
    tensors = specs(("l.0.q", "BF16", (4, 8)), ("l.0.k", "BF16", (4, 8)), ("l.0.v", "BF16", (4, 8)))
    wide = FusedGroup("l.0.qkv", ("l.0.q", "l.0.k", "l.0.v"))
    with pytest.raises(LayoutError, match="'l.0.q' belongs to two fused views"):
        plan_layer(0, tensors, 2, groups=[wide, FusedGroup("l.0.qv", ("l.0.q", "l.0.v"))])  # not a run
    with pytest.raises(LayoutError, match="'l.0.q' belongs to two fused views"):
        plan_layer(0, tensors, 2, groups=[FusedGroup("l.0.qk", ("l.0.q", "l.0.k")), wide])  # inside a later one
    with pytest.raises(LayoutError, match="lies inside 'l.0.qkv', so it cannot have pad rows"):
        plan_layer(0, tensors, 2, groups=[wide, FusedGroup("l.0.qk", ("l.0.q", "l.0.k"), row_multiple=16)])
