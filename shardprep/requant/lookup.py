"""The table-lookup requant of block-FP8 weights, in numpy: the same bytes as the torch recipe, no torch.

Within one 128×128 block every element goes through the same function of its 8-bit code (dequantize with
the block's scale, round to bfloat16 for "sglang", multiply by the new 1/sf, round to fp8), and |value|
grows with the code's low 7 bits, so the block amax is the value of its largest code. The recipe's
operations therefore run on the 128 non-negative codes of each block (a negative code is its positive
twin with the sign bit set, at every step), and the block's codes go through that table. float32 products and quotients
are IEEE round-to-nearest-even in numpy as in torch; the bfloat16 and fp8 roundings are done on the bits,
round to nearest even, as torch's casts do. The same recipe, compiled (`_block_requant.c`, built with
the package; it releases the GIL), does the whole matrix in one call where it was built; without it,
numpy and `bytes.translate` give the same bytes.
`tests/requant/test_requant.py` checks the bytes against the elementwise torch path and two references.

Blocks holding a NaN code, or with a non-finite scale or amax, are not handled here (None is returned):
the torch path reports them or applies `allow_nonfinite`.
"""

from __future__ import annotations

import numpy as np

from ..errors import RequantError

try:
    from . import _block_requant as compiled  # type: ignore[attr-defined,unused-ignore]
except ImportError:  # built without a C compiler: the numpy code below
    compiled = None

FP8_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-4)  # torch's clamp(min=1e-4) on float32 uses this same float32 value
BLOCK = 128
# Codes per pass. A pass holds a few copies of its rows (about five float32-sized ones on the torch path), so
# this keeps a pass under ~25 MB whether the tensor is one 7168x18432 matrix or 256 experts: the convert
# memory bound needs it small.
CHUNK_ELEMENTS = 1 << 20


def _e4m3_values() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa * 2.0**-9, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7))
    values = np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


E4M3_VALUES = _e4m3_values()


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 → the nearest bfloat16 (ties to even), kept as float32; for finite inputs.

    >>> round_to_bfloat16(np.array([1 + 2**-8, 1 + 3 * 2**-8], dtype=np.float32)).tolist()
    [1.0, 1.015625]
    """
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 with |x| ≤ 448 → float8_e4m3fn codes, rounding to nearest even (as torch's cast).

    >>> encode_e4m3(np.array([1.0, -448.0, 2**-9, 2**-10, 3 * 2**-10, -0.0], dtype=np.float32)).tolist()
    [56, 254, 1, 0, 2, 128]
    """
    bits = x.view(np.uint32)
    sign = ((bits >> 24) & np.uint32(0x80)).astype(np.uint8)
    magnitude = np.abs(x)
    mbits = magnitude.view(np.uint32)
    exponent = (mbits >> 23).astype(np.int32) - 127
    mantissa = mbits & np.uint32(0x7FFFFF)
    top3 = (mantissa >> 20).astype(np.int32)
    rest = mantissa & np.uint32(0xFFFFF)
    up = (rest > 0x80000) | ((rest == 0x80000) & ((top3 & 1) == 1))
    # A mantissa that rounds up past 7 carries into the exponent field: the codes are contiguous.
    normal = ((exponent + 7) << 3) + top3 + up
    subnormal = np.rint(magnitude * np.float32(512.0)).astype(np.int32)  # units of 2^-9, exact scaling
    code = np.where(exponent >= -6, normal, subnormal)
    return code.astype(np.uint8) | sign


def pow2_ceil(x: np.ndarray) -> np.ndarray:
    """2^ceil(log2(x)) for positive float32 x, from the bits (DeepGEMM's `fast_log2_ceil`), as float32.

    >>> pow2_ceil(np.array([0.25, 0.3, 1000.0], dtype=np.float32)).tolist()
    [0.25, 0.5, 1024.0]
    """
    bits = x.view(np.uint32)
    biased = ((bits >> 23) & np.uint32(0xFF)).astype(np.int32) + ((bits & np.uint32(0x7FFFFF)) != 0)
    return (np.clip(biased, 1, 254).astype(np.uint32) << np.uint32(23)).view(np.float32)


