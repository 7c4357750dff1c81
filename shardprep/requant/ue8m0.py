"""Block-FP8 to UE8M0 requantization: new power-of-two block scales, the same 128x128 blocks.

The recipe is SGLang's `_requant_weight_ue8m0` (DeepGEMM's `per_block_cast_to_fp8(use_ue8m0=True)` on
weights dequantized to bfloat16), with the power of two taken from float32 bits as DeepGEMM's CUDA kernels
do. docs/requant.md states it step by step and says why each step is the way it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import RequantError
from . import RECIPES
from .lookup import BLOCK, CHUNK_ELEMENTS, are_e8m0_powers_of_two, e8m0_codes, refuse_negative_scale, requant_codes

FP8_MAX = 448.0
# Below this block maximum every block gets the same scale (2^-22), so all-zero blocks stay well defined.
AMAX_FLOOR = 1e-4
# float32 bit fields.
_MANTISSA_MASK = (1 << 23) - 1
_EXPONENT_MASK = 0xFF
# Elements per pass, the same bound as the numpy path's (lookup.CHUNK_ELEMENTS); a module name so tests can
# force several passes.
_CHUNK_ELEMENTS = CHUNK_ELEMENTS
# Scale dtypes whose every value float32 holds exactly, so converting them first changes no product.
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def requant_ue8m0(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block: tuple[int, int] = (128, 128),
    recipe: str = "sglang",
    allow_nonfinite: bool = False,
    name: str = "?",
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Requantize a block-FP8 weight so that every block scale is a power of two (UE8M0).

    `weight` is float8_e4m3fn of shape [..., N, K] and `scale_inv` its dequantization multipliers of shape
    [..., ceil(N/128), ceil(K/128)]. Returns (float8_e4m3fn of weight's shape, float32 powers of two of
    scale_inv's shape), both on the CPU; the work itself runs on `device`, and "cuda" gives the same
    bytes as "cpu". `recipe="sglang"` rounds the dequantized weight to bfloat16 first, as SGLang does;
    `recipe="fp32"` (vLLM's) does not. Raises RequantError, naming `name`, for a negative scale (always)
    and for non-finite scales or dequantized values unless `allow_nonfinite`.

    >>> w = torch.full((2, 3), 192.0).to(torch.float8_e4m3fn)  # 192 * 3 = 576 = 288 * 2
    >>> q, s = requant_ue8m0(w, torch.tensor([[3.0]]), name="demo.weight")
    >>> s.tolist(), q.float()[0, 0].item()
    ([[2.0]], 288.0)
    """
    run_on = _resolve_device(device, name)
    _check_inputs(weight, scale_inv, block, recipe, name)
    scale32 = scale_inv.to(torch.float32).contiguous()  # the scales as every path below reads them
    refuse_negative_scale(scale32.cpu().numpy(), name)
    if not allow_nonfinite:
        _refuse_nonfinite(scale32, name, what="scale_inv")
    *batch, n, k = weight.shape
    q_out = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    s_out = torch.empty(scale_inv.shape, dtype=torch.float32)
    if weight.numel() == 0:
        return q_out, s_out

    if run_on.type == "cpu" and tuple(block) == (BLOCK, BLOCK):
        fast = requant_codes(weight.contiguous().view(torch.uint8).numpy(),
                             scale32.numpy(), recipe, _CHUNK_ELEMENTS)
        if fast is not None:
            q_out.view(torch.uint8).copy_(torch.from_numpy(fast[0]))
            s_out.copy_(torch.from_numpy(fast[1]))
            return q_out, s_out

    block_n, block_k = block
    weights, scales = weight.reshape(-1, n, k), scale32.reshape(-1, *scale_inv.shape[-2:])
    q_flat, s_flat = q_out.view(weights.shape), s_out.view(scales.shape)
    padded_k = scales.shape[-1] * block_k
    rows_per_pass = block_n * max(1, _CHUNK_ELEMENTS // (block_n * padded_k))
    # Experts are independent matrices and 128-row stripes are independent blocks: doing a few at a time
    # bounds memory and gives the same bytes as doing the whole tensor at once.
    for expert in range(weights.shape[0]):
        for row0 in range(0, n, rows_per_pass):
            row1 = min(n, row0 + rows_per_pass)
            stripes = slice(row0 // block_n, -(-row1 // block_n))
            codes, scale = weights[expert, row0:row1].to(run_on), scales[expert, stripes].to(run_on)
            by_table = _requant_by_table(codes, scale, block, recipe) if run_on.type != "cpu" else None
            if by_table is not None:
                q_flat[expert, row0:row1] = by_table[0][: row1 - row0, :k].view(torch.float8_e4m3fn).cpu()
                s_flat[expert, stripes] = by_table[1].cpu()
                continue
            x = _dequantize(codes, scale, block, recipe)
            if not allow_nonfinite:
                where = _source_index(expert, batch, row0)
                _refuse_nonfinite(x, name, what="dequantized weight", to_source_index=where)
            q, sf = _quantize_blocks(x, block)
            q_flat[expert, row0:row1] = q[: row1 - row0, :k].cpu()
            s_flat[expert, stripes] = sf.cpu()
    return q_out, s_out


def ceil_pow2_exponent(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for positive float32 `x`, exactly, from its bits (DeepGEMM's `fast_log2_ceil`).

    Returns int32. The biased exponent is clamped to [1, 254] as DeepGEMM's `ceil_to_ue8m0` does, so NaN and
    infinity give 127 rather than a pattern that is not a float.

    >>> ceil_pow2_exponent(torch.tensor([0.25, 0.3, 1.0, 1000.0])).tolist()
    [-2, -1, 0, 10]
    """
    bits = x.to(torch.float32).view(torch.int32)
    biased = ((bits >> 23) & _EXPONENT_MASK) + ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    return biased.clamp(1, 254) - 127


def scales_are_pow2(scale_inv: torch.Tensor) -> bool:
    """Whether every element is a positive power of two that e8m0 can hold (2^-127 to 2^127).

    An empty tensor counts as all powers of two.

    >>> scales_are_pow2(torch.tensor([0.5, 1.0, 2.0 ** -20])), scales_are_pow2(torch.tensor([0.75]))
    (True, False)
    """
    return are_e8m0_powers_of_two(scale_inv.to(torch.float32).cpu().numpy())


def scale_to_e8m0(scale_inv_pow2: torch.Tensor, *, name: str = "?") -> torch.Tensor:
    """The same powers of two as torch.float8_e8m0fnu (one byte each: the float32 exponent field).

    Raises RequantError, naming `name`, if an element is not a power of two that e8m0 can hold; torch's own
    cast would silently round such a value up.

    >>> scale_to_e8m0(torch.tensor([1.0, 0.5, 2.0 ** -22])).view(torch.uint8).tolist()
    [127, 126, 105]
    """
    if not scales_are_pow2(scale_inv_pow2):
        raise RequantError(
            f"tensor {name!r}: scales are not all powers of two in [2^-127, 2^127], so they have no exact "
            f"e8m0 form; requantize the weight with requant_ue8m0 first")
    codes = e8m0_codes(scale_inv_pow2.to(torch.float32).cpu().numpy())
    return torch.from_numpy(codes).view(torch.float8_e8m0fnu).to(scale_inv_pow2.device)


def _fp8_values(device: torch.device) -> torch.Tensor:
    """float32 value of each of the 256 float8_e4m3fn codes (0x7F and 0xFF are NaN)."""
    return torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _requant_by_table(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], recipe: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same recipe computed per block on the 256 possible codes, then applied by table lookup.

    Within a block every element goes through the same function of its 8-bit code (dequantize with the
    block's scale, round, requantize with the block's new scale), and |value| grows with the code's low
    7 bits, so the block amax comes from the largest code. Evaluating the recipe's exact operations on
    256 codes per block instead of 16384 elements is what makes requantization cheaper than reading the
    checkpoint. Returns None (use the elementwise path) when a block holds NaN codes or a non-finite
    scale or amax, so error reporting and allow_nonfinite keep one implementation.
    """
    block_n, block_k = block
    rows, cols = weight.shape
    blocks_n, blocks_k = scale.shape
    if (rows, cols) == (blocks_n * block_n, blocks_k * block_k):
        codes = weight.view(torch.uint8)
    else:
        codes = torch.zeros(blocks_n * block_n, blocks_k * block_k, dtype=torch.uint8, device=weight.device)
        codes[:rows, :cols] = weight.view(torch.uint8)  # code 0 is +0.0: the recipe's zero padding
    # Each block contiguous: [blocks_n, blocks_k, block_n * block_k].
    blocks = codes.view(blocks_n, block_n, blocks_k, block_k).permute(0, 2, 1, 3).reshape(blocks_n, blocks_k, -1)
    top = (blocks & 0x7F).amax(dim=2)
    if bool((top == 0x7F).any()) or not bool(torch.isfinite(scale).all()):
        return None
    values = _fp8_values(weight.device)
    x_top = values[top.long()] * scale
    if recipe == "sglang":
        x_top = x_top.to(torch.bfloat16).float()
    if not bool(torch.isfinite(x_top).all()):
        return None
    quotient = x_top.clamp(min=AMAX_FLOOR) / torch.full_like(x_top, FP8_MAX)
    sf = ((ceil_pow2_exponent(quotient) + 127) << 23).view(torch.float32)
    table = values.view(1, 1, 256) * scale.view(blocks_n, blocks_k, 1)
    if recipe == "sglang":
        table = table.to(torch.bfloat16).float()
    table = (table * sf.reciprocal().view(blocks_n, blocks_k, 1)).to(torch.float8_e4m3fn).view(torch.uint8)
    q = _lookup(blocks, table)
    q = q.view(blocks_n, blocks_k, block_n, block_k).permute(0, 2, 1, 3).reshape(codes.shape)
    return q, sf


def _lookup(blocks: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """out[i, j, e] = table[i, j, blocks[i, j, e]]: each block's codes through its own 256-entry table.

    The CUDA form; on the CPU, `lookup.requant_codes` does the same (compiled, or with bytes.translate).
    """
    return torch.gather(table, 2, blocks.long())


def _dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], recipe: str) -> torch.Tensor:
    """fp8 times its block's scale in float32, zero-padded to whole blocks; bfloat16-rounded for "sglang"."""
    block_n, block_k = block
    rows, cols = weight.shape
    blocks_n, blocks_k = scale.shape
    x = torch.zeros(blocks_n * block_n, blocks_k * block_k, dtype=torch.float32, device=weight.device)
    x[:rows, :cols].copy_(weight)
    # Broadcasting the scale over each block multiplies the same pairs as repeat_interleave would, without
    # a float32 copy of the scale per element. Padding becomes 0 * scale: 0, or NaN in a block whose scale
    # is not finite, whose amax is then not finite either way, so cropping after padding (the references'
    # order) would change nothing.
    x.view(blocks_n, block_n, blocks_k, block_k).mul_(scale.view(blocks_n, 1, blocks_k, 1))
    return x.to(torch.bfloat16) if recipe == "sglang" else x


def _quantize_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: sf = 2^ceil(log2(max(amax, 1e-4) / 448)), q = fp8(x * (1 / sf)). Returns (q, sf)."""
    block_n, block_k = block
    blocks_n, blocks_k = x.shape[0] // block_n, x.shape[1] // block_k
    blocks = x.view(blocks_n, block_n, blocks_k, block_k)
    amax = blocks.abs().to(torch.float32).amax(dim=(1, 3)).clamp(min=AMAX_FLOOR)
    # A tensor divisor, not a Python scalar: CUDA turns division by a scalar into multiplication by its
    # float32 reciprocal, which can differ from CPU's division in the last bit. The exponent would agree
    # either way (tests/requant/test_requant.py checks every float32 of an octave); this way nothing rests on it.
    quotient = amax / torch.full_like(amax, FP8_MAX)
    # Bits, not torch.log2: log2 rounds values a few ulps above a power of two down to the exact integer,
    # and how it rounds is up to each device's math library (docs/requant.md, "log2 or exponent bits").
    sf = ((ceil_pow2_exponent(quotient) + 127) << 23).view(torch.float32)
    # 1/sf is exact for a power of two, so multiplying by it equals dividing by sf on every device.
    scaled = blocks.to(torch.float32) * sf.reciprocal().view(blocks_n, 1, blocks_k, 1)
    return scaled.to(torch.float8_e4m3fn).view(x.shape), sf


def _resolve_device(device: str | torch.device, name: str) -> torch.device:
    try:
        run_on = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise RequantError(f"tensor {name!r}: device {device!r} is not a torch device ({err})") from None
    if run_on.type == "cuda" and not torch.cuda.is_available():
        raise RequantError(f"tensor {name!r}: device {device!r} asked for, but torch sees no CUDA device; "
                           f"use device='cpu' (it gives the same bytes)")
    return run_on


def _check_inputs(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], recipe: str,
                  name: str) -> None:
    if recipe not in RECIPES:
        raise RequantError(f"tensor {name!r}: unknown recipe {recipe!r}; expected one of {RECIPES}")
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise RequantError(f"tensor {name!r}: block must be two positive ints, got {block!r}")
    if weight.dtype != torch.float8_e4m3fn:
        raise RequantError(f"tensor {name!r} has dtype {weight.dtype}; requantization expects "
                           f"torch.float8_e4m3fn block-FP8 weights")
    if weight.dim() < 2:
        raise RequantError(f"tensor {name!r} has shape {tuple(weight.shape)}; expected [..., N, K]")
    if scale_inv.dtype not in _SCALE_DTYPES:
        raise RequantError(f"tensor {name!r}: scale_inv has dtype {scale_inv.dtype}; expected one of "
                           f"{', '.join(str(d) for d in _SCALE_DTYPES)}")
    *batch, n, k = weight.shape
    expected = (*batch, math.ceil(n / block[0]), math.ceil(k / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise RequantError(f"tensor {name!r} of shape {tuple(weight.shape)} needs scale_inv of shape {expected} "
                           f"for {block[0]}x{block[1]} blocks, got {tuple(scale_inv.shape)}")


def _source_index(expert: int, batch: list[int], row0: int) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
    """Maps an index in one pass's rows back to an index in the caller's tensor, for error messages."""
    lead: list[int] = []
    for size in reversed(batch):
        expert, i = divmod(expert, size)
        lead.insert(0, i)
    return lambda index: (*lead, row0 + index[0], index[1])


def _refuse_nonfinite(x: torch.Tensor, name: str, *, what: str,
                      to_source_index: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None) -> None:
    bad = ~torch.isfinite(x)
    if not bool(bad.any()):
        return
    first = tuple(torch.nonzero(bad)[0].tolist())
    if to_source_index is not None:
        first = to_source_index(first)
    raise RequantError(
        f"tensor {name!r} has non-finite {what} values (the first at index {first}); the source "
        f"checkpoint is corrupt or its scales overflow. Pass allow_nonfinite=True to requantize "
        f"anyway (such blocks get scale 2^127)")
