"""A vLLM plugin for the tests: vLLM's DeepGEMM block-FP8 path as on an SM100 GPU (B200), on the CPU.

On a B200, vLLM serves block-FP8 linear layers with `DeepGemmFp8BlockScaledMMKernel`. Its post-load step
(`deepgemm_post_process_fp8_weight_block`) requantizes each weight to UE8M0 in place and turns each block scale
into DeepGEMM's SM100 layout with `transform_sf_into_required_layout`: packed UE8M0, int32 `[N, ⌈K/512⌉]`, MN-major,
strides `(1, align(N, 4))`; at every GEMM DeepGEMM asserts those strides. With SHARDPREP_TEST_DEEP_GEMM_SM100=1 in
an engine's environment, vLLM takes that path on the CPU:

- vLLM's: the kernel choice (`DeepGemmFp8BlockScaledMMKernel` is put first among the CPU's block-FP8 kernels and
  told it is supported; vLLM's `can_implement` still decides per layer), its post-load step (the UE8M0 requant,
  `replace_parameter`, `deep_gemm_warmup_provider`), its activation quantization (QuantFP8, UE8M0 scales), and
  every caller (MLA's kv_b_proj dequantization runs the layer on an identity, as with DeepGEMM on GPUs);
- emulated, in `vllm.utils.deep_gemm`'s slots for DeepGEMM's functions: `transform_sf_into_required_layout`, with
  SM100's result (shape, dtype int32, strides, four UE8M0 exponents per word, the padding rows left as torch.empty
  leaves them, as DeepGEMM does), and `fp8_gemm_nt`, a float32 torch reference that asserts the weight's layout
  and the scale's strides as DeepGEMM does and reads the scale's exponents through those strides;
- what vLLM asks of the machine: `is_deep_gemm_supported` and `is_deep_gemm_e8m0_used` answer True in
  `vllm.utils.deep_gemm`, the DeepGEMM kernel module and `Fp8LinearMethod`'s module (the other importers, the MoE
  among them, keep their answers: no other DeepGEMM kernel is emulated).

It logs `LINE` once per process, so a test can check that it ran. Registered as a `vllm.general_plugins` entry
point by `engine_runs.run_engines`.
"""

from __future__ import annotations

import logging
import math
import os

ENV = "SHARDPREP_TEST_DEEP_GEMM_SM100"
DEEP_GEMM_SM100 = {ENV: "1"}
NAME = "shardprep_deep_gemm_sm100"
LINE = "shardprep test plugin: DeepGEMM's SM100 scale layout and GEMM emulated, vLLM's DeepGEMM kernel in charge"
GEMM_LINE = "shardprep test plugin: emulated DeepGEMM fp8_gemm_nt checked the SM100 scale strides of"
BLOCK = 128


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    import vllm.utils.deep_gemm as deep_gemm
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm import deep_gemm as kernel_module
    from vllm.model_executor.layers.quantization import fp8
    from vllm.platforms import PlatformEnum

    if getattr(deep_gemm, "_shardprep_sm100", False):  # vLLM calls every plugin once per process, maybe more
        return
    for module in (deep_gemm, kernel_module, fp8):
        module.is_deep_gemm_supported = _yes
    for module in (deep_gemm, kernel_module):
        module.is_deep_gemm_e8m0_used = _yes
    # DeepGEMM's functions: vLLM's wrappers call these slots once one is set (`_lazy_init` imports nothing then).
    deep_gemm._transform_sf_into_required_layout_impl = transform_sf_into_required_layout
    deep_gemm._fp8_gemm_nt_impl = fp8_gemm_nt
    kernel = kernel_module.DeepGemmFp8BlockScaledMMKernel

    @classmethod
    def is_supported(cls, compute_capability=None):
        return True, None

    kernel.is_supported = is_supported
    cpu = linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if kernel not in cpu:
        cpu.insert(0, kernel)
    deep_gemm._shardprep_sm100 = True
    logging.getLogger("vllm.shardprep").warning(LINE)


def _yes() -> bool:
    return True


