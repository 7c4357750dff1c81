"""ce: copy engines. Peers' shard buffers are mapped into this process; each gather is plain copies.

Every rank allocates its shard buffer in torch symmetric memory and rendezvouses once; after that a
peer's chunk is a local-device tensor over the peer's memory, and gathering layer ℓ is N−1 pulls
over NVLink plus, without a zero-copy view, one local copy of the own chunk; all done by the GPUs'
copy engines, without SMs and without any per-layer synchronisation between ranks.

One-sided, so never misaligned: a gather of layer ℓ reads bytes [file_offset(ℓ), +C) of each
peer's shard buffer. Those bytes are written once, before connect() (which synchronises the device
and ends with a barrier, so every peer's buffer is complete before anyone reads it), and never
again: no gather, view or compute writes into a shard buffer. So whatever a peer is doing (another
layer, another forward, nothing at all), the bytes copied for layer ℓ are that peer's chunk of
layer ℓ. The gatherer therefore sends no alignment tags with this backend.

With N > 2 every copy runs on a stream of its own so the pulls from all peers proceed concurrently.
NVLink multicast is never used: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set (unless set already)
before the first symmetric allocation.

With zero copy the shard buffer is not symmetric memory but one shareable CUDA allocation per
chunk (and per gap), which the views also map: connect() exports them as file descriptors, passes
them to the peers (`fd_passing.py`), and maps each peer's pieces in the same layout, so a peer's
chunk of layer ℓ again sits at ℓ's file_offset of that peer's buffer. The one-sided argument above
holds unchanged: those allocations are written once, before connect(), and never again.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...errors import RuntimeShardError
from .. import vmm
from ..fd_passing import exchange_fds
from .base import GatherOp, Tags, group_and_rank


class CopyEngineBackend:
    """Pull peers' chunks with device-to-device copies from symmetric memory.

    >>> backend = CopyEngineBackend(None, torch.device("cuda", rank))  # doctest: +SKIP
    """

    name = "ce"
    matched_by_position = False
    shares_local = True

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.rank, self.world_size = group_and_rank(group)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise RuntimeShardError(f"the ce backend needs a CUDA device, got {self.device}")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self._vmm_unavailable = vmm.unavailable(self.device)
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

    def zero_copy_unavailable(self) -> str | None:
        return self._vmm_unavailable

    def connect(self, local: torch.Tensor, slots: Sequence[torch.Tensor],
                local_pieces: Sequence[tuple[int, int]] | None = None) -> None:
        # Peers may read `local` as soon as this returns on any rank, so its bytes must be in place first.
        torch.cuda.synchronize(self.device)
        if local_pieces is not None:
            peers = self._map_peer_pieces(local, local_pieces)
        elif self.owns(local):
            peers = self._rendezvous(local)
        else:
            raise RuntimeShardError("the ce backend can only share a buffer it allocated (allocate_local) "
                                    "or a zero-copy shard buffer")
        for p, remote in enumerate(peers):
            if remote is not None and remote.device != self.device:
                raise RuntimeShardError(f"rank {p}'s buffer was mapped on {remote.device}, not on {self.device}")
        self._local, self._peers = local, peers
        dist.barrier(group=self.group)

    def _rendezvous(self, local: torch.Tensor) -> list[torch.Tensor | None]:
        _enable_group(self._symm_mem, self.group)
        self._handle = self._symm_mem.rendezvous(local, self.group)
        return [None if p == self.rank else self._handle.get_buffer(p, (local.numel(),), torch.uint8)
                for p in range(self.world_size)]

    def _map_peer_pieces(self, local: torch.Tensor, pieces: Sequence[tuple[int, int]]) -> list[torch.Tensor | None]:
        """Export each allocation of the zero-copy shard buffer, and map every peer's in the same layout."""
        mine = [vmm.export_fd(local.data_ptr() + at, self.device) for at, _ in pieces]
        try:
            everyone = exchange_fds(mine, self.group)
        finally:
            for fd in mine:
                os.close(fd)
        peers: list[torch.Tensor | None] = []
        for p, fds in enumerate(everyone):
            if p == self.rank:
                peers.append(None)
                continue
            imported: list[vmm.Physical] = []
            try:
                imported = [vmm.import_fd(fd, nbytes, self.device) for fd, (_, nbytes) in zip(fds, pieces)]
                peers.append(vmm.map_pieces([vmm.Piece(at, phys) for (at, _), phys in zip(pieces, imported)],
                                            local.numel(), self.device))
            finally:
                for phys in imported:
                    phys.release()  # the mapping keeps the peer's memory alive here
                for fd in fds:
                    os.close(fd)
        return peers

    def plan(self, chunk: torch.Tensor, out: torch.Tensor, *, in_place: bool = False,
             tags: Tags | None = None) -> GatherOp:
        local = self._local
        if local is None:
            raise RuntimeShardError("ce backend: connect() must run before plan()")
        if tags is not None:
            raise RuntimeShardError("ce backend: one-sided gathers take no alignment tags")
        offset = chunk.data_ptr() - local.data_ptr()
        c = chunk.numel()
        if not 0 <= offset <= local.numel() - c or out.numel() != c * self.world_size:
            raise RuntimeShardError("ce backend: the chunk is not inside the shared buffer, or out has the wrong size")
        # Same layout on every rank: a peer's chunk of this layer sits at the same offset of its buffer.
        copies = [(out[p * c:(p + 1) * c], peer[offset:offset + c])
                  for p, peer in enumerate(self._peers) if peer is not None]
        if not in_place:  # last: the local copy is the cheapest lane
            copies.append((out[self.rank * c:(self.rank + 1) * c], chunk))
        if not copies:  # one rank, its own chunk mapped in place: nothing moves
            return _nothing_to_copy
        first_dst, first_src = copies[0]
        lanes = [(s, dst, src, torch.cuda.Event()) for s, (dst, src) in zip(self._lanes, copies[1:])]
        fork = torch.cuda.Event()

        def gather(stream: torch.cuda.Stream | None) -> None:
            assert stream is not None, "ce gathers run on a CUDA stream"
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


def _nothing_to_copy(stream: torch.cuda.Stream | None) -> None:
    return None


def _enable_group(symm_mem: Any, group: dist.ProcessGroup) -> None:
    # torch ≤ 2.8 needs the group registered for symmetric memory; later versions deprecate the call.
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None or hasattr(enable, "__deprecated__"):
        return
    if symm_mem.is_symm_mem_enabled_for_group(group.group_name):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable(group.group_name)
