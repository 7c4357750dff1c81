"""Test-only SGLang plugin: let SGLang 0.5.23 resolve `speculative_algorithm="DFLASH"` on the CPU, so that a DFlash
draft can be built and loaded there, only to build and load it; never shipped in shardprep.

SGLang refuses DFLASH on the CPU while it resolves its server arguments, before any model is built
(`arg_groups/speculative_hook.py`, `_handle_dflash`): "DFLASH speculative decoding is not supported by CpuPlatform
on device 'cpu'", and under DP attention "DFLASH with dp attention requires CUDA or NPU". Both read the record's
`device`. This plugin runs SGLang's own `_handle_dflash` (a HookRegistry AROUND hook, SGLang's own hook point, from
a `sglang.srt.plugins` entry point) with the device read as "cuda" inside that one function: a resolution
declaration `{"device": "cuda"}` is put on the record for the call and taken off after it. Everything else
`_handle_dflash` decides is SGLang's (the block size from the draft's config, steps and top-k 1; the draft's
attention backend falls back to flashinfer, with SGLang's own warning, as torch_native is not a DFlash draft
backend). Nothing runs a DFlash forward on the CPU: the draft's attention needs a GPU backend, which the test
never initializes (tests/sglang_engines/draft_loading.py builds and loads only). Active only where
SHARDPREP_TEST_DFLASH_ON_CPU is set.
"""

from __future__ import annotations

import os
from typing import Any

NAME = "shardprep_test_dflash_on_cpu"
TARGET = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
SOURCE = "shardprep test plugin dflash_on_cpu (build and load only)"
SWITCH = "SHARDPREP_TEST_DFLASH_ON_CPU"


def as_if_on_cuda(original: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook: SGLang's `_handle_dflash`, with the device read as "cuda" while it runs."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    if resolving_view(server_args).device != "cpu":
        return original(server_args, *args, **kwargs)
    declared = (SOURCE, {"device": "cuda"})
    if getattr(server_args, "_resolved_overrides", None) is None:
        server_args._resolved_overrides = []
    server_args._resolved_overrides.append(declared)
    try:
        return original(server_args, *args, **kwargs)
    finally:
        server_args._resolved_overrides[:] = [d for d in server_args._resolved_overrides if d is not declared]


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`)."""
    if not os.environ.get(SWITCH):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, as_if_on_cuda, HookType.AROUND)