def are_e8m0_powers_of_two(x: np.ndarray) -> bool:
    """Whether every float32 element is a positive power of two that e8m0 holds (2^-127 to 2^127).

    >>> are_e8m0_powers_of_two(np.array([0.5, 1.0, 2.0**-127], np.float32)), are_e8m0_powers_of_two(np.ones(1) * 0.75)
    (True, False)
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    exponent = (bits >> 23) & 0xFF
    normal = ((bits >> 31) == 0) & (exponent >= 1) & (exponent <= 254) & ((bits & 0x7FFFFF) == 0)
    # 2^-127 is the one e8m0 value float32 holds only as a subnormal (0x00400000).
    return bool((normal | (bits == 1 << 22)).all())


def e8m0_codes(pow2: np.ndarray) -> np.ndarray:
    """The e8m0 byte of each float32 power of two: its exponent field (0 for the subnormal 2^-127).

    >>> e8m0_codes(np.array([1.0, 0.5, 2.0**-22], np.float32)).tolist()
    [127, 126, 105]
    """
    return ((np.ascontiguousarray(pow2, dtype=np.float32).view(np.uint32) >> 23) & 0xFF).astype(np.uint8)


def first_negative(scale: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first negative element (NaN and -0.0 are not negative), or None.

    A negative `weight_scale_inv` has no power-of-two form: requantizing it would write NaN codes.

    >>> first_negative(np.array([[1.0, -0.0], [-2.0, 3.0]], np.float32)), first_negative(np.ones(3))
    ((1, 0), None)
    """
    negative = np.asarray(scale, dtype=np.float32) < 0
    if not negative.any():
        return None
    return tuple(int(i) for i in np.argwhere(negative)[0])


def refuse_negative_scale(scale_inv: np.ndarray, name: str) -> None:
    """Raise RequantError naming `name` if a block scale (float32 numpy array) is negative.

    >>> try:
    ...     refuse_negative_scale(np.array([[0.5, -1.0]], np.float32), "demo.weight")
    ... except RequantError as exc:
    ...     print(str(exc)[:73])
    tensor 'demo.weight': weight_scale_inv is negative at index (0, 1) (-1.0)
    """
    where = first_negative(scale_inv)
    if where is not None:
        raise RequantError(f"tensor {name!r}: weight_scale_inv is negative at index {where} "
                           f"({float(scale_inv[where])}); block scales must be positive, the checkpoint is corrupt")


