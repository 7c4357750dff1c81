"""Gather backends: gloo (CPU), nccl, ce (copy engines) and nccl-symm (NCCL symmetric windows), plus auto.

`make_backend(name, group, device)` builds one and probes it with a tiny all-gather, so a backend
that cannot work here fails at startup with its reason, on every rank at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import RuntimeShardError
from .base import GatherBackend, GatherOp, all_ranks_agree, collective_device, group_and_rank, log, probe

BACKENDS = ("gloo", "nccl", "ce", "nccl-symm")
"""Backend names `make_backend` accepts, besides "auto"."""

AUTO_ORDER = {"cuda": ("ce", "nccl-symm", "nccl"), "cpu": ("gloo",)}
"""What "auto" tries, best first. ce moves bytes without SMs, so the gathers do not slow the compute
they overlap; nccl-symm runs NCCL's symmetric kernels; plain nccl works wherever NCCL does."""


def make_backend(name: str, group: dist.ProcessGroup | None, device: str | torch.device) -> GatherBackend:
    """Build and probe the backend `name` ("auto" picks the first of AUTO_ORDER that works, and logs it).

    Collective: every rank of `group` must call it with the same name.

    >>> backend = make_backend("auto", None, torch.device("cuda", rank))  # doctest: +SKIP
    >>> backend.name  # doctest: +SKIP
    """
    device = torch.device(device)
    group, _, _ = group_and_rank(group)
    if name == "auto":
        return _choose(group, device)
    backend = _construct(name, group, device)
    reason = probe(backend, group)
    if reason is not None:
        raise RuntimeShardError(f"gather backend {name!r} does not work here: {reason}; try backend='auto'")
    return backend


def _construct(name: str, group: dist.ProcessGroup, device: torch.device) -> GatherBackend:
    if name == "gloo":
        from .gloo import GlooBackend

        return GlooBackend(group, device)
    if name == "nccl":
        from .nccl import NcclBackend

        return NcclBackend(group, device)
    if name == "ce":
        from .ce import CopyEngineBackend

        return CopyEngineBackend(group, device)
    if name == "nccl-symm":
        from .nccl_symm import NcclSymmBackend

        return NcclSymmBackend(group, device)
    raise RuntimeShardError(f"unknown gather backend {name!r}; expected 'auto' or one of {', '.join(BACKENDS)}")


def _choose(group: dist.ProcessGroup, device: torch.device) -> GatherBackend:
    tried = []
    on = collective_device(group, device)
    for name in AUTO_ORDER.get(device.type, ()):
        backend: GatherBackend | None = None
        reason: str | None = None
        try:
            backend = _construct(name, group, device)
        except Exception as exc:  # agreed on below, so that no rank probes a backend another could not build
            reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        agreed = all_ranks_agree(backend is not None, group, on)
        if backend is None or not agreed:
            reason = reason or "it could not be built on another rank"
        else:
            reason = probe(backend, group)
        if reason is None and backend is not None:
            log.info("shardprep: gather backend %s (auto, %d ranks)", name, dist.get_world_size(group))
            return backend
        log.info("shardprep: gather backend %s unavailable: %s", name, reason)
        tried.append(f"{name}: {reason}")
    raise RuntimeShardError(f"no gather backend works on {device.type}: " + ("; ".join(tried) or "none to try"))


__all__ = ["AUTO_ORDER", "BACKENDS", "GatherBackend", "GatherOp", "make_backend", "probe"]
