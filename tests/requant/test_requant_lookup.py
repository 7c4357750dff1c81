"""The compiled requant (shardprep/requant/_block_requant.c) gives the bytes of the numpy code and of the
elementwise torch recipe: on random blocks, on every fp8 code, and on the scale edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_requant import random_block_fp8, same_bytes

from shardprep.requant import lookup, requant_ue8m0
from shardprep.requant import ue8m0 as ue8m0_module

compiled = lookup.compiled
needs_compiled = pytest.mark.skipif(compiled is None, reason="the compiled requant is not built "
                                    "(pip install -e . or python setup.py build_ext --inplace)")


def elementwise(weight: torch.Tensor, scale: torch.Tensor, recipe: str, monkeypatch) -> tuple:
    """requant_ue8m0 with both table paths switched off: the per-element torch arithmetic."""
    with monkeypatch.context() as m:
        m.setattr(ue8m0_module, "_requant_by_table", lambda *args: None)
        m.setattr(ue8m0_module, "requant_codes", lambda *args: None)
        return requant_ue8m0(weight, scale, recipe=recipe)


def three_ways(weight: torch.Tensor, scale: torch.Tensor, recipe: str, monkeypatch):
    codes = weight.view(torch.uint8).numpy()
    scales = scale.numpy()
    fast = lookup.requant_codes(codes, scales, recipe)
    plain = lookup.requant_codes(codes, scales, recipe, use_compiled=False)
    reference = elementwise(weight, scale, recipe, monkeypatch)
    return fast, plain, reference


def assert_all_equal(fast, plain, reference) -> None:
    assert fast is not None and plain is not None
    q_ref = reference[0].view(torch.uint8).numpy()
    s_ref = reference[1].numpy()
    for q, s in (fast, plain):
        assert np.array_equal(q, q_ref)
        assert np.array_equal(s.view(np.uint32), s_ref.view(np.uint32))


@needs_compiled
@pytest.mark.parametrize("recipe", ["sglang", "fp32"])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (128, 130), (5, 7), (3, 160, 136), (1, 4096)])
def test_compiled_numpy_and_torch_give_the_same_bytes_on_random_blocks(shape, recipe, monkeypatch):
    weight, scale = random_block_fp8(shape, seed=11)
    assert_all_equal(*three_ways(weight, scale, recipe, monkeypatch))


def every_code_blocks(scales: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One 128x128 block per scale, each holding all 254 non-NaN codes (both zeros, every subnormal,
    ±448) at random places, the rest random."""
    rng = np.random.default_rng(seed)
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    blocks = []
    for _ in scales:
        block = rng.choice(codes, size=128 * 128)
        block[rng.permutation(128 * 128)[: len(codes)]] = codes
        blocks.append(block.reshape(128, 128))
    weight = torch.from_numpy(np.concatenate(blocks, axis=1)).view(torch.float8_e4m3fn)
    return weight, torch.tensor([scales], dtype=torch.float32)


def edge_scales() -> list[float]:
    f32 = np.float32
    above = float(np.nextafter(f32(1.0), f32(2.0)))  # amax just above 448·2^k: the scale doubles
    below = float(np.nextafter(f32(1.0), f32(0.0)))
    return [
        1.0, above, below, 0.75, 1 / 3, 2.0**-9, 2.0**-20, 3.0 * 2**-17,
        1e-4 / 448,  # amax at the 1e-4 floor
        2.0**-126, 1e-38, 1e-45,  # float32 subnormal scales and products
        2.0**100, 3.0e38 / 448,  # the largest finite dequantized values
        float(np.float32(0.1)), float(np.float32(7.0)),
        0.0, -0.0,  # zero scales: with -0.0 the sign mirror must be an exclusive or
    ]


@needs_compiled
@pytest.mark.parametrize("recipe", ["sglang", "fp32"])
def test_every_fp8_code_under_edge_scales_gives_the_same_bytes(recipe, monkeypatch):
    weight, scale = every_code_blocks(edge_scales(), seed=5)
    assert_all_equal(*three_ways(weight, scale, recipe, monkeypatch))


@needs_compiled
@pytest.mark.parametrize("recipe", ["sglang", "fp32"])
def test_zero_negative_and_subnormal_only_blocks_give_the_same_bytes(recipe, monkeypatch):
    rng = np.random.default_rng(9)
    blocks = [
        np.zeros((128, 128), np.uint8),  # +0: scale 2^-22
        np.full((128, 128), 0x80, np.uint8),  # -0
        rng.integers(0x80, 0xFF, (128, 128), dtype=np.uint8),  # all negative
        rng.integers(0, 8, (128, 128), dtype=np.uint8),  # fp8 subnormals only
        rng.choice(np.array([0x7E, 0xFE], np.uint8), (128, 128)),  # ±448 only
    ]
    weight = torch.from_numpy(np.concatenate(blocks, axis=1)).view(torch.float8_e4m3fn)
    for scale_value in (1.0, 0.3, 2.0**-30):
        scale = torch.full((1, len(blocks)), scale_value, dtype=torch.float32)
        assert_all_equal(*three_ways(weight, scale, recipe, monkeypatch))


