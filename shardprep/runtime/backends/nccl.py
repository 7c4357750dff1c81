"""nccl: torch.distributed all-gather on a CUDA side stream (the gatherer's gather stream).

With a zero-copy view (`in_place`) the all-gather is in place: the input is the view's own part,
which maps this rank's chunk of the shard buffer, and NCCL writes only the peers' parts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import vmm
from .base import GatherOp, Tags, group_and_rank
from .collective import all_gather_tagged


class NcclBackend:
    """All-gather through ProcessGroupNCCL on ordinary device memory (or VMM memory, for zero copy).

    The call is synchronous with respect to the stream it is made on: NCCL's internal stream waits
    for the work already on it, and later work on it waits for the gather. No Work is returned, so
    nothing blocks the CPU and the op can be captured in a CUDA graph.

    >>> backend = NcclBackend(None, torch.device("cuda", rank))  # doctest: +SKIP
    """

    name = "nccl"
    matched_by_position = True

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.rank, self.world_size = group_and_rank(group)
        self.device = torch.device(device)
        self._vmm_unavailable = vmm.unavailable(self.device)

    def allocate_local(self, nbytes: int) -> torch.Tensor:
        """The shard buffer: one VMM allocation where CUDA VMM works (so views can map its pages)."""
        if self._vmm_unavailable is None:
            return vmm.allocate(nbytes, self.device)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def allocate_slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device  # NCCL gathers from any device memory

    def zero_copy_unavailable(self) -> str | None:
        return self._vmm_unavailable

    def connect(self, local: torch.Tensor, slots) -> None:
        pass

    def plan(self, chunk: torch.Tensor, out: torch.Tensor, *, in_place: bool = False,
             tags: Tags | None = None) -> GatherOp:
        group = self.group
        c = chunk.numel()
        send = out[self.rank * c:(self.rank + 1) * c] if in_place else chunk

        def gather(stream: torch.cuda.Stream) -> None:
            with torch.cuda.stream(stream):
                all_gather_tagged(out, send, tags, group, coalesce=True)

        return gather
