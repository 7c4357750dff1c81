"""Block-FP8 linear layers without a downloaded kernel: what `shardprep run` and `profile` compute FP8 models with.

A block-FP8 checkpoint (DeepSeek-V3/R1, Kimi-K2: `quantization_config.quant_method = "fp8"`, 128×128 blocks)
stores each projection as float8_e4m3fn codes with one scale per block (`weight_scale_inv`). transformers
builds such layers as `FP8Linear` / `FP8Experts`, whose forward fetches its kernel from the hub at run time
(`kernels-community/finegrained-fp8` or DeepGEMM), which an offline machine cannot, and on a machine
without a GPU it dequantizes the whole model to bf16 at load instead. shardprep keeps the FP8 codes and
scales where transformers put them (a bound weight is a view of its gathered slot) and computes with:

- CUDA, SM90 and later, N a multiple of 128 and K of 512 (`uses_scaled_mm`): torch's block-scaled GEMM
  (`torch._scaled_mm` with 1×128 activation scales and 128×128 weight scales). The activations are
  quantized per token and 128 columns (amax / 448, as DeepSeek's recipe) by one Triton kernel
  (`fp8_activation_kernel.py`), eagerly and inside CUDA graphs alike; without Triton, by plain torch ops
  (the same codes, in several launches). At decode sizes that kernel is what makes FP8 pay (docs/benchmarks.md).
- Everywhere else (the CPU, odd shapes): dequantize the weight block by block in fp32, round it to the
  activations' dtype and `F.linear`. Deterministic: the same inputs give the same bits on every run,
  which is what the sharded-against-unsharded comparisons need.

Both read the weight and its scales in place: no copy of them is made or kept per forward (the CPU path's
dequantized weight is a temporary of the matmul). docs/runtime.md ("Block-FP8 models") says why the scales
stay replicated.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import RuntimeShardError

FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value: activation scales are amax / FP8_MAX."""
BLOCK = 128
"""The only block size the CUDA path takes (DeepSeek's, and torch's BlockWise1x128 / 128x128)."""
ROWS_MULTIPLE = 4
"""cuBLAS's block-scaled GEMM (torch 2.11, H200) runs only for row counts that are a multiple of 4: 1-3, 5, 7
rows raised CUBLAS_STATUS_NOT_SUPPORTED; the activations are padded with zero rows to one."""
SCALE_STRIDE_BLOCKS = 4
"""K in whole 128-blocks, a multiple of 4 of them: 16 bytes of float32 scales per row (see `uses_scaled_mm`)."""


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight that float8 codes `weight` and per-block scales `scale_inv` [⌈N/b0⌉, ⌈K/b1⌉] encode.

    Multiplied in fp32, then rounded once to `dtype` (the last block of a row or column may be partial).

    >>> codes = torch.full((2, 3), 2.0).to(torch.float8_e4m3fn)
    >>> dequantize_blocks(codes, torch.tensor([[0.5]]), (128, 128), torch.float32)
    tensor([[1., 1., 1.],
            [1., 1., 1.]])
    """
    n, k = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :k]
    return (weight.float() * scale).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and 128 columns: float8_e4m3fn codes of a [M, K] activation and their float32 scales [M, K/128].

    >>> q, s = quantize_activations(torch.ones(2, 128))
    >>> q.dtype, torch.equal(s, torch.full((2, 1), 1 / 448)), q.float().unique().tolist()
    (torch.float8_e4m3fn, True, [448.0])
    """
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    # An all-zero group has no amax; any positive scale encodes it (and keeps 0/0 out of the codes).
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    # |x| / (amax / 448) exceeds 448 by two fp32 roundings at most, which e4m3 rounds back to 448: no clamp.
    codes = (groups / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return codes.view(m, k), scale


def _gemm_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and outer-dim-major scales of CUDA rows, as the GEMM takes them: one Triton kernel where Triton is."""
    quantize = _triton_quantize()
    if quantize is not None:
        return quantize(rows)
    codes, scale = quantize_activations(rows)
    # torch's block-scaled GEMM takes the 1×128 activation scales outer-dim-major (any other layout:
    # "Invalid scaling configuration").
    return codes, scale.t().contiguous().t()


@functools.cache
def _triton_quantize() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    try:
        from .fp8_activation_kernel import quantize_for_gemm
    except ImportError:  # no Triton: several torch ops and a copy instead of one kernel (the same codes)
        return None
    return quantize_for_gemm


def uses_scaled_mm(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether `block_fp8_linear` of these runs torch's block-scaled GEMM (else the dequantizing path).

    Needs SM90+, 128×128 blocks, N a multiple of 128 and K of 512 (whole 128-blocks, a multiple of 4 of them):
    the GEMM reads the weight scales transposed, K/128 floats apart, and with a stride that is not a multiple
    of 16 bytes cuBLAS's kernel (torch 2.11, H200) gave results that changed with where the scales were
    allocated (tests/standalone/test_gpu_fp8.py). DeepSeek-V3's and Kimi-K2's projections all have such K.

    >>> uses_scaled_mm(torch.zeros(1, 512), torch.zeros(128, 512, dtype=torch.float8_e4m3fn), (128, 128))
    False
    """
    n, k = weight.shape
    return (x.is_cuda and tuple(block) == (BLOCK, BLOCK) and n % BLOCK == 0
            and k % (SCALE_STRIDE_BLOCKS * BLOCK) == 0 and torch.cuda.get_device_capability(x.device) >= (9, 0))


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for the block-FP8 weight W = (`weight` codes, `scale_inv` per block), in x's dtype.

    On the GEMM path the activations are quantized by one Triton kernel, the same one eagerly and inside a
    CUDA graph capture, so eager forwards and graph replays give the same bits (tests/standalone/test_gpu_fp8.py); its
    codes and scales are those of `quantize_activations` on CUDA, bit for bit (tested too).

    >>> w = torch.full((4, 8), 1.0).to(torch.float8_e4m3fn)
    >>> block_fp8_linear(torch.ones(1, 8, dtype=torch.bfloat16), w, torch.tensor([[0.25]]), (128, 128))
    tensor([[2., 2., 2., 2.]], dtype=torch.bfloat16)
    """
    if not uses_scaled_mm(x, weight, block):
        return F.linear(x, dequantize_blocks(weight, scale_inv, block, x.dtype), bias)
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m % ROWS_MULTIPLE:  # cuBLAS has no block-scaled kernel for other row counts (CUBLAS_STATUS_NOT_SUPPORTED)
        rows = F.pad(rows, (0, 0, 0, ROWS_MULTIPLE - m % ROWS_MULTIPLE))
    codes, scale = _gemm_activations(rows)
    # The 128×128 weight scales go in transposed, like the weight.
    out = torch._scaled_mm(codes, weight.t(), scale_a=scale, scale_b=scale_inv.t(), out_dtype=x.dtype)[:m]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def block_size(config: Any) -> tuple[int, int] | None:
    """The block of a config's block-FP8 quantization (`quant_method` fp8 with `weight_block_size`), else None.

    >>> block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    (128, 128)
    """
    q = (config.get("quantization_config") if isinstance(config, dict)
         else getattr(config, "quantization_config", None))
    if q is not None and not isinstance(q, dict):
        q = q.to_dict()
    if not q or q.get("quant_method") != "fp8" or not q.get("weight_block_size"):
        return None
    b0, b1 = q["weight_block_size"]
    return int(b0), int(b1)


def use_block_fp8_kernels(model: nn.Module, block: tuple[int, int]) -> int:
    """Point every FP8 layer transformers built (`FP8Linear`, `FP8Experts`) at `block_fp8_linear`; how many.

    Scales stored as UE8M0 (float8_e8m0fnu) become float32 once, here: the GEMMs take float32 scales, and
    a power of two is the same number in both.

    >>> use_block_fp8_kernels(model, (128, 128))  # doctest: +SKIP
    """
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            _scales_as_float32(module, ["weight_scale_inv"])
            module.forward = MethodType(_fp8_linear_forward, module)  # type: ignore[method-assign]
        elif isinstance(module, FP8Experts):
            scales = [n for n, _ in module.named_parameters(recurse=False) if n.endswith("_scale_inv")]
            _scales_as_float32(module, scales)
            module.linear = MethodType(_fp8_experts_linear, module)  # type: ignore[method-assign]
            # transformers' experts loop, which calls `self.linear` per expert; its other implementations
            # (grouped_mm, deepgemm) call the hub kernel directly.
            module.forward = MethodType(_eager_experts_forward(type(module), name), module)  # type: ignore[method-assign]
        else:
            continue
        if tuple(module.block_size or ()) != tuple(block):
            raise RuntimeShardError(f"{name}: block size {module.block_size} differs from the config's {list(block)}")
        count += 1
    return count


def _fp8_linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size, self.bias)


def _fp8_experts_linear(self: Any, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                        activation_scale: torch.Tensor | None = None) -> torch.Tensor:
    if activation_scale is not None:
        raise RuntimeShardError("static activation scales (activation_scheme 'static') are not supported; "
                                "shardprep computes block-FP8 layers with dynamic per-token scales")
    return block_fp8_linear(x, weight, scale_inv, self.block_size)


def _eager_experts_forward(cls: Any, name: str) -> Callable[..., torch.Tensor]:
    forward: Any = inspect.unwrap(cls.forward)  # under transformers' dispatch by `config._experts_implementation`
    if not forward.__qualname__.endswith("FP8Experts.forward"):
        raise RuntimeShardError(f"{name}: this transformers' {cls.__name__} has no per-expert loop to compute "
                                "with; use a transformers version shardprep was tested with (5.x)")
    return forward


def _scales_as_float32(module: nn.Module, names: list[str]) -> None:
    for name in names:
        scale = getattr(module, name)
        if scale is not None and scale.dtype != torch.float32:
            setattr(module, name, nn.Parameter(scale.detach().float(), requires_grad=False))


__all__ = ["BLOCK", "FP8_MAX", "block_fp8_linear", "block_size", "dequantize_blocks", "quantize_activations",
           "use_block_fp8_kernels", "uses_scaled_mm"]