@needs_compiled
@pytest.mark.parametrize("cols", [1, 31, 32, 33, 127, 128, 129, 200, 293])
@pytest.mark.parametrize("rows", [1, 128, 130])
def test_avx2_and_scalar_lookups_agree_on_partial_blocks(rows, cols):
    weight, scale = random_block_fp8((rows, cols), seed=rows * 1000 + cols)
    codes, scales = weight.view(torch.uint8).numpy(), scale.numpy()
    results = []
    for avx2 in (True, False):
        q, sf = np.empty_like(codes), np.empty_like(scales)
        assert compiled.requant_matrix(codes, rows, cols, scales, True, q, sf, avx2)
        results.append((q, sf))
    plain = lookup.requant_codes(codes, scales, "sglang", use_compiled=False)
    for q, sf in results:
        assert np.array_equal(q, plain[0]) and np.array_equal(sf, plain[1])


@needs_compiled
def test_compiled_tables_equal_numpy_tables_for_every_code_and_many_scales():
    # Every code up to 0x7E through the block table of 200k random positive float32 scales (any exponent,
    # any mantissa), both recipes: the C arithmetic against the numpy arithmetic, entry by entry.
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 0x7F800000, 200_000, dtype=np.uint64).astype(np.uint32)  # every positive float32
    scales = bits.view(np.float32)
    scales = scales[np.isfinite(scales) & (np.abs(scales) < 1e36)].reshape(-1, 1)
    codes = np.resize(np.arange(0x7F, dtype=np.uint8), (128, 128))
    codes[0, 0] = 0x7E  # every block's top is 0x7E: every entry of its table is used
    for recipe in ("sglang", "fp32"):
        for scale in np.array_split(scales, 20):
            matrix = np.tile(codes, (1, len(scale)))
            row = scale.reshape(1, -1)
            fast = lookup.requant_codes(matrix, row, recipe)
            plain = lookup.requant_codes(matrix, row, recipe, use_compiled=False)
            assert (fast is None) == (plain is None)
            if fast is not None:
                assert np.array_equal(fast[0], plain[0]) and np.array_equal(fast[1].view(np.uint32),
                                                                          plain[1].view(np.uint32))


@needs_compiled
def test_the_compiled_requant_refuses_buffers_of_the_wrong_size():
    codes, scale = np.zeros((128, 128), np.uint8), np.ones((1, 1), np.float32)
    q, sf = np.empty_like(codes), np.empty_like(scale)
    with pytest.raises(ValueError, match="codes and q"):
        compiled.requant_matrix(codes, 129, 128, scale, True, q, sf)
    with pytest.raises(ValueError, match="codes and q"):
        compiled.requant_matrix(codes, 128, 128, scale, True, np.empty(10, np.uint8), sf)
    with pytest.raises(ValueError, match="scale and sf"):
        compiled.requant_matrix(codes, 128, 128, np.ones(2, np.float32), True, q, sf)
    with pytest.raises(ValueError, match="contiguous"):  # a strided view is not one run of bytes
        compiled.requant_matrix(np.zeros((128, 256), np.uint8)[:, ::2], 128, 128, scale, True, q, sf)


@pytest.mark.parametrize("use_compiled", [True, False])
def test_nan_codes_and_nonfinite_or_negative_scales_are_left_to_the_torch_path(use_compiled):
    if use_compiled and compiled is None:
        pytest.skip("the compiled requant is not built")
    codes = np.zeros((128, 256), np.uint8)
    scale = np.ones((1, 2), np.float32)
    codes[5, 200] = 0xFF  # a NaN code
    assert lookup.requant_codes(codes, scale, "sglang", use_compiled=use_compiled) is None
    codes[5, 200] = 0
    scale[0, 1] = np.inf
    assert lookup.requant_codes(codes, scale, "sglang", use_compiled=use_compiled) is None
    scale[0, 1] = -0.5  # negative: the torch path refuses it
    assert lookup.requant_codes(codes, scale, "sglang", use_compiled=use_compiled) is None
    scale[0, 1] = 3.0e38  # finite, but 448 x it is not
    codes[0, 130] = 0x7E
    assert lookup.requant_codes(codes, scale, "sglang", use_compiled=use_compiled) is None


@needs_compiled
def test_requant_ue8m0_on_the_cpu_uses_the_compiled_requant(monkeypatch):
    calls = []

    class Spy:
        @staticmethod
        def requant_matrix(*args):
            calls.append(args[1:3])
            return compiled.requant_matrix(*args)

    monkeypatch.setattr(lookup, "compiled", Spy())
    weight, scale = random_block_fp8((256, 384), seed=1)
    q, s = requant_ue8m0(weight, scale)
    assert calls == [(256, 384)]
    monkeypatch.setattr(lookup, "compiled", None)
    q2, s2 = requant_ue8m0(weight, scale)
    assert same_bytes(q, q2) and same_bytes(s, s2)
