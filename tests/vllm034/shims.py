"""What vLLM 0.34.0's own (CUDA) wheel needs to build and load models on this CPU, with torch 2.13 CPU and without
its GPU dependencies: the test plugin of tests/vllm034/. Loading only, never a forward (the CPU worker's compiled
ops, `init_cpu_memory_env` and `prepare_prefill_inputs_cpu`, exist only in a CPU build of vLLM, and 0.34 has none).

`apply()` runs before anything imports vLLM; each step says why it is needed. None changes what a loader writes
into a parameter: they let vLLM pick its CPU platform and build the model, and skip one compiled post-load step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def apply() -> None:
    """Make vLLM 0.34.0's CUDA wheel build and load models on the CPU (call it before vLLM is imported)."""
    # vLLM resolves its platform from the build it came from; the CUDA wheel on a host without a GPU resolves to
    # no platform at all, and this variable makes the resolver return CpuPlatform.
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    # Kimi K3's constructor otherwise imports the CuTe DSL GEMM (`import cutlass`, a GPU dependency).
    os.environ["VLLM_KIMI_K3_GEMM_AR"] = "0"
    _answer_triton_check()
    # 0.34's CPU worker imports this module to make torch's CUDA calls harmless on the CPU (torch.accelerator's
    # empty_cache and synchronize, which the base loader calls after loading, pin_memory, and inert CUDA streams and
    # events, which Kimi K3, its MoE and KDA make in their constructors); 0.32 had
    # `cpu_model_runner._set_torch_accelerator_to_noop`, which 0.34 removed with the module.
    import vllm.v1.worker.cpu.shm  # noqa: F401
    _skip_moe_prepack()


def _answer_triton_check() -> None:
    """CpuPlatform.check_and_update_config refuses x86 without Triton ("vLLM on x86 CPUs requires Triton
    (triton-cpu)"), which is not on PyPI: the x86 CPU build uses it for its forward, which is never run here. The
    check reads `vllm.triton_utils.HAS_TRITON` at call time, so it reads True for the duration of that call only;
    everything else in vLLM still sees no Triton and keeps its pure-torch paths."""
    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform

    check: Callable[..., Any] = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]
    if getattr(check, "_shardprep_shim", False):
        return

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        saved = vllm.triton_utils.HAS_TRITON
        vllm.triton_utils.HAS_TRITON = True
        try:
            check(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = saved

    check_and_update_config._shardprep_shim = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign, assignment]


def _skip_moe_prepack() -> None:
    """The CPU MoE's post-load step repacks w13/w2 with a compiled op (`torch.ops._C.prepack_moe_weight`, in a CPU
    build only) into a layout only its compiled forward reads: skipped, so the experts keep the loaded bytes, which
    are what the checks compare (vLLM's loader and shardprep's alike go through this skip)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    CPUUnquantizedExperts.process_weights_after_loading = _no_post_load_step  # type: ignore[method-assign]


def _no_post_load_step(self: Any, layer: Any) -> None:
    return None
