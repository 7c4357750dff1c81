"""Test-only SGLang plugin: SGLang's block-FP8 CPU path on any CPU, its four compiled kernels defined in torch;
never shipped in shardprep.

SGLang 0.5.23 runs block FP8 on the CPU only through its AMX path: `Fp8LinearMethod` and `Fp8MoEMethod`
(`layers/quantization/fp8.py`) assert, after loading, a flag computed when the module is imported
(`_is_cpu_amx_available = cpu_has_amx_support()`: torch's AMX check and the presence of `sgl_kernel`'s compiled
`convert_weight_packed`), then pack each weight with that op (`layers/amx_utils.py`), and their forwards call
`sgl_kernel`'s compiled `fp8_scaled_mm_cpu(..., is_vnni=True)` and `fused_experts_cpu` (W8A16); DeepSeek's MoE adds
its shared expert with `shared_expert_cpu` (`models/deepseek_v2.py`, `forward_cpu`). No CPU build of those kernels
is published (stand_ins/sgl_kernel.py), and this machine has no AMX. With SHARDPREP_TEST_FP8_KERNELS=1 in an
engine's environment this plugin:

- turns on that check in `fp8.py` and `amx_utils` only (`fp8._is_cpu_amx_available`, `amx_utils.cpu_has_amx_support`);
  torch's AMX check, and every other module's flag (unquantized layers, norms, rope, attention, the AMX attention
  backend) stay as they were: `_is_intel_amx_backend_available` is cached (False) before the ops below exist, so
  that on an AMX CPU too nothing else takes the AMX path;
- defines the four ops as `torch.ops.sgl_kernel.*`, with 0.5.23's signatures (`fused_experts_cpu` with an integer
  quant method and a string activation; `shared_expert_cpu` without a1/a2 scales), in torch:
  `convert_weight_packed` VNNI-packs as the C++ op does (`vnni_pack`: each block of 32 rows [n, K] laid out
  [K/2, n, 2]; shape and FP8 dtype kept); the three GEMMs undo that packing (`vnni_unpack`), dequantize each
  128×128 block in float32 and multiply in float32, so their results depend on no AMX and no kernel choice.

What SGLang does with the weights after loading (which weights it packs, which it leaves unpacked: rows not a
multiple of 16 or columns not of 32 are left as loaded, the scales kept float32 `[ceil(N/128), ceil(K/128)]`), and
what its forwards hand the kernels, is SGLang's own Python; only the compiled ops are replaced. The ops refuse what
they do not stand in for (another quant method, activation or weight shape), naming it. The plugin logs `LINE` once
per process. Declared as a `sglang.srt.plugins` entry point by the engine runner (sglang_runs.py); no SGLang file
is changed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

NAME = "shardprep_test_fp8_kernels"
ENV = "SHARDPREP_TEST_FP8_KERNELS"
FP8_KERNELS = {ENV: "1"}
LINE = "shardprep test plugin: SGLang's block-FP8 CPU path on (fp8.py, amx_utils), its kernels in torch"
VNNI_ROWS = 32  # rows SGLang's C++ packing takes at a time (block_size_n(): 2 x TILE_N)
FP8_W8A16 = 2  # sglang.srt.layers.amx_utils.CPUQuantMethod.FP8_W8A16
_library: Any = None  # the torch.library fragment holding the ops (kept alive for the process)


def vnni_pack(weight: torch.Tensor) -> torch.Tensor:
    """`convert_weight_packed`'s layout: [..., OC, IC], each block of 32 rows (the last one may hold 16) [n, IC]
    rewritten as [IC/2, n, 2]; the shape and dtype are kept. OC must be a multiple of 16 and IC of 32, which
    SGLang checks before it packs (`amx_utils.dim_is_supported`); the C++ op's other case, OC < 16 (a transposed
    float32 copy), is not stood in for.

    >>> w = torch.arange(32 * 64, dtype=torch.int16).view(32, 64).to(torch.uint8)
    >>> p = vnni_pack(w)
    >>> p.shape == w.shape, p.view(32, 32, 2)[0, :2].tolist(), torch.equal(vnni_unpack(p), w)
    (True, [[0, 1], [64, 65]], True)
    """
    return _vnni(weight, pack=True)


def vnni_unpack(packed: torch.Tensor) -> torch.Tensor:
    """`vnni_pack`'s inverse: the weight as loaded, [..., OC, IC].

    >>> w = torch.randint(0, 255, (3, 48, 32), dtype=torch.uint8)
    >>> torch.equal(vnni_unpack(vnni_pack(w)), w)
    True
    """
    return _vnni(packed, pack=False)


def _vnni(weight: torch.Tensor, pack: bool) -> torch.Tensor:
    *lead, oc, ic = weight.shape
    _check_packable(oc, ic)
    data = weight.contiguous().view(torch.uint8)  # byte moves, whatever the 1-byte dtype
    out = torch.empty_like(data)
    whole = oc // VNNI_ROWS * VNNI_ROWS
    for start, rows in ((0, VNNI_ROWS), (whole, oc - whole)):  # the 32-row blocks, then a last one of 16 if any
        end = whole if start == 0 else oc
        if end > start:
            blocks = data[..., start:end, :].reshape(*lead, (end - start) // rows, -1)
            # Each block's bytes: [rows, IC/2, 2] as loaded, [IC/2, rows, 2] packed.
            shape = (rows, ic // 2, 2) if pack else (ic // 2, rows, 2)
            out[..., start:end, :] = blocks.reshape(*blocks.shape[:-1], *shape).transpose(-3, -2).reshape(
                *lead, end - start, ic)
    return out.view(weight.dtype)


def _check_packable(oc: int, ic: int) -> None:
    if oc < 16 or oc % 16 or ic % 32:
        raise NotImplementedError(f"the VNNI stand-in takes OC a multiple of 16 and IC of 32, got [{oc}, {ic}]")


def block_dequantize(weight: torch.Tensor, scale: torch.Tensor, block_size: list[int]) -> torch.Tensor:
    """The float32 values of a block-FP8 weight [..., N, K] with its scales [..., ceil(N/bn), ceil(K/bk)].

    >>> w = torch.full((130, 3), 2.0).to(torch.float8_e4m3fn)
    >>> block_dequantize(w, torch.tensor([[0.5], [4.0]]), [128, 128])[[0, 129], 0].tolist()
    [1.0, 8.0]
    """
    bn, bk = block_size
    n, k = weight.shape[-2:]
    full = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return weight.float() * full


def _weight(w: torch.Tensor, scale: torch.Tensor | None, block_size: list[int] | None, is_vnni: bool) -> torch.Tensor:
    if scale is None or block_size is None:
        raise NotImplementedError("the FP8 stand-ins take block-FP8 weights with their scales and block size")
    return block_dequantize(vnni_unpack(w) if is_vnni else w, scale, list(block_size))


def fp8_scaled_mm_cpu(mat1: torch.Tensor, mat2: torch.Tensor, scales2: torch.Tensor, block_size: list[int],
                      bias: torch.Tensor | None, out_dtype: torch.dtype, is_vnni: bool) -> torch.Tensor:
    """`mat1 @ dequantize(mat2).T (+ bias)` in float32, as `out_dtype`: mat2 [N, K] block FP8, VNNI-packed if
    `is_vnni`.

    >>> w = torch.ones(32, 32).to(torch.float8_e4m3fn)
    >>> y = fp8_scaled_mm_cpu(torch.ones(1, 32), vnni_pack(w), torch.tensor([[0.5]]), [128, 128], None,
    ...                       torch.bfloat16, True)
    >>> y.shape, y.dtype, y[0, 0].item()
    (torch.Size([1, 32]), torch.bfloat16, 16.0)
    """
    out = mat1.float() @ _weight(mat2, scales2, block_size, is_vnni).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def fused_experts_cpu(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, inplace: bool, moe_comp_method: int, w1_scale: torch.Tensor | None,
                      w2_scale: torch.Tensor | None, w1_zero: torch.Tensor | None, w2_zero: torch.Tensor | None,
                      block_size: list[int] | None, w1_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                      alpha: float | None, limit: float | None, is_vnni: bool, activation: str | None) -> torch.Tensor:
    """The routed experts, W8A16: for each token, the sum over its top-k experts e of
    `topk_weight · w2[e] @ silu_and_mul(w1[e] @ x)` in float32 (w1 [E, 2I, H] = [gate; up], w2 [E, H, I], block
    FP8), as the hidden states' dtype. Only what SGLang's `Fp8MoEMethod` passes is stood in for: FP8_W8A16, silu,
    no zero points, biases, alpha or limit, not in place.

    >>> w1, w2 = torch.ones(2, 64, 32).to(torch.float8_e4m3fn), torch.ones(2, 32, 32).to(torch.float8_e4m3fn)
    >>> scales, ids = torch.ones(2, 1, 1), torch.tensor([[1, 0]], dtype=torch.int32)
    >>> x, weights = torch.full((1, 32), 1 / 32), torch.tensor([[0.5, 0.25]])
    >>> y = fused_experts_cpu(x, vnni_pack(w1), vnni_pack(w2), weights, ids, False, 2, scales, scales, None, None,
    ...                       [128, 128], None, None, None, None, True, "silu")
    >>> y.shape, round(y[0, 0].item(), 3)  # 32 x silu(1) x (0.5 + 0.25)
    (torch.Size([1, 32]), 17.545)
    """
    extras = {"w1_zero": w1_zero, "w2_zero": w2_zero, "w1_bias": w1_bias, "w2_bias": w2_bias, "alpha": alpha,
              "limit": limit}
    given = [name for name, value in extras.items() if value is not None]
    if moe_comp_method != FP8_W8A16 or activation != "silu" or inplace or given:
        raise NotImplementedError(f"fused_experts_cpu: the stand-in takes FP8_W8A16 ({FP8_W8A16}), silu, not in place "
                                  f"and no {'/'.join(extras)}; got {moe_comp_method}, {activation!r}, inplace "
                                  f"{inplace}, {given}")
    if w1.shape[-1] != w2.shape[-2] or w1.shape[-2] != 2 * w2.shape[-1]:
        raise NotImplementedError("fused_experts_cpu: the stand-in takes w1 and w2 packed alike (is_vnni)")
    up = _weight(w1, w1_scale, block_size, is_vnni)  # [E, 2I, H]
    down = _weight(w2, w2_scale, block_size, is_vnni)  # [E, H, I]
    x = hidden_states.float()
    routed = torch.zeros(*topk_ids.shape, x.shape[-1])  # [tokens, top-k, H]: summed in slot order below
    for expert in range(up.shape[0]):
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        if tokens.numel():
            routed[tokens, slots] = _silu_and_mul(x[tokens] @ up[expert].t()) @ down[expert].t()
    return (routed * topk_weights.float()[..., None]).sum(dim=1).to(hidden_states.dtype)


def shared_expert_cpu(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      fused_experts_out: torch.Tensor, routed_scaling_factor: float, inplace: bool,
                      use_int8_w8a8: bool, use_fp8_w8a16: bool, w1_scale: torch.Tensor | None,
                      w2_scale: torch.Tensor | None, block_size: list[int] | None, is_vnni: bool) -> torch.Tensor:
    """DeepSeek's shared expert added to the routed experts' output: `w2 @ silu_and_mul(w1 @ x) +
    fused_experts_out · routed_scaling_factor` in float32 (w1 [2I, H], w2 [H, I], block FP8), as the hidden states'
    dtype; written into `hidden_states` and returned when `inplace`, as the C++ op does. FP8 only.

    >>> w1, w2 = torch.zeros(32, 32).to(torch.float8_e4m3fn), torch.zeros(32, 16).to(torch.float8_e4m3fn)
    >>> x = torch.zeros(2, 32, dtype=torch.bfloat16)
    >>> y = shared_expert_cpu(x, vnni_pack(w1), w2, torch.ones(2, 32, dtype=torch.bfloat16), 2.5, True, False,
    ...                       True, torch.ones(1, 1), torch.ones(1, 1), [128, 128], False)
    >>> y is x, x[0, 0].item()
    (True, 2.5)
    """
    if use_int8_w8a8 or not use_fp8_w8a16:
        raise NotImplementedError("shared_expert_cpu: the stand-in takes FP8 weights (use_fp8_w8a16) only")
    x = hidden_states.float()
    shared = _silu_and_mul(x @ _weight(w1, w1_scale, block_size, is_vnni).t()) @ _weight(
        w2, w2_scale, block_size, is_vnni).t()
    out = (shared + fused_experts_out.float() * routed_scaling_factor).to(hidden_states.dtype)
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out


SCHEMAS = {
    "convert_weight_packed": "(Tensor weight) -> Tensor",
    "fp8_scaled_mm_cpu": "(Tensor mat1, Tensor mat2, Tensor scales2, int[] block_size, Tensor? bias, "
                         "ScalarType out_dtype, bool is_vnni) -> Tensor",
    "fused_experts_cpu": "(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
                         "bool inplace, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, Tensor? w1_zero, "
                         "Tensor? w2_zero, int[]? block_size, Tensor? w1_bias, Tensor? w2_bias, float? alpha, "
                         "float? limit, bool is_vnni, str? activation) -> Tensor",
    "shared_expert_cpu": "(Tensor hidden_states, Tensor w1, Tensor w2, Tensor fused_experts_out, "
                         "float routed_scaling_factor, bool inplace, bool use_int8_w8a8, bool use_fp8_w8a16, "
                         "Tensor? w1_scale, Tensor? w2_scale, int[]? block_size, bool is_vnni) -> Tensor",
}
"""0.5.23's schemas of the four ops (sgl-kernel's `torch_extension_cpu.cpp`), as SGLang's Python calls them."""
IMPLEMENTATIONS = {"convert_weight_packed": vnni_pack, "fp8_scaled_mm_cpu": fp8_scaled_mm_cpu,
                   "fused_experts_cpu": fused_experts_cpu, "shared_expert_cpu": shared_expert_cpu}


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`); does nothing unless `ENV` is 1."""
    global _library
    if os.environ.get(ENV) != "1" or _library is not None:
        return
    from sglang.srt.layers import amx_utils
    from sglang.srt.layers.quantization import fp8
    from sglang.srt.utils import common

    # Cached before the ops exist: `cpu_has_amx_support()` everywhere else keeps answering as without them.
    common._is_intel_amx_backend_available()
    _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, schema in SCHEMAS.items():
        _library.define(name + schema)
        _library.impl(name, IMPLEMENTATIONS[name], "CPU")
    amx_utils.cpu_has_amx_support = lambda: True
    fp8._is_cpu_amx_available = True
    logging.getLogger("sglang.shardprep").warning(LINE)
