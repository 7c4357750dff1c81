"""nccl: torch.distributed all-gather on a CUDA side stream (the gatherer's gather stream).

With a zero-copy view (`in_place`) the all-gather is in place: the input is the view's own part,
which maps this rank's chunk of the shard buffer, and NCCL writes only the peers' parts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import vmm
from .base import GatherOp, PlainMemory, Tags, group_and_rank
from .collective import all_gather_tagged


class NcclBackend(PlainMemory):
    """All-gather through ProcessGroupNCCL on ordinary device memory (or zero-copy views).

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

    def zero_copy_unavailable(self) -> str | None:
        return self._vmm_unavailable

    def plan(self, chunk: torch.Tensor, out: torch.Tensor, *, in_place: bool = False,
             tags: Tags | None = None) -> GatherOp:
        group = self.group
        c = chunk.numel()
        send = out[self.rank * c:(self.rank + 1) * c] if in_place else chunk

        def gather(stream: torch.cuda.Stream | None) -> None:
            with torch.cuda.stream(stream):
                all_gather_tagged(out, send, tags, group, coalesce=True)

        return gather
