"""gloo: CPU tensors, torch.distributed all-gather with async_op=True (the gatherer waits on the Work)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import GatherOp, PlainMemory, group_and_rank
from .collective import all_gather_into


class GlooBackend(PlainMemory):
    """All-gather on a gloo group, for CPU devices (tests, dry runs, CPU-only serving).

    >>> backend = GlooBackend(None, torch.device("cpu"))  # doctest: +SKIP
    """

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.rank, self.world_size = group_and_rank(group)
        self.device = torch.device(device)

    def plan(self, chunk: torch.Tensor, out: torch.Tensor) -> GatherOp:
        group = self.group

        def gather(stream: None = None):
            return all_gather_into(out, chunk, group, async_op=True)

        return gather
