"""nccl: torch.distributed all-gather on a CUDA side stream (the gatherer's gather stream)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import GatherOp, PlainMemory, group_and_rank
from .collective import all_gather_into


class NcclBackend(PlainMemory):
    """All-gather through ProcessGroupNCCL on ordinary device memory.

    The call is synchronous with respect to the stream it is made on: NCCL's internal stream waits
    for the work already on it, and later work on it waits for the gather. No Work is returned, so
    nothing blocks the CPU and the op can be captured in a CUDA graph.

    >>> backend = NcclBackend(None, torch.device("cuda", rank))  # doctest: +SKIP
    """

    name = "nccl"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.rank, self.world_size = group_and_rank(group)
        self.device = torch.device(device)

    def plan(self, chunk: torch.Tensor, out: torch.Tensor) -> GatherOp:
        group = self.group

        def gather(stream: torch.cuda.Stream) -> None:
            with torch.cuda.stream(stream):
                all_gather_into(out, chunk, group)

        return gather
