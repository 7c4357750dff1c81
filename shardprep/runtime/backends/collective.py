"""The one torch.distributed all-gather call every collective backend makes, with its alignment tags.

torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` (the old name warns); torch 2.11
has only the old name. Both gather equal-sized inputs, in rank order, into one output tensor, and
both may be in place (the input is the output's own part), which NCCL then does without copying
the own part.

A tagged gather also gathers a few int32 (the gatherer's tags) in the same call:
- NCCL: the two all-gathers are coalesced (`dist._coalescing_manager`, one NCCL group, one launch),
  so the tags cost no extra collective and travel with the chunk whether it is gathered in place
  or not;
- gloo: two async all-gathers, waited on together. Coalescing them is not an option there: torch
  2.13's gloo `all_gather_single_coalesced` returned wrong bytes for a 1 MiB uint8 gather coalesced
  with an 8-byte int32 one (2 ranks, checked on the CPU machine).

gloo's all-gather copies through a temporary as large as its whole output (measured with torch 2.13 on
the CPU: 100 MiB more at its peak for a 100 MiB in-place `all_gather_into_tensor`), so a CPU gather of a
layer holds the layer twice for a moment; `broadcast_into` moves the same bytes as one broadcast per rank, in
place (1-2 MiB more). The gloo backend keeps the all-gather, one collective per gather: on a 2-core machine a
gloo collective costs about 1.5 ms whatever its size (docs/benchmarks.md), and N broadcasts would cost N of
them. Loading, where a layer more would raise the peak, broadcasts (vLLM's sharded mode processing quantized
targets).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .base import Tags

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into(out: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """`out` ← every rank's `chunk`, in rank order; a Work when `async_op`, else None.

    >>> all_gather_into(slot[:total], chunk, group)  # doctest: +SKIP
    """
    return _ALL_GATHER(out, chunk, group=group, async_op=async_op)


def broadcast_into(out: torch.Tensor, group: dist.ProcessGroup, world_size: int, async_op: bool = False) -> Any:
    """Every rank's part of `out` (rank r's: the r-th of `world_size` equal parts, already in place on rank r) sent
    to every rank, one broadcast per rank: an all-gather without gloo's temporary. Works waited on together
    (`wait(timeout)`) when `async_op`, else None.

    >>> broadcast_into(slot[:total], group, 2)  # doctest: +SKIP
    """
    c = out.numel() // world_size
    works = [dist.broadcast(out[r * c:(r + 1) * c], src=dist.get_global_rank(group, r), group=group,
                            async_op=async_op) for r in range(world_size)]
    return _Both(*works) if async_op else None


def all_gather_tagged(out: torch.Tensor, chunk: torch.Tensor, tags: Tags | None, group: dist.ProcessGroup,
                      *, coalesce: bool, async_op: bool = False) -> Any:
    """`all_gather_into(out, chunk)` and, when `tags` is given, `tags.recv` ← every rank's `tags.send`.

    `coalesce=True` (NCCL) makes both one collective call; `coalesce=False` (gloo) issues two. With
    `async_op` the result has `wait(timeout)` that returns once both are complete.

    >>> all_gather_tagged(view, view[r * c:(r + 1) * c], tags, group, coalesce=True)  # doctest: +SKIP
    """
    if tags is None:
        return all_gather_into(out, chunk, group, async_op)
    if not coalesce:
        works = (all_gather_into(out, chunk, group, async_op), all_gather_into(tags.recv, tags.send, group, async_op))
        return _Both(*works) if async_op else None
    with dist._coalescing_manager(group, async_ops=async_op) as coalesced:
        all_gather_into(out, chunk, group, async_op)
        all_gather_into(tags.recv, tags.send, group, async_op)
    return _Both(*coalesced.works) if async_op else None


class _Both:
    """Works waited on together (one timeout for all): the gatherer's view of a tagged CPU gather."""

    def __init__(self, *works: Any):
        self.works = [w for w in works if w is not None]

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True
