"""Test-only SGLang plugin: build SGLang's parallel groups without PyNccl, so that TP > 1 and DP attention run on
the CPU; never shipped in shardprep.

SGLang 0.5.23's `init_model_parallel_group` asks for a PyNccl communicator whenever the platform is not NPU/XPU,
CPU included, and that fails on a CPU machine (`Expected a cuda device, but got: cpu`). With `use_pynccl=False`
the groups use torch.distributed's gloo, which is what SGLang's CPU path does everywhere else. Installed through
SGLang's own hook point (a `sglang.srt.plugins` entry point registering a HookRegistry BEFORE hook), declared by
the engine runner (sglang_runs.py) for its engine processes only; no SGLang file is changed.
"""

from __future__ import annotations

from typing import Any

NAME = "shardprep_test_gloo_groups"
TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


def without_pynccl(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The BEFORE hook: the same call, with `use_pynccl=False` (its fourth positional parameter)."""
    if len(args) > 3:
        args = (*args[:3], False, *args[4:])
    else:
        kwargs["use_pynccl"] = False
    return args, kwargs


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, without_pynccl, HookType.BEFORE)
