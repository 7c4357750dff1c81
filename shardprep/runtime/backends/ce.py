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

For zero copy the shard buffer must start on a mapping-granularity boundary of its physical
allocation; symmetric memory puts a signal pad in the same allocation (in front of the buffer in
recent torch), so `allocate_local` over-allocates by one granule and starts the buffer at the
first boundary. Every rank computes the same offset; connect() checks that they agree.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...errors import RuntimeShardError
from .. import vmm
from .base import GatherOp, Tags, collective_device, group_and_rank


class CopyEngineBackend:
    """Pull peers' chunks with device-to-device copies from symmetric memory.

    >>> backend = CopyEngineBackend(None, torch.device("cuda", rank))  # doctest: +SKIP
    """

    name = "ce"
    matched_by_position = False

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.rank, self.world_size = group_and_rank(group)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise RuntimeShardError(f"the ce backend needs a CUDA device, got {self.device}")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self._vmm_unavailable = vmm.unavailable(self.device)
        self._granule = vmm.granularity(self.device) if self._vmm_unavailable is None else 0
        # data_ptr of a buffer from allocate_local → (the symmetric allocation it sits in, its offset there)
        self._owned: dict[int, tuple[torch.Tensor, int]] = {}
        self._local: torch.Tensor | None = None
        self._peers: list[torch.Tensor | None] = []
        # One stream per copy lane besides the caller's: the caller's stream pulls from the first peer.
        self._lanes = [torch.cuda.Stream(self.device) for _ in range(self.world_size - 1)]

    def allocate_local(self, nbytes: int) -> torch.Tensor:
        whole = self._symm_mem.empty(nbytes + self._granule, dtype=torch.uint8, device=self.device)
        pad = 0
        if self._granule:
            try:
                physical, offset = vmm.backing(whole)
                physical.release()
                pad = -offset % self._granule
            except vmm.VmmError:
                pad = 0  # not mappable after all: zero copy will say so and fall back
        local = whole[pad:pad + nbytes]
        self._owned[local.data_ptr()] = (whole, pad)
        return local

    def allocate_slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._owned

    def zero_copy_unavailable(self) -> str | None:
        return self._vmm_unavailable

    def connect(self, local: torch.Tensor, slots: Sequence[torch.Tensor]) -> None:
        if not self.owns(local):
            raise RuntimeShardError("the ce backend can only share a buffer it allocated (allocate_local)")
        whole, pad = self._owned[local.data_ptr()]
        _enable_group(self._symm_mem, self.group)
        # Every rank reads a peer's chunk at the same offset as its own, so the pads must agree.
        pads = torch.tensor([pad, -pad], dtype=torch.int64, device=collective_device(self.group, self.device))
        dist.all_reduce(pads, op=dist.ReduceOp.MAX, group=self.group)
        if int(pads[0]) != -int(pads[1]):
            raise RuntimeShardError(f"ce backend: ranks placed their shard buffers at different offsets of their "
                                    f"symmetric allocations (between {-int(pads[1])} and {int(pads[0])} bytes)")
        # Peers may read `local` as soon as the rendezvous returns, so its bytes must be in place first.
        torch.cuda.synchronize(self.device)
        handle = self._symm_mem.rendezvous(whole, self.group)
        peers: list[torch.Tensor | None] = []
        for p in range(self.world_size):
            if p == self.rank:
                peers.append(None)
                continue
            remote = handle.get_buffer(p, (whole.numel(),), torch.uint8)[pad:pad + local.numel()]
            if remote.device != self.device:
                raise RuntimeShardError(
                    f"symmetric memory mapped rank {p}'s buffer on {remote.device}, not on {self.device}"
                )
            peers.append(remote)
        self._handle, self._local, self._peers = handle, local, peers
        dist.barrier(group=self.group)

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
        copies = [(out[p * c:(p + 1) * c], self._peers[p][offset:offset + c])
                  for p in range(self.world_size) if p != self.rank]
        if not in_place:  # last: the local copy is the cheapest lane
            copies.append((out[self.rank * c:(self.rank + 1) * c], chunk))
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
