"""What a gather backend is: the interface the gatherer calls, plain memory, and the startup probe.

A backend knows nothing about layers. It is given a local chunk (a view of this rank's shard
buffer) and an output view (part of a slot, or a zero-copy view whose own part already is the
chunk) and returns an op that gathers every rank's chunk, in rank order, into the output. The
gatherer decides when, on which stream, and into which slot.

Two properties the gatherer asks about:

- `matched_by_position`: a collective (gloo, nccl, nccl-symm) pairs this rank's k-th gather with
  each peer's k-th gather, whatever layer each meant, so a rank whose schedule slipped receives
  another layer's bytes. The gatherer then sends a tag (layer position, forward count) with every
  chunk and checks it. A one-sided backend (ce) reads each peer's chunk of the layer it asked for
  from the peer's shard buffer, which never changes after loading: it cannot receive wrong bytes.
- `zero_copy_unavailable()`: why its views cannot map the own chunk (None: they can).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ...errors import RuntimeShardError

log = logging.getLogger("shardprep.runtime")

GatherOp = Callable[["torch.cuda.Stream | None"], Any]
"""op(stream) → a Work to wait on, or None.

On CUDA, the op is enqueued after the work already on `stream`, and the output is complete once the
work enqueued on `stream` so far has run: an event recorded on `stream` right after the call covers
it. On CPU (stream is None) the op returns a Work whose `wait(timeout)` returns when the output is complete.
"""


@dataclass(frozen=True)
class Tags:
    """A few int32 sent with a chunk (`send`, k values) and every rank's, in rank order (`recv`, N·k)."""

    send: torch.Tensor
    recv: torch.Tensor


class GatherBackend(Protocol):
    """The interface between the gatherer and one way of moving bytes between ranks."""

    name: str
    device: torch.device
    matched_by_position: bool
    shares_local: bool  # peers read this rank's shard buffer directly (one-sided): zero copy exports it

    def allocate_local(self, nbytes: int) -> torch.Tensor:
        """Memory for this rank's shard buffer (the chunks peers read), 1-D uint8."""

    def allocate_slot(self, nbytes: int) -> torch.Tensor:
        """Memory for one gather slot (the full buffer of a layer), 1-D uint8."""

    def owns(self, tensor: torch.Tensor) -> bool:
        """True if `tensor` came from `allocate_local` (or needs no special memory)."""

    def zero_copy_unavailable(self) -> str | None:
        """Why gather views cannot map the own chunk from the shard buffer with this backend, or None."""

    def connect(self, local: torch.Tensor, slots: Sequence[torch.Tensor],
                local_pieces: Sequence[tuple[int, int]] | None = None) -> None:
        """One-time collective setup once every buffer exists (register windows, exchange handles).

        `local_pieces`: the shard buffer is a zero-copy one, made of separate shareable allocations
        at these (offset, bytes); a backend that shares it with peers shares those.
        """

    def plan(self, chunk: torch.Tensor, out: torch.Tensor, *, in_place: bool = False,
             tags: Tags | None = None) -> GatherOp:
        """Precompute the op that gathers every rank's `chunk` into `out` (world_size × chunk bytes).

        `in_place`: `out`'s own part (bytes [rank·C, (rank+1)·C)) already is this rank's chunk (the
        same memory), so only the peers' parts are written. `tags` (collective backends only) are
        gathered in the same collective call.
        """


class PlainMemory:
    """Allocation for backends that gather from and into ordinary device memory."""

    device: torch.device

    def allocate_local(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def allocate_slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    shares_local = False

    def zero_copy_unavailable(self) -> str | None:
        return f"the {getattr(self, 'name', 'this')} backend gathers into ordinary memory"

    def connect(self, local: torch.Tensor, slots: Sequence[torch.Tensor],
                local_pieces: Sequence[tuple[int, int]] | None = None) -> None:
        pass


def group_and_rank(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    """(group, rank in it, its size), the default group when `group` is None.

    >>> group, rank, world_size = group_and_rank(None)  # doctest: +SKIP
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is None:
        raise RuntimeShardError("torch.distributed is not initialized; call dist.init_process_group() first")
    group = group if group is not None else world
    return group, dist.get_rank(group), dist.get_world_size(group)


def all_ranks_agree(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """True when `ok` holds on every rank of `group` (a MIN all-reduce), so ranks never part ways.

    >>> all_ranks_agree(built_here, group, torch.device("cpu"))  # doctest: +SKIP
    """
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def probe(backend: GatherBackend, group: dist.ProcessGroup, nbytes: int = 4096) -> str | None:
    """Gather a known pattern through `backend` once; None if every rank got it right, else why not.

    Collective: every rank of `group` must call it with the same backend kind. Ranks agree after the
    local allocation and again after the gather, so a failure on one rank never leaves the others
    waiting in a collective. The reason is local (a rank that succeeded says another rank failed).

    >>> reason = probe(NcclBackend(group, device), group)  # doctest: +SKIP
    """
    _, rank, n = group_and_rank(group)
    on = collective_device(group, backend.device)
    reason = None
    try:
        local = backend.allocate_local(nbytes)
        slot = backend.allocate_slot(nbytes * n)
        local.fill_(rank % 251 + 1)
        slot.zero_()
    except Exception as exc:  # any failure means "this backend does not work here"; the reason is reported
        reason = _one_line(exc)
    if not all_ranks_agree(reason is None, group, on):
        return reason or "it failed on another rank"
    try:
        backend.connect(local, [slot])
        stream = None
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
            stream = torch.cuda.Stream(backend.device)
        work = backend.plan(local, slot)(stream)
        if work is not None:
            work.wait()
        if stream is not None:
            stream.synchronize()
        expected = (torch.arange(n, dtype=torch.int64) % 251 + 1).to(torch.uint8).repeat_interleave(nbytes)
        got = slot.cpu()
        if not torch.equal(got, expected):
            wrong = sorted({i // nbytes for i in (got != expected).nonzero().flatten().tolist()})
            reason = f"gathered bytes from rank(s) {wrong} are wrong"
    except Exception as exc:
        reason = _one_line(exc)
    if not all_ranks_agree(reason is None, group, on):
        return reason or "it failed on another rank"
    return None


def collective_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where a small control tensor for `group` must live: CUDA for a NCCL group, else the CPU.

    >>> collective_device(nccl_group, torch.device("cuda", 0))  # doctest: +SKIP
    """
    return device if device.type == "cuda" and "nccl" in str(dist.get_backend(group)) else torch.device("cpu")


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
