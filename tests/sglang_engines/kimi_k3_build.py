"""Test-only SGLang plugin: let SGLang 0.5.23 build Kimi K3 on the CPU; never shipped in shardprep.

`KimiK3LinearModel.__init__` (models/kimi_k3.py) makes three CUDA side streams unconditionally (`[torch.cuda.Stream()
for _ in range(3)]`, off only on ROCm), which CPU torch refuses. While K3's model is built, `torch.cuda.Stream` is
an inert stand-in: the streams are kept by the layers and used only on CUDA paths (captured decode, SBO overlap),
which a CPU engine never takes. Installed through SGLang's own hook point (a `sglang.srt.plugins` entry point
registering a HookRegistry AROUND hook on the constructor), declared by the engine runner (sglang_runs.py) for its
engine processes, and active only where the run's environment sets SHARDPREP_TEST_KIMI_K3=1 (the hook imports K3's
module, which other engines need not pay for); no SGLang file is changed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

NAME = "shardprep_test_kimi_k3_build"
ENV = "SHARDPREP_TEST_KIMI_K3"
TARGET = "sglang.srt.models.kimi_k3.KimiK3LinearModel.__init__"


class InertStream:
    """Stands in for torch.cuda.Stream while K3 is built: made, never used on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@contextmanager
def cuda_streams_inert() -> Iterator[None]:
    """`torch.cuda.Stream` is `InertStream` inside this block (on a machine without CUDA only)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.Stream
    torch.cuda.Stream = InertStream  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        torch.cuda.Stream = saved  # type: ignore[misc]


def built_with_inert_streams(original: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """The AROUND hook: K3's model constructor, with CUDA streams inert."""
    with cuda_streams_inert():
        original(*args, **kwargs)


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`); does nothing unless SHARDPREP_TEST_KIMI_K3=1."""
    if os.environ.get(ENV) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, built_with_inert_streams, HookType.AROUND)
