"""gloo: CPU tensors, torch.distributed all-gather with async_op=True (the gatherer waits on the Work)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .base import GatherOp, PlainMemory, Tags, group_and_rank
from .collective import all_gather_tagged


class GlooBackend(PlainMemory):
    """All-gather on a gloo group, for CPU devices (tests, dry runs, CPU-only serving).

    >>> backend = GlooBackend(None, torch.device("cpu"))  # doctest: +SKIP
    """

    name = "gloo"
    matched_by_position = True

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.rank, self.world_size = group_and_rank(group)
        self.device = torch.device(device)

    def zero_copy_unavailable(self) -> str | None:
        return "gloo gathers CPU memory, which has no CUDA mappings"

    def plan(self, chunk: torch.Tensor, out: torch.Tensor, *, in_place: bool = False,
             tags: Tags | None = None) -> GatherOp:
        group = self.group
        c = chunk.numel()
        send = out[self.rank * c:(self.rank + 1) * c] if in_place else chunk

        def gather(stream: torch.cuda.Stream | None = None) -> Any:
            return all_gather_tagged(out, send, tags, group, coalesce=False, async_op=True)

        return gather
