"""nccl-symm: the nccl all-gather, on buffers registered as NCCL symmetric windows.

The backend owns a NCCL communicator of its own (a new group over the same ranks, created eagerly
with a warm-up collective) and a `torch.cuda.MemPool` backed by NCCL's allocator. Only the gather
group's ranks create that communicator: for a shard group inside a larger world it is split from the
shard group's own (splitting the world's would wait for the ranks of every other group). The shard
buffer and the slots are allocated in that pool and registered with `register_mem_pool(pool,
symm=True)`, which makes NCCL's symmetric kernels eligible for the gathers. Registration happens after
every buffer is allocated: recent torch no longer upgrades segments allocated after registration.

`cta_policy=2` (NCCL's zero-CTA policy: copy-engine collectives) is opt-in. The policy is read by
NCCL when a communicator is created, so the backend creates its group with NCCL_CTA_POLICY set,
probes one all-gather on registered buffers, and falls back to a group with the default policy
if the probe fails (NCCL 2.28.9 fails it with "Cuda failure 'invalid argument'").
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...errors import RuntimeShardError
from .base import log, probe
from .nccl import NcclBackend


class NcclSymmBackend(NcclBackend):
    """All-gather through a NCCL communicator whose buffers are symmetric windows.

    >>> backend = NcclSymmBackend(None, torch.device("cuda", rank))  # doctest: +SKIP
    >>> backend.symmetric, backend.cta_policy  # doctest: +SKIP
    """

    name = "nccl-symm"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, cta_policy: int | None = None):
        super().__init__(group, device)
        if self.device.type != "cuda":
            raise RuntimeShardError(f"the nccl-symm backend needs a CUDA device, got {self.device}")
        self.parent = self.group
        self.symmetric = False
        self._owned: set[int] = set()
        self.cta_policy = cta_policy
        self._open(cta_policy)
        if cta_policy is not None:
            reason = probe(self, self.parent)
            if reason is not None:
                log.warning("shardprep: nccl-symm with NCCL_CTA_POLICY=%s failed its probe (%s); "
                            "using the default CTA policy", cta_policy, reason)
                self.cta_policy = None
                self._open(None)

    def _open(self, cta_policy: int | None) -> None:
        saved = os.environ.get("NCCL_CTA_POLICY")
        if cta_policy is not None:
            os.environ["NCCL_CTA_POLICY"] = str(cta_policy)
        try:
            self.group = self._new_communicator()
            # The communicator must exist before a pool can be registered with it.
            warm = torch.zeros(1, device=self.device)
            dist.all_reduce(warm, group=self.group)
            torch.cuda.synchronize(self.device)
        finally:
            if cta_policy is not None:
                if saved is None:
                    os.environ.pop("NCCL_CTA_POLICY", None)
                else:
                    os.environ["NCCL_CTA_POLICY"] = saved
        self._impl: Any = self.group._get_backend(self.device)
        self._pool = torch.cuda.MemPool(self._impl.mem_allocator)
        self._registered = False
        self._owned.clear()

    def _new_communicator(self) -> dist.ProcessGroup:
        """A NCCL group over the parent's ranks, created by the parent's ranks only (this is collective
        over the parent group, which may be one shard group of a larger world)."""
        ranks = dist.get_process_group_ranks(self.parent)
        kwargs: dict[str, Any] = {}
        if "device_id" in inspect.signature(dist.new_group).parameters:
            kwargs["device_id"] = self.device
        if self.parent is dist.group.WORLD:
            return dist.new_group(ranks, backend="nccl", **kwargs)
        if getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None) is not None:
            # new_group would split the world's communicator, a collective over every world rank, which
            # the ranks of other shard groups never join; split the parent's instead.
            group = dist.split_group(self.parent, [list(range(len(ranks)))])
            assert group is not None, "every rank of the parent is in the split"
            return group
        return dist.new_group(ranks, backend="nccl", use_local_synchronization=True, **kwargs)

    def allocate_local(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.use_mem_pool(self._pool, device=self.device):
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._owned.add(t.data_ptr())
        return t

    def allocate_slot(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.use_mem_pool(self._pool, device=self.device):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._owned

    def zero_copy_unavailable(self) -> str | None:
        return "nccl-symm gathers into NCCL symmetric windows from its own pool, which views cannot remap"

    def connect(self, local: torch.Tensor, slots: Sequence[torch.Tensor],
                local_pieces: Sequence[tuple[int, int]] | None = None) -> None:
        if not self.owns(local):
            raise RuntimeShardError("the nccl-symm backend can only gather from a buffer it allocated (allocate_local)")
        torch.cuda.synchronize(self.device)
        if self._registered:
            # Segments allocated since the last registration are windows only after registering again.
            self._impl.deregister_mem_pool(self._pool)
        try:
            self._impl.register_mem_pool(self._pool, symm=True)
            self.symmetric = True
        except TypeError:  # a torch whose register_mem_pool has no `symm`: ordinary buffer registration
            self._impl.register_mem_pool(self._pool)
            self.symmetric = False
            log.warning("shardprep: this torch cannot register symmetric NCCL windows; nccl-symm falls back "
                        "to ordinary buffer registration")
        self._registered = True
