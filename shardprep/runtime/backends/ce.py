"""ce: copy engines. Peers' shard buffers are mapped into this process; each gather is plain copies.

Every rank allocates its shard buffer in torch symmetric memory and rendezvouses once; after that a
peer's chunk is a local-device tensor over the peer's memory, and gathering layer ℓ is N copies
(N−1 pulls over NVLink plus the local chunk), done by the GPUs' copy engines without SMs and without
any per-layer synchronisation between ranks: the shard buffers never change after loading.

With N > 2 every copy runs on a stream of its own so the pulls from all peers proceed concurrently.
NVLink multicast is never used: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set (unless set already)
before the first symmetric allocation.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...errors import RuntimeShardError
from .base import GatherOp, group_and_rank


class CopyEngineBackend:
    """Pull peers' chunks with device-to-device copies from symmetric memory.

    >>> backend = CopyEngineBackend(None, torch.device("cuda", rank))  # doctest: +SKIP
    """

    name = "ce"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.rank, self.world_size = group_and_rank(group)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise RuntimeShardError(f"the ce backend needs a CUDA device, got {self.device}")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self._owned: set[int] = set()
        self._local: torch.Tensor | None = None
        self._peers: list[torch.Tensor | None] = []
        # One stream per copy lane besides the caller's: the caller's stream pulls from the first peer.
        self._lanes = [torch.cuda.Stream(self.device) for _ in range(self.world_size - 1)]

    def allocate_local(self, nbytes: int) -> torch.Tensor:
        t = self._symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._owned.add(t.data_ptr())
        return t

    def allocate_slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._owned

    def connect(self, local: torch.Tensor, slots: Sequence[torch.Tensor]) -> None:
        if not self.owns(local):
            raise RuntimeShardError("the ce backend can only share a buffer it allocated (allocate_local)")
        _enable_group(self._symm_mem, self.group)
        # Peers may read `local` as soon as the rendezvous returns, so its bytes must be in place first.
        torch.cuda.synchronize(self.device)
        handle = self._symm_mem.rendezvous(local, self.group)
        peers: list[torch.Tensor | None] = []
        for p in range(self.world_size):
            if p == self.rank:
                peers.append(None)
                continue
            remote = handle.get_buffer(p, (local.numel(),), torch.uint8)
            if remote.device != self.device:
                raise RuntimeShardError(
                    f"symmetric memory mapped rank {p}'s buffer on {remote.device}, not on {self.device}"
                )
            peers.append(remote)
        self._handle, self._local, self._peers = handle, local, peers
        dist.barrier(group=self.group)

    def plan(self, chunk: torch.Tensor, out: torch.Tensor) -> GatherOp:
        local = self._local
        if local is None:
            raise RuntimeShardError("ce backend: connect() must run before plan()")
        offset = chunk.data_ptr() - local.data_ptr()
        c = chunk.numel()
        if not 0 <= offset <= local.numel() - c or out.numel() != c * self.world_size:
            raise RuntimeShardError("ce backend: the chunk is not inside the shared buffer, or out has the wrong size")
        # Same layout on every rank: a peer's chunk of this layer sits at the same offset of its buffer.
        copies = [(out[p * c:(p + 1) * c], chunk if p == self.rank else self._peers[p][offset:offset + c])
                  for p in range(self.world_size)]
        copies.sort(key=lambda dc: dc[1] is chunk)  # pulls first: the local copy is the cheapest lane
        first_dst, first_src = copies[0]
        lanes = [(s, dst, src, torch.cuda.Event()) for s, (dst, src) in zip(self._lanes, copies[1:])]
        fork = torch.cuda.Event()

        def gather(stream: torch.cuda.Stream) -> None:
            fork.record(stream)
            for lane, dst, src, _ in lanes:
                # Orders the lane's copy after what `stream` was told to wait for (the slot's last reader).
                lane.wait_event(fork)
                with torch.cuda.stream(lane):
                    dst.copy_(src)
            with torch.cuda.stream(stream):
                first_dst.copy_(first_src)
            for lane, _, _, joined in lanes:
                joined.record(lane)
                # Joins the lane back: the gatherer's event on `stream` must cover every copy.
                stream.wait_event(joined)

        return gather


def _enable_group(symm_mem, group: dist.ProcessGroup) -> None:
    # torch ≤ 2.8 needs the group registered for symmetric memory; later versions deprecate the call.
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None or hasattr(enable, "__deprecated__"):
        return
    if symm_mem.is_symm_mem_enabled_for_group(group.group_name):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable(group.group_name)
