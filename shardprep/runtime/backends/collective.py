"""The one torch.distributed all-gather call every collective backend makes.

torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` (the old name warns); torch 2.11
has only the old name. Both gather equal-sized inputs, in rank order, into one output tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into(out: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """`out` ← every rank's `chunk`, in rank order; a Work when `async_op`, else None.

    >>> all_gather_into(slot[:total], chunk, group)  # doctest: +SKIP
    """
    return _ALL_GATHER(out, chunk, group=group, async_op=async_op)
