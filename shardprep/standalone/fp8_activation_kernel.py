"""One Triton kernel that quantizes activations for torch's block-scaled GEMM: codes and scales in one launch.

`block_fp8_linear` quantizes its input per row and 128 columns (amax / 448) before each GEMM. As torch ops
that is seven launches and a transposing copy of the scales; compiled by Inductor with a dynamic row count it
is three kernels (a reduction, the codes, a copy of the scales into the GEMM's layout), 23 µs against this
kernel's 6 µs for 128 × 28672 on the H200 (docs/benchmarks.md). This kernel reads each 128-column
group of a block of rows once and writes the e4m3 codes row-major and the float32 scales straight into
the outer-dim-major layout the GEMM takes (`scale[m, g]` at `g * M + m`), so nothing is copied after it.

It computes what `quantize_activations` does on CUDA, bit for bit: the scale is the clamped amax times the
float32 reciprocal of 448 (torch's CUDA division by a Python scalar multiplies by its reciprocal), each
code the correctly rounded quotient of the value by its scale, rounded to e4m3 (tests/standalone/test_gpu_fp8.py).
Imported only on CUDA, where Triton comes with torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128
"""Columns per scale (torch's BlockWise1x128)."""
BLOCK_ROWS = 16
"""Rows per program: 16 × 128 bf16 values (4 KiB) read at once, 16 scales written side by side."""
_INV_FP8_MAX = 1.0 / 448.0


@triton.jit(do_not_specialize=["rows"])
def _quantize_rows(x_ptr, codes_ptr, scale_ptr, rows, x_row_stride, k, inv_fp8_max,  # type: ignore[no-untyped-def]
                   BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    g = tl.program_id(1)
    c = g * GROUP + tl.arange(0, GROUP)
    inside = r < rows
    r64 = r.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * x_row_stride + c[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
    # An all-zero group has no amax; any positive scale encodes it (and keeps 0/0 out of the codes).
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) * inv_fp8_max
    codes = tl.div_rn(x, scale[:, None]).to(tl.float8e4nv)
    tl.store(codes_ptr + r64[:, None] * k + c[None, :], codes, mask=inside[:, None])
    tl.store(scale_ptr + g.to(tl.int64) * rows + r64, scale, mask=inside)


def quantize_for_gemm(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [M, K] (row-major) and float32 scales [M, K/128] (outer-dim-major) of CUDA rows [M, K].

    `rows` is 2-D with K a multiple of 128; one launch, capturable in a CUDA graph. For 4 rows of ones and
    K = 256, every code is 448 and the scales [4, 2] have strides (1, 4):

    >>> codes, scale = quantize_for_gemm(torch.ones(4, 256, device="cuda", dtype=torch.bfloat16))  # doctest: +SKIP
    """
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    codes = torch.empty((m, k), device=rows.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((k // GROUP, m), device=rows.device, dtype=torch.float32).t()
    grid = (triton.cdiv(m, BLOCK_ROWS), k // GROUP)
    _quantize_rows[grid](rows, codes, scale, m, rows.stride(0), k, _INV_FP8_MAX,
                         BLOCK_ROWS=BLOCK_ROWS, GROUP=GROUP)
    return codes, scale