def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, is_sfa=False, disable_ue8m0_cast=False):
    """DeepGEMM's SM100 result for a weight's fp32 128×128 block scales `sf` ([G,] ⌈mn/128⌉, ⌈k/128⌉): one scale per
    row, as UE8M0 exponents packed four to an int32 (block 4j in the low byte of word j), MN-major in a storage of
    align(mn, 4)·⌈k/512⌉ words per group: shape [G,] mn, ⌈k/512⌉, strides ([align·⌈k/512⌉,] 1, align(mn, 4))."""
    import torch

    assert not disable_ue8m0_cast, "the emulation is SM100 with E8M0 scales"
    assert tuple(recipe) == (1, BLOCK, BLOCK) and not is_sfa and sf.dtype == torch.float32, (recipe, is_sfa, sf.dtype)
    groups = sf if sf.dim() == 3 else sf.unsqueeze(0)
    bits = groups.contiguous().view(torch.int32)
    assert bool(((bits & 0x7FFFFF) == 0).all()), "UE8M0 scales are powers of two (vLLM requantized them first)"
    per_row = ((bits >> 23) & 0xFF).repeat_interleave(BLOCK, dim=1)[:, :mn]  # [G, mn, ⌈k/128⌉] exponents
    blocks, words = per_row.shape[2], math.ceil(k / (4 * BLOCK))
    padded = torch.zeros(groups.shape[0], mn, 4 * words, dtype=torch.int32)
    padded[:, :, :blocks] = per_row
    packed = padded.view(groups.shape[0], mn, words, 4)
    packed = packed[..., 0] | packed[..., 1] << 8 | packed[..., 2] << 16 | packed[..., 3] << 24
    aligned = (mn + 3) // 4 * 4
    out = torch.empty(groups.shape[0], words, aligned, dtype=torch.int32).transpose(1, 2)[:, :mn]
    out.copy_(packed)
    return out if sf.dim() == 3 else out.squeeze(0)


_checked: set[tuple[int, int]] = set()


def fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
    """d = a · bᵀ for a = (x e4m3 [M, K], fp32 per-128 scales [M, ⌈K/128⌉]), b = (w e4m3 [N, K], the SM100 packed
    scale): DeepGEMM's contract, in float32. Asserts what DeepGEMM asserts of the scale's layout."""
    import torch

    (x, sx), (w, sw) = a, b
    n, k = w.shape
    words, aligned = math.ceil(k / (4 * BLOCK)), (n + 3) // 4 * 4
    assert c is None and not disable_ue8m0_cast
    assert w.stride() == (k, 1) and x.stride(-1) == 1, "DeepGEMM's NT GEMM reads K-major operands"
    assert sw.dtype == torch.int32 and tuple(sw.shape) == (n, words), (sw.dtype, tuple(sw.shape))
    # DeepGEMM's check of an MN-major TMA-aligned scale (sm100 fp8 gemm: `check_sf_layout`).
    assert sw.stride(-2) == 1 and sw.stride(-1) == aligned, f"scale strides {sw.stride()}, expected (1, {aligned})"
    # The exponents read through the scale's own strides (elementwise ops index the strided tensor).
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    exponents = ((sw.unsqueeze(-1) >> shifts) & 0xFF).reshape(n, 4 * words)[:, :math.ceil(k / BLOCK)]
    w_scale = (exponents << 23).view(torch.float32).repeat_interleave(BLOCK, dim=1)[:, :k]
    # DeepGEMM casts fp32 activation scales to UE8M0 (powers of two, rounded up); QuantFP8 made them so already.
    x_scale = torch.exp2(torch.ceil(torch.log2(sx.float()))).repeat_interleave(BLOCK, dim=1)[:, :k]
    out = (x.float() * x_scale) @ (w.float() * w_scale).t()
    d.copy_(out.to(d.dtype))
    if (n, k) not in _checked:
        _checked.add((n, k))
        logging.getLogger("vllm.shardprep").warning("%s [%d, %d] (strides %s)", GEMM_LINE, n, words, sw.stride())