def requant_matrix(codes: np.ndarray, scale: np.ndarray, recipe: str, out: np.ndarray | None = None,
                   use_compiled: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
    """Requantize one [rows, cols] matrix of fp8 codes (uint8) with its float32 block scales.

    Returns (uint8 codes of the same shape, in `out` when given, a C-contiguous array; float32
    power-of-two scales of scale's shape), or None when a block holds a NaN code or a non-finite or
    negative scale, or a non-finite amax. `use_compiled=False` takes the numpy code even where the C one
    was built (the tests compare the two).

    >>> q, sf = requant_matrix(np.full((2, 3), 0x60, np.uint8), np.array([[3.0]], np.float32), "sglang")
    >>> sf.tolist(), int(q[0, 0])  # code 0x60 is 32; 32 * 3 = 96; 96 / 448 → 0.25; 96 / 0.25 = 384 is code 124
    ([[0.25]], 124)
    """
    rows, cols = codes.shape
    codes = np.ascontiguousarray(codes)
    q = np.empty_like(codes) if out is None else out
    if compiled is not None and use_compiled:
        sf = np.empty(scale.shape, dtype=np.float32)
        done = compiled.requant_matrix(codes, rows, cols, np.ascontiguousarray(scale, dtype=np.float32),
                                       recipe == "sglang", q, sf)
        return (q, sf) if done else None
    if not np.isfinite(scale).all() or first_negative(scale) is not None:
        return None
    top = np.empty(scale.shape, dtype=np.uint8)
    _block_top(codes, top)
    if (top == 0x7F).any():
        return None
    tables = block_tables(top, scale, recipe)
    if tables is None:
        return None
    _apply_tables(codes, tables[0], q)
    return q, tables[1]


def block_tables(top: np.ndarray, scale: np.ndarray, recipe: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Each block's new scale and its table of new codes, from the block's largest code and its scale.

    `top` [bn, bk] uint8 (largest code & 0x7F), `scale` [bn, bk] float32 → (tables [bn, bk, 128] uint8,
    sf [bn, bk] float32), or None when a dequantized amax is not finite. `table[c]` is the new code of
    code c ≤ 0x7F; code c | 0x80 (its negative) becomes `table[c] ^ 0x80`: every step of the recipe is
    symmetric, round to nearest even included. Only the entries up to each block's top are meaningful;
    the others are never looked up.

    >>> table, sf = block_tables(np.array([[0x60]], np.uint8), np.array([[3.0]], np.float32), "sglang")
    >>> sf.tolist(), int(table[0, 0, 0x60])
    ([[0.25]], 124)
    """
    with np.errstate(over="ignore", invalid="ignore"):
        x_top = E4M3_VALUES[top] * np.abs(scale)  # |code value · scale|: the scale may be -0.0
        if recipe == "sglang":
            x_top = round_to_bfloat16(x_top)
        if not np.isfinite(x_top).all():
            return None
        sf = pow2_ceil(np.maximum(x_top, AMAX_FLOOR) / FP8_MAX)
        table = E4M3_VALUES[None, None, :128] * scale[:, :, None]
        if recipe == "sglang":
            table = round_to_bfloat16(table)
        return encode_e4m3(table * (np.float32(1.0) / sf)[:, :, None]), sf


def _block_top(codes: np.ndarray, top: np.ndarray) -> None:
    magnitudes = codes & np.uint8(0x7F)
    starts = np.arange(0, codes.shape[1], BLOCK)
    for i in range(top.shape[0]):
        column_max = magnitudes[i * BLOCK:(i + 1) * BLOCK].max(axis=0)
        top[i] = np.maximum.reduceat(column_max, starts)


def _apply_tables(codes: np.ndarray, positive: np.ndarray, out: np.ndarray) -> None:
    table = np.concatenate([positive, positive ^ np.uint8(0x80)], axis=-1)  # bytes.translate wants all 256
    for i in range(table.shape[0]):
        rows = slice(i * BLOCK, (i + 1) * BLOCK)
        for j in range(table.shape[1]):
            cols = slice(j * BLOCK, (j + 1) * BLOCK)
            block = codes[rows, cols]
            # bytes.translate maps the block through its table at memcpy-like speed (holding the GIL).
            out[rows, cols] = np.frombuffer(block.tobytes().translate(table[i, j].tobytes()),
                                            np.uint8).reshape(block.shape)


def requant_codes(
    codes: np.ndarray, scale: np.ndarray, recipe: str, chunk_elements: int = CHUNK_ELEMENTS,
    use_compiled: bool = True,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Requantize fp8 codes [..., N, K] (uint8) with float32 scales [..., ceil(N/128), ceil(K/128)].

    Experts are independent matrices and 128-row stripes are independent blocks, so the work is done a
    few stripes (about `chunk_elements` codes) at a time, which bounds memory and gives the same bytes.
    Returns None where `requant_matrix` does, or for a scale of the wrong shape (the torch path then
    reports it).

    >>> q, sf = requant_codes(np.zeros((2, 130, 3), np.uint8), np.ones((2, 2, 1), np.float32), "sglang")
    >>> q.shape, sf.shape, float(sf.min())
    ((2, 130, 3), (2, 2, 1), 2.384185791015625e-07)
    """
    *lead, n, k = codes.shape
    blocks_n, blocks_k = -(-n // BLOCK), -(-k // BLOCK)
    if tuple(scale.shape) != (*lead, blocks_n, blocks_k) or scale.dtype != np.float32:
        return None
    matrices, scales = codes.reshape(-1, n, k), scale.reshape(-1, blocks_n, blocks_k)
    q, sf = np.empty_like(matrices), np.empty_like(scales)
    rows_per_pass = BLOCK * max(1, chunk_elements // (BLOCK * BLOCK * blocks_k))
    if compiled is not None and use_compiled:
        rows_per_pass = n  # the compiled requant keeps one row of tables, whatever the pass
    for e in range(matrices.shape[0]):
        for row0 in range(0, n, rows_per_pass):
            row1 = min(n, row0 + rows_per_pass)
            stripes = slice(row0 // BLOCK, -(-row1 // BLOCK))
            result = requant_matrix(matrices[e, row0:row1], scales[e, stripes], recipe, out=q[e, row0:row1],
                                    use_compiled=use_compiled)
            if result is None:
                return None
            sf[e, stripes] = result[1]
    return q.reshape(codes.shape), sf.reshape(scale.shape)
