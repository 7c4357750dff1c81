"""LayerGatherer: rebuild each layer's weights with one gather, ahead of the compute, into ping-pong slots.

Schedule (S = num_slots = 2; G(i) = gather of the layer at position i into slot i % S):

    compute stream:  begin ─ wait(0) ─ [layer 0] done(0) ─ wait(1) ─ [layer 1] done(1) ─ wait(2) ─ ...
                          │      │                   │                          │
    gather stream:      G(0)    G(1)                G(2) (waits for done(0))  G(3) (waits for done(1))

- G(i+S) is issued by done(i), the moment its slot is released; wait(i) issues G(i+1) if that has
  not happened yet (a skipped done()). So a gather runs as early as its slot allows, and a gather of
  a sharded layer overlaps every non-sharded layer computed before it.
- wait(i) makes the compute stream wait for G(i) (the only cross-stream wait the compute stream
  does per layer) and returns i's views.
- Every gather into slot s waits on the done() event of the layer that last used slot s (in this
  forward or the previous one), so a slot is never overwritten while it is still read, and nothing
  else is waited for: the next forward's first gathers overlap the previous forward's last layer.

Each slot has an owner (the forward and position of the layer it holds) and a state, and the
gatherer one phase. A gather into a slot waits according to the slot's state, so no sequence of
calls lets it overwrite bytes a compute may still read:

| slot state | meaning                              | a gather into it waits for                   |
|------------|--------------------------------------|----------------------------------------------|
| EMPTY      | never gathered into                  | nothing                                      |
| GATHERING  | gathered into, never waited on       | that gather (it may be on another stream)    |
| READ       | wait() returned its views, no done() | all work queued on the compute stream so far |
| RELEASED   | done() recorded its `done` event     | that event                                   |

done(ℓ) releases the slot only if the slot still holds this forward's ℓ and is READ: a stray or
late done() (after prefetch_first(), after the slot was refilled, twice) changes nothing.

Collective backends pair gathers by position, so the gatherer sends a tag (layer position, forward
count) with every chunk, in the same collective call (`backends/collective.py`). Once per forward,
after its last gather, a few tiny ops on the gather stream compare every rank's tags with this
rank's and fold any difference into a sticky device flag, copied to pinned host memory; the next
begin() reads that host copy (no synchronisation) and raises if a forward that has completed on
the device was misaligned. One-sided backends (ce) cannot receive another layer's bytes and send
no tags (see backends/ce.py).

Every decision (order, slots, views, backend ops, streams, events, tag buffers) is made in
__init__; the per-layer path (wait, done, _issue, _protect) only issues ops and records or waits
on events: no tensor is allocated there and no Python loop runs over tensors.

The draft's first gather
------------------------
A draft's layers (`manifest.draft`) come last, from position D on, gathered like the target's. Eagerly,
G(D) is issued by done(D−2) on the gather stream: it runs while the target's last layer computes, and
on until the draft's first wait(D). That stays the eager schedule: prefetch_draft() could only issue the
same gather later on the host, with the same start on the device.

When the target's forward is captured in a CUDA graph (`draft_first="auto"`), G(D) stays out of that
graph. The draft is a graph of its own, replayed once or k times per step; a G(D) inside the target's
graph would make it end only once G(D) is done, so whatever runs between the two graphs (sampling)
would wait for it. Instead the host issues it on `draft_stream`, right after launching the target:

    compute:  … done(D−2) ─ wait(D−1) ─[layer D−1]─ done(D−1) ┊ sampling … ─ wait(D) ─[draft layer D]─ …
                               │ handoff      (target graph ends) ┊                  ▲ draft_gathered
    gather:   G(D−1) ──────────┤                                  ┊                  │
    draft:                     └──── G(D) ─────────────────────────────────────────┘
                                     ▲ prefetch_draft(), on the host after the target's launch

- wait(D−1) records `handoff` on the compute stream once G(D−1) is in. By then layer D−2, the last
  reader of G(D)'s slot (with 2 slots; an earlier layer with more), has computed.
- prefetch_draft() makes `draft_stream` wait on `handoff`, issues G(D) there, records `draft_gathered`.
  wait(D) makes the compute stream wait on `draft_gathered` before it issues G(D+1); with no prefetch
  it issues G(D) itself first, on the gather stream (inline: a cold start, or a skipped prefetch).
- Both are external events (`torch.cuda.Event(external=True)`): recorded inside a capture, a record node
  of that graph; waited on inside one, a wait node. So the eager prefetch waits on the target's graph,
  and the draft's graph on the eager prefetch, each on the event's last record before its launch.
- begin() makes the compute stream wait on `draft_gathered`: a G(D) whose draft never ran (a skipped
  draft step) completes before the next forward's gathers reuse its slot and its communicator.

What the prefetch must wait for. Its slot is the one target layer D−2 read inside the target's graph,
whose done event is recorded only inside that capture (an internal dependency eager work cannot wait
on). Three ways to protect it:

- `handoff`, an external event recorded in the target's graph at wait(D−1) (chosen): no memory; G(D)
  starts when the eager schedule's G(D) would (after G(D−1), once layer D−2 has computed), overlapping
  the target's last layer and all the work between the graphs. It also keeps G(D) after G(D−1) on the
  communicator, which pairs collectives by order (NCCL), and after the forward's tag count.
- An event at the end of the target's graph: as simple, but G(D) no longer overlaps the target's last
  layer: its exposure grows by that layer's time.
- A slot of its own for the draft's first layer: G(D) could start as soon as the previous step's draft
  is done and overlap the whole target step, for one more max|T| of memory (a 1.2 GB Kimi-K2.5-DFlash
  layer; (N−1)/N of it with zero copy), and it would compete with the target's own gathers for the links
  and HBM, moving exposure into the target's step wherever those gathers are not hidden.

Alignment: every target forward issues G(D) once on every rank, wherever the host puts it (the
forward's own schedule, prefetch_draft(), the draft's first wait, or, for a skipped step, the next
begin()); between replays, prefetch_draft(replayed=True) on every rank each step. The target's part
checks its own tags at wait(D−1), inside its graph; the draft's part at its last wait. A draft replay
after a skipped prefetch reads a G(D) of an earlier forward: its tag carries that forward's count, so
the check reports it (collective backends).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..errors import RuntimeShardError
from ..loader.rank_shards import RankShards
from . import zero_copy as zc
from .alignment import AlignmentCheck
from .backends import GatherBackend, make_backend
from .backends.base import Tags, all_ranks_agree, collective_device, group_and_rank, log
from .gather_streams import GatherStreams
from .views import layer_views


class Phase(Enum):
    """Where the gatherer is in the forward cycle."""

    IDLE = "idle"  # no forward in progress: before the first one, or after done() of the last layer
    PREFETCHED = "prefetched"  # prefetch_first() issued the next forward's first gather; begin() takes it
    FORWARD = "forward"  # from begin() on: wait()/done() walk the layers
    FAILED = "failed"  # the ranks' gathers were found misaligned; the gatherer refuses to go on


class SlotState(Enum):
    """What a slot's bytes are doing now (see the module docstring's table)."""

    EMPTY = "empty"
    GATHERING = "gathering"
    READ = "read"
    RELEASED = "released"


@dataclass(eq=False)
class Slot:
    """One gather slot: its memory, the layer it holds (`owner` = (forward, position)), its state and events.

    `gathered` is recorded on the gathering stream after the gather into it; `done` on the compute
    stream by done(). `work` is a CPU gather still in flight.
    """

    memory: torch.Tensor
    gathered: Any = None
    done: Any = None
    owner: tuple[int, int] | None = None
    state: SlotState = SlotState.EMPTY
    work: Any = None


_NOT_TRACED = nullcontext()
DRAFT_FIRST = ("auto", "detached", "in_target")
"""LayerGatherer's `draft_first` choices: where a draft's first gather goes."""
_profiling = getattr(torch.autograd, "_profiler_enabled", lambda: True)


class LayerGatherer:
    """Gather each layer of `shards` back into full weights, ahead of the compute.

    Collective: every rank of `group` constructs it with the same arguments and then calls
    begin()/wait()/done() (or idle_step()) for the same forwards, in the same order. `group` is the
    shard group, the N ranks that gather together (default: the world); in a world of several groups,
    `shard_group(N).process_group` (`runtime/shard_groups.py`).

    - `backend`: "auto", "gloo", "nccl", "ce", "nccl-symm", or a backend instance.
    - `num_slots`: gather slots (2 = ping-pong).
    - `zero_copy`: map this rank's own chunk of each layer straight from the shard buffer into the
      layer's view (CUDA VMM), so a gather writes only the peers' parts and a slot holds (N−1)/N of
      a layer. None (default): wherever it works, else the copy path, said in one log line; True:
      required (raises if impossible); False: never.
    - `alignment_tags`: with a collective backend, gather a (layer, forward) tag with every chunk
      and raise at the next begin() if the ranks' schedules slipped (default; False only to measure
      what the tags cost).
    - `strides`: entry name → strides, for entries that hold a strided tensor's storage span (a weight a
      server processed into a strided layout: storage_span.py); their views get those strides back.
    - `debug_alignment`: at every begin(), all ranks compare their step over a gloo side group and
      raise an error naming the disagreeing ranks instead of hanging (costs one small all-reduce).
    - `timeout`: how long a CPU (gloo) gather or the alignment check may wait. NCCL gathers use the
      timeout of their process group (`init_process_group(timeout=...)`).
    - `draft_first`: where the draft's first gather goes (the module docstring's "The draft's first
      gather"; no effect without a draft). "auto": in a forward captured in a CUDA graph, out of the
      graph (prefetch_draft() issues it, else the draft's first wait); eagerly, in the forward, one layer
      ahead like any. "detached": out of every forward, eager ones too. "in_target": in every forward; a
      captured forward's graph then ends only once it is complete.

    begin() twice in a row is harmless. begin() after some wait() abandons that forward: the gathers
    already issued still complete (peers issue them too), and the schedule restarts at the first
    layer; every rank must do the same. Skipping done(ℓ) is safe but slower: the gather that reuses
    ℓ's slot then waits for all work queued on the compute stream instead of for ℓ's done() event.

    >>> gatherer = LayerGatherer(open_rank("out/", rank, device="cuda:0"))  # doctest: +SKIP
    >>> gatherer.begin()  # doctest: +SKIP
    >>> for layer in gatherer.layers:  # doctest: +SKIP
    ...     w = gatherer.wait(layer)
    ...     x = attention(x, w[f"model.layers.{layer}.self_attn.qkv_proj.weight"], ...)
    ...     gatherer.done(layer)

    With a draft, whose layers come last: the target's forward, then (on the host, right after launching
    it) `prefetch_draft()`, then the draft's layers, wait/done as above.
    """

    def __init__(
        self,
        shards: RankShards,
        group: dist.ProcessGroup | None = None,
        backend: str | GatherBackend = "auto",
        num_slots: int = 2,
        debug_alignment: bool = False,
        timeout: timedelta = timedelta(minutes=10),
        zero_copy: bool | None = None,
        alignment_tags: bool = True,
        strides: Mapping[str, tuple[int, ...]] | None = None,
        draft_first: str = "auto",
    ):
        if draft_first not in DRAFT_FIRST:
            raise RuntimeShardError(f"draft_first={draft_first!r}: expected one of {', '.join(DRAFT_FIRST)}")
        group, rank, world_size = group_and_rank(group)
        if world_size != shards.world_size or rank != shards.rank:
            raise RuntimeShardError(
                f"the shards were opened for rank {shards.rank} of {shards.world_size}, but this process is rank "
                f"{rank} of {world_size} in the gather group; in a world of shard groups, open_rank(DIR, "
                f"group.rank_file) and pass group=group.process_group, with group = shard_group({shards.world_size})"
            )
        if num_slots < 2:
            raise RuntimeShardError(f"num_slots must be >= 2 (one computes while the next gathers), got {num_slots}")
        manifest = shards.manifest
        self.shards = shards
        self.group = group
        self.device = shards.device
        self.timeout = timeout
        self.backend = make_backend(backend, group, self.device) if isinstance(backend, str) else backend

        records = manifest.layers
        self.layers: tuple[int, ...] = tuple(r.layer for r in records)
        n = len(records)
        s = self.num_slots = min(num_slots, n)
        mapped = self._map_own_chunks(zero_copy, rank)
        if mapped is None:
            # Unread shards are read straight into the backend's memory; loaded ones are moved only if they must be.
            if not shards.loaded or not self.backend.owns(shards.buffer):
                shards.rehome(self.backend.allocate_local)
            memories: tuple[torch.Tensor, ...] = tuple(self.backend.allocate_slot(manifest.max_total_bytes)
                                                      for _ in range(s))
            outs = [memories[i % s][:r.total_bytes] for i, r in enumerate(records)]
        else:
            memories, outs = mapped.slots, list(mapped.views)
        self._cuda = self.device.type == "cuda"
        event = torch.cuda.Event if self._cuda else (lambda: None)
        self._slots = tuple(Slot(m, event(), event()) for m in memories)
        tags = self._tags = (self._allocate_tags(n, world_size)
                             if alignment_tags and self.backend.matched_by_position else None)
        self.backend.connect(shards.buffer, memories, None if mapped is None else mapped.shard_pieces)
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        drafted = set(manifest.draft.layers) if manifest.draft else set()
        first_draft = next((i for i, layer in enumerate(self.layers) if layer in drafted), 0)
        # D: the position of the draft's first layer, None without a draft (or without a target layer before it).
        self._draft_at: int | None = first_draft or None
        self._draft_first = draft_first
        self._outs = tuple(outs)  # per position: the flat bytes a gather fills (a slot, or a zero-copy view)
        # Every view through a storage of its own: fixed addresses a compiler may treat as memory of their own
        # (views.own_storage says why).
        self._views = tuple(layer_views(r, out, own_storages=True, strides=strides) for r, out in zip(records, outs))
        self._ops = tuple(self.backend.plan(shards.chunk(r.layer), out, in_place=self.zero_copy,
                                            tags=None if tags is None else tags[i])
                          for i, (r, out) in enumerate(zip(records, outs)))
        self._labels = tuple(f"shardprep::gather layer {layer}" for layer in self.layers)
        if self._cuda:
            self.streams = GatherStreams.on(self.device)
            torch.cuda.synchronize(self.device)  # buffers set up on the compute stream are used on the others
        self._alignment = AlignmentCheck(group, timeout) if debug_alignment else None

        self._n = n
        self._phase = Phase.IDLE
        self._failure = ""
        self._next_issue = n  # position of the next gather to issue in this forward
        self._next_wait = n  # position wait() accepts next
        self._forward = 0  # forwards begun (a prefetched one counts from prefetch_first())
        self._first_prefetched = False  # this forward's first gather was issued by prefetch_first()
        self._prefetch_captured = False  # ... inside a CUDA graph capture
        self._last_captured = False  # the last begin()/prefetch_first() ran inside a CUDA graph capture
        self._gathers = 0
        self._detached = False  # this forward's G(D) is left to prefetch_draft() or the draft's first wait
        self._issue_limit = n  # positions the forward's own schedule issues: all, or up to D (D + 1)
        self._draft_in_graph = False  # this forward's G(D) was issued inside a capture (no eager event covers it)
        self._captured_target: bool | None = None  # a captured forward with a draft: detached (True) or not

    # -- per layer ------------------------------------------------------------------------------
    def wait(self, layer: int) -> dict[str, torch.Tensor]:
        """Issue the next layer's gather if not yet issued, wait for `layer`'s, and return its views.

        The views stay valid until done(layer): from then on the gather that reuses the slot may be issued
        (on CUDA it still waits for the compute queued before done()).

        >>> w = gatherer.wait(3)  # doctest: +SKIP
        """
        i = self._position.get(layer, -1)
        if self._phase is not Phase.FORWARD or i != self._next_wait:
            raise RuntimeShardError(self._out_of_order(layer))
        if i == self._draft_at:
            self._enter_draft()  # the draft's first layer: its gather waited for (or issued inline), then G(D+1)
        elif self._next_issue == i + 1 < self._issue_limit:
            self._issue(i + 1, self.streams.gather if self._cuda else None)
        slot = self._slots[i % self.num_slots]
        if slot.work is not None:  # CPU backends: block until the bytes are in the slot
            self._wait_work(slot, layer)
        if self._cuda and i != self._draft_at:
            # Protects the slot's bytes: layer ℓ's compute must not read them before G(ℓ) wrote them.
            torch.cuda.current_stream(self.device).wait_event(slot.gathered)
        slot.state = SlotState.READ
        self._next_wait = i + 1
        if i + 1 == self._draft_at or i + 1 == self._n:
            self._end_part(i + 1)
        return self._views[i]

    def done(self, layer: int) -> None:
        """Record that `layer`'s compute has been issued: its slot may be refilled once that compute ran.

        >>> gatherer.done(3)  # doctest: +SKIP
        """
        i = self._position.get(layer, -1)
        if i < 0 or (self._phase is Phase.FORWARD and i >= self._next_wait):
            raise RuntimeShardError(f"done({layer}) before wait({layer}) in this forward")
        slot = self._slots[i % self.num_slots]
        forward = self._forward - (self._phase is Phase.PREFETCHED)  # a prefetch started the next forward
        if slot.owner == (forward, i) and slot.state is SlotState.READ:  # else stray, late or repeated
            if self._cuda:
                slot.done.record(torch.cuda.current_stream(self.device))
            slot.state = SlotState.RELEASED
        if self._phase is Phase.FORWARD:
            if i + 1 == self._n:
                self._phase = Phase.IDLE
            elif self._next_issue == i + self.num_slots < self._issue_limit:  # the slot is free: refill it now
                self._issue(i + self.num_slots, self.streams.gather if self._cuda else None)
            if i + 1 == self._draft_at and self._cuda and not self._detached:
                self._join_if_captured()

    def _issue(self, j: int, stream: torch.cuda.Stream | None, protect: bool = True) -> None:
        slot = self._slots[j % self.num_slots]
        with record_function(self._labels[j]) if _profiling() else _NOT_TRACED:
            if self._cuda and protect:
                self._protect(slot, stream)
            slot.work = self._ops[j](stream)
            if self._cuda:
                slot.gathered.record(stream)
        slot.owner, slot.state = (self._forward, j), SlotState.GATHERING
        self._next_issue = j + 1
        self._gathers += 1
        if j == self._draft_at:
            self._draft_in_graph = self._cuda and torch.cuda.is_current_stream_capturing()
            if self._cuda and not self._draft_in_graph:
                self.streams.draft_gathered.record(stream)  # what the draft's first wait, and the next begin(), wait on

    def _protect(self, slot: Slot, stream: torch.cuda.Stream | None) -> None:
        assert stream is not None, "CUDA gathers run on a stream"
        if slot.state is SlotState.RELEASED:
            # Protects the slot: its last reader's compute (done() recorded it) must finish before the overwrite.
            stream.wait_event(slot.done)
        elif slot.state is SlotState.READ:
            # No done() for its last reader: protect the slot from all work queued on the compute stream so far.
            self.streams.forked.record(torch.cuda.current_stream(self.device))
            stream.wait_event(self.streams.forked)
        elif slot.state is SlotState.GATHERING:
            # Never read (an abandoned forward): its gather, maybe on another stream, must finish writing first.
            stream.wait_event(slot.gathered)

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        """`layer`'s views without waiting: the tensors every wait(layer) returns, at fixed addresses.

        Their bytes are `layer`'s only between wait(layer) and done(layer); bind() points the model's
        parameters at them once.

        >>> param.data = gatherer.views(3)["model.layers.3.self_attn.o_proj.weight"]  # doctest: +SKIP
        """
        i = self._position.get(layer, -1)
        if i < 0:
            raise RuntimeShardError(self._out_of_order(layer))
        return self._views[i]

    # -- per forward ----------------------------------------------------------------------------
    def begin(self, step: int | None = None) -> None:
        """Start a forward: dispatch the first layer's gather (unless prefetch_first() did).

        Raises if an earlier forward's gathers were misaligned across ranks (collective backends).
        `step` (optional) is the caller's step number, compared across ranks when debug_alignment is on.

        >>> gatherer.begin()  # doctest: +SKIP
        """
        self._raise_if_failed()
        if self._phase is Phase.FORWARD and self._next_wait == 0:
            return  # begin() twice in a row: the first layer's gather is already in flight
        prefetched = self._phase is Phase.PREFETCHED
        capturing = self._cuda and torch.cuda.is_current_stream_capturing()
        if self._phase is Phase.FORWARD and self._next_wait < self._n:
            if self._next_wait == self._next_issue == self._draft_at and not capturing:
                self._issue_draft_first(after_replay=False)  # a skipped draft step: G(D) as on the ranks that ran it
            self._drain()  # an abandoned forward: its CPU gathers complete, its tags are checked
            self._wait_for_draft_first()
            self._check_tags(0, self._next_issue)
        else:
            self._wait_for_draft_first()
        self._raise_if_misaligned()
        if self._alignment is not None:
            self._alignment(self._forward if step is None else step, self._forward, self._gathers)
        if self._cuda and prefetched and self._prefetch_captured != capturing:
            raise RuntimeShardError("prefetch_first() and begin() must both run inside the CUDA graph being "
                                    "captured, or both outside it")
        self._phase, self._next_wait = Phase.FORWARD, 0
        if not prefetched:
            self._start_forward(prefetch=False)

    def idle_step(self, step: int | None = None) -> None:
        """Take part in one forward's gathers without computing, for a rank with no requests this step.

        Issues exactly the gathers of one forward (its peers need them to match theirs). With a
        prefetch_first() schedule, call prefetch_first() on idle ranks where the busy ranks do.

        >>> gatherer.idle_step()  # doctest: +SKIP
        """
        self.begin(step)
        for layer in self.layers:
            self.wait(layer)
            self.done(layer)

    def prefetch_first(self) -> None:
        """Issue the next forward's first gather now, on a dedicated stream (e.g. while sampling).

        Call it between forwards: after the last layer's wait() (and done()). begin() then skips that gather.

        >>> gatherer.done(gatherer.layers[-1]); gatherer.prefetch_first()  # doctest: +SKIP
        """
        self._raise_if_failed()
        if self._phase is Phase.PREFETCHED:
            return
        if self._phase is Phase.FORWARD and self._next_wait < self._n:
            raise RuntimeShardError(
                f"prefetch_first() during a forward; call it after done({self.layers[-1]}) of the last layer"
            )
        self._raise_if_misaligned()
        self._drain()
        self._phase = Phase.PREFETCHED
        self._start_forward(prefetch=True)
        self._prefetch_captured = self._cuda and torch.cuda.is_current_stream_capturing()

    def wait_first(self) -> dict[str, torch.Tensor]:
        """Views of the first layer: the prefetched gather if there is one; a cold start gathers inline.

        >>> w = gatherer.wait_first()  # doctest: +SKIP
        """
        if not (self._phase is Phase.FORWARD and self._next_wait == 0):
            self.begin()
        return self.wait(self.layers[0])

    # -- the draft's first gather (the module docstring's "The draft's first gather") ---------------
    def prefetch_draft(self, replayed: bool = False) -> None:
        """Issue the draft's first gather now, on `draft_stream`, outside any CUDA graph.

        Call it on the host right after issuing the target's forward, once per forward, on every rank:
        after its last target layer's wait() (eagerly, or right after its capture ended), or with
        `replayed=True` right after each replay of a captured target forward, which also brings this
        gatherer's state to where that forward ends. The draft's first wait() then waits for this gather;
        in a CUDA graph of the draft, so does every replay. Where the forward has issued it already (the
        eager schedule, or an earlier call), or no forward awaits its draft, it does nothing. Raises during
        the target's forward, inside a capture, and without a draft or (`replayed`) a captured forward.

        >>> graph.replay(); gatherer.prefetch_draft(replayed=True); sample(); draft_graph.replay()  # doctest: +SKIP
        """
        d = self._draft_at
        if d is None:
            raise RuntimeShardError("prefetch_draft(): this gatherer gathers no draft layer (the manifest records "
                                    "none after a target layer, or the shards were opened with draft=False)")
        self._raise_if_failed()
        if self._cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeShardError("prefetch_draft() inside a CUDA graph capture: it issues the draft's first "
                                    "gather outside the graphs; call it after the capture, and after every replay")
        if replayed:
            self._raise_if_misaligned()
            self._after_replay()
        elif self._phase is Phase.FORWARD and self._next_wait < d:
            raise RuntimeShardError(f"prefetch_draft() during the target's forward; call it after wait("
                                    f"{self.layers[d - 1]}) of the target's last layer")
        if self._phase is Phase.FORWARD and self._next_wait == self._next_issue == d:
            self._issue_draft_first(after_replay=replayed)

    def wait_again(self, layer: int) -> dict[str, torch.Tensor]:
        """The views of a layer already waited on in this forward, waited for again by the current stream where
        that matters: a later pass of the draft's first layer captured in a CUDA graph of its own (eagerly a
        no-op: the later pass follows the first wait on the stream).

        >>> w = gatherer.wait_again(61)  # doctest: +SKIP
        """
        i = self._position.get(layer, -1)
        if i < 0 or self._phase is not Phase.FORWARD or self._next_wait <= i:
            raise RuntimeShardError(f"wait_again({layer}) before wait({layer}) in this forward")
        if self._cuda and torch.cuda.is_current_stream_capturing():
            if i != self._draft_at:
                raise RuntimeShardError(f"wait_again({layer}) inside a CUDA graph capture: only the draft's first "
                                        "layer is waited for again there")
            if not self._draft_in_graph:
                # Protects the layer's bytes in this graph: G(D), prefetched outside it, is done before the pass reads.
                torch.cuda.current_stream(self.device).wait_event(self.streams.draft_gathered)
        return self._views[i]

    def _issue_draft_first(self, after_replay: bool) -> None:
        """G(D), from the host, outside any graph: on the draft stream after the handoff (CPU: an async gather)."""
        d = self._draft_at
        assert d is not None
        if self._cuda:
            if self._last_captured and not after_replay:
                # Right after the target's capture nothing of its graph has run, so its handoff was never recorded:
                # protect the slot from the eager work queued so far instead (warm-up forwards still reading it).
                self.streams.forked.record(torch.cuda.current_stream(self.device))
                self.streams.draft.wait_event(self.streams.forked)
            # Protects G(D)'s slot: its last reader, target layer D−2 (inside the target's graph, whose done event
            # this stream cannot wait on), has computed, and G(D−1) is in (the communicator's order, the tag count).
            self.streams.draft.wait_event(self.streams.handoff)
        self._issue(d, self.streams.draft if self._cuda else None, protect=False)

    def _after_replay(self) -> None:
        """The host's state as a replay of the captured target forward leaves it: its forward, at the draft."""
        d, detached = self._draft_at, self._captured_target
        if detached is None or d is None:
            raise RuntimeShardError("prefetch_draft(replayed=True) without a captured target forward to replay; "
                                    "capture the target's forward (begin() ... its last layer) first")
        self._drain()
        self._forward += 1
        self._phase, self._next_wait, self._detached = Phase.FORWARD, d, detached
        issued = self._next_issue = self._issue_limit = d + (not detached)
        self._first_prefetched, self._draft_in_graph = False, not detached
        self._last_captured = True  # the slots' last events are the graph's: wait through the compute stream
        for k, slot in enumerate(self._slots):  # slot k holds the last position < issued that is k mod num_slots
            if k < issued:
                slot.owner = (self._forward, k + (issued - 1 - k) // self.num_slots * self.num_slots)
                slot.state = SlotState.READ

    def _enter_draft(self) -> None:
        """wait(D): G(D) issued inline if nothing issued it, then waited for; then G(D+1), behind that wait."""
        d = self._draft_at
        assert d is not None
        capturing = self._cuda and torch.cuda.is_current_stream_capturing()
        if capturing and self._next_issue == d:
            raise RuntimeShardError(
                f"wait({self.layers[d]}): the draft's first gather was not issued for this forward, and inside a "
                "CUDA graph capture it is not issued inline (a draft graph may be replayed several times a step): "
                "call prefetch_draft() after the target's forward first, or build the gatherer with "
                "draft_first='in_target' to keep it in the target's graph")
        if capturing and self._next_issue > d + 1:
            raise RuntimeShardError(
                f"wait({self.layers[d]}) inside a CUDA graph capture after an eager target forward that gathered the "
                f"draft's layer {self.layers[d + 1]} already: a replay of this graph would not gather it again; build "
                "the gatherer with draft_first='detached', so that the draft's graph gathers its own layers")
        if self._cuda:
            self._forget_done_events_across_capture()  # the draft may run in a graph of its own, or eagerly
        self._issue_limit = self._n
        if self._next_issue == d:  # a cold start, or no prefetch_draft(): inline, waited for in full just below
            self._issue(d, self.streams.gather if self._cuda else None)
        if self._cuda and not self._draft_in_graph:
            # Protects the draft's first layer's bytes: G(D) ran outside any graph (the draft stream, or the gather
            # stream), recorded `draft_gathered`; in a capture this is an external wait node (each replay's prefetch).
            # Issued inside the target's graph instead, that graph ended waiting for it (done(D−1)).
            torch.cuda.current_stream(self.device).wait_event(self.streams.draft_gathered)
        if self._next_issue == d + 1 < self._n:
            if self._cuda:
                # Orders G(D+1) after G(D), which the compute stream has just waited for (on the draft stream, maybe):
                # the communicator pairs collectives by their order, and in a capture this brings the gather stream in.
                self.streams.forked.record(torch.cuda.current_stream(self.device))
                self.streams.gather.wait_event(self.streams.forked)
            self._issue(d + 1, self.streams.gather if self._cuda else None)

    def _end_part(self, stop: int) -> None:
        """The target's part (stop = D, a detached forward) or the forward (stop = n) has been waited on."""
        if stop != self._n:
            if not self._detached:
                return
            if self._cuda:
                # Marks when G(D) may start: G(D−1) is in and layer D−2 (G(D)'s slot's last reader) has computed.
                self.streams.handoff.record(torch.cuda.current_stream(self.device))
            self._check_tags(0, stop)  # inside the target's graph, which its draft's may not follow
        else:
            self._check_tags(self._draft_at if self._detached and self._draft_at is not None else 0, stop)

    def _join_if_captured(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            # A captured target forward that issued G(D) inside its graph (draft_first="in_target") ends here: its
            # graph ends once G(D) is complete, so a draft launched after it reads G(D) in stream order.
            self.streams.checked.record(self.streams.gather)
            torch.cuda.current_stream(self.device).wait_event(self.streams.checked)

    def _wait_for_draft_first(self) -> None:
        if self._cuda and self._draft_at is not None:
            # Protects G(D)'s slot and communicator: a G(D) issued outside a graph and never waited on (a skipped
            # draft step) completes before this forward's gathers, which may reuse both.
            torch.cuda.current_stream(self.device).wait_event(self.streams.draft_gathered)

    def _start_forward(self, prefetch: bool) -> None:
        self._forward += 1
        self._next_issue, self._next_wait = 0, self._n if prefetch else 0
        self._first_prefetched = prefetch
        capturing = self._cuda and torch.cuda.is_current_stream_capturing()
        d, choice = self._draft_at, self._draft_first
        self._detached = d is not None and (choice == "detached" or (capturing and choice == "auto"))
        # The forward's own schedule issues every gather, but G(D) when detached, and in a captured forward no draft
        # gather after G(D): the draft's own graph issues those.
        self._issue_limit = self._n
        if d is not None and (self._detached or capturing):
            self._issue_limit = d if self._detached else d + 1
        if capturing and d is not None:
            self._captured_target = self._detached
        stream = None
        if self._cuda:
            self._forget_done_events_across_capture()
            stream = self.streams.first if prefetch else self.streams.gather
        if self._tags is not None:
            if capturing:
                # Brings the gather stream into the capture before its first op, the count below, which every replay
                # must run too (inside `torch.cuda.stream(gather_stream)` the current stream is not the capturing one).
                self.streams.forked.record(torch.cuda.current_stream(self.device))
                self.streams.gather.wait_event(self.streams.forked)
            with torch.cuda.stream(self.streams.gather) if self._cuda else _NOT_TRACED:
                self._tag_forward.add_(1)  # after the previous forward's check, on the same stream
            if prefetch and self._cuda:
                self.streams.counted.record(self.streams.gather)
                # Orders the first gather's tag after this count (and the previous forward's check).
                self.streams.first.wait_event(self.streams.counted)
        self._issue(0, stream)
        if prefetch and self._cuda:
            self.streams.first_gathered.record(self.streams.first)

    # -- alignment tags ---------------------------------------------------------------------------
    def _allocate_tags(self, n: int, world_size: int) -> list[Tags]:
        """Tag buffers (before connect(): nccl-symm registers its pool there) and the per-forward check's."""
        raw = self.backend.allocate_slot(4 * (2 * n + 2 * n * world_size)).view(torch.int32)
        sent = raw[:2 * n].view(n, 2)  # per position: (position, forward count), what this rank sends
        received = raw[2 * n:].view(n, 2 * world_size)  # per position: every rank's (position, forward count)
        sent.copy_(torch.stack([torch.arange(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)], 1))
        received.zero_()
        self._tag_sent = sent
        self._tag_forward = sent[:, 1]
        self._tag_expected = sent.view(n, 1, 2)
        self._tag_got = received.view(n, world_size, 2)
        self._tag_diff = torch.empty(n, world_size, 2, dtype=torch.bool, device=raw.device)
        self._tag_any = torch.zeros((), dtype=torch.bool, device=raw.device)
        self._tag_bad = torch.zeros((), dtype=torch.bool, device=raw.device)
        # The host's copy of the sticky flag; pinned, so the device writes it without the host waiting.
        self._tag_bad_host = (torch.zeros((), dtype=torch.bool, pin_memory=True) if raw.device.type == "cuda"
                              else self._tag_bad)
        return [Tags(sent[i], received[i]) for i in range(n)]

    _tags: list[Tags] | None = None

    def _check_tags(self, start: int, stop: int) -> None:
        """Compare the tags of this forward's gathers at positions [start, stop) (all complete, or queued
        before on the gather stream, or waited for by the compute stream) with this rank's own, and fold a
        difference into the sticky flag."""
        if self._tags is None or stop <= start:
            return
        if self._cuda and self._draft_at is not None and stop > self._draft_at:
            # The draft's tags come with gathers on other streams (the draft stream, maybe outside this graph), each
            # waited for by the compute stream already: the check follows the compute stream.
            self.streams.forked.record(torch.cuda.current_stream(self.device))
            self.streams.gather.wait_event(self.streams.forked)
        with torch.cuda.stream(self.streams.gather) if self._cuda else _NOT_TRACED:
            if self._cuda and start == 0 and self._first_prefetched:
                # The tags of a prefetched first gather are written on the first stream: wait for them.
                self.streams.gather.wait_event(self.streams.first_gathered)
            got, expected, diff = self._tag_got[start:stop], self._tag_expected[start:stop], self._tag_diff[start:stop]
            torch.ne(got, expected, out=diff)
            torch.any(diff, out=self._tag_any)
            torch.logical_or(self._tag_bad, self._tag_any, out=self._tag_bad)
            if self._cuda:
                self._tag_bad_host.copy_(self._tag_bad, non_blocking=True)
        if self._cuda and torch.cuda.is_current_stream_capturing():
            # A capture must end with every stream it forked joined back: the compute stream waits for the check.
            self.streams.checked.record(self.streams.gather)
            torch.cuda.current_stream(self.device).wait_event(self.streams.checked)

    def check_alignment(self) -> None:
        """Raise if a forward that has run on the device found the ranks' gathers misaligned.

        begin() calls it. Call it yourself between replays of a CUDA graph that contains the forward
        (begin() then runs only at capture): it reads a pinned host flag and never synchronises.

        >>> graph.replay(); gatherer.check_alignment()  # doctest: +SKIP
        """
        self._raise_if_failed()
        self._raise_if_misaligned()

    def _raise_if_misaligned(self) -> None:
        # The host copy lags the device by the forwards still queued: a slip is reported once the forward
        # that showed it has run, at the first begin() after that.
        if self._tags is not None and bool(self._tag_bad_host):
            self._phase = Phase.FAILED
            self._failure = self._describe_misalignment()
            raise RuntimeShardError(self._failure)

    def _raise_if_failed(self) -> None:
        if self._phase is Phase.FAILED:
            raise RuntimeShardError(self._failure)

    def _describe_misalignment(self) -> str:
        if self._cuda:
            torch.cuda.synchronize(self.device)
        got, mine = self._tag_got.cpu().tolist(), self._tag_sent.cpu().tolist()
        ranks = dist.get_process_group_ranks(self.group)  # global ranks, as the launcher and the logs number them
        rank = ranks[dist.get_rank(self.group)]
        detail = "their tags were overwritten since"
        for (position, forward), row in zip(mine, got):
            bad = [(p, tuple(t)) for p, t in enumerate(row) if tuple(t) != (position, forward)]
            if bad:
                p, (peer_position, peer_forward) = bad[0]
                peer_layer = self.layers[peer_position] if 0 <= peer_position < self._n else peer_position
                detail = (f"rank {rank}'s gather of layer {self.layers[position]} (forward {forward}) was paired "
                          f"with rank {ranks[p]}'s gather of layer {peer_layer} (forward {peer_forward})")
                break
        return (f"the ranks' gathers are misaligned, so some gathered weights were wrong: {detail}. A rank "
                "abandoned, skipped or added a forward; every rank must call begin()/wait()/idle_step() for the "
                "same forwards. This gatherer cannot continue: rebuild it on every rank")

    # -- sizes and helpers -------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Device bytes of all gather slots: num_slots·max|T|, or num_slots·(N−1)/N·max|T| with zero copy."""
        return sum(slot.memory.numel() for slot in self._slots)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def gathers_issued(self) -> int:
        """Gathers issued so far on this rank, one per layer of every forward begun (idle steps included)."""
        return self._gathers

    @property
    def phase(self) -> Phase:
        return self._phase

    def _map_own_chunks(self, requested: bool | None, rank: int) -> zc.ZeroCopyMemory | None:
        """Zero-copy memory with the shards in it, if it works here (else None, said in one log line);
        sets zero_copy and zero_copy_reason. Collective on CUDA: the ranks agree. Shards that open_rank
        left unread are read from the file straight into the chunks' allocations (no second copy of R/N)."""
        from . import vmm

        manifest, shards = self.shards.manifest, self.shards
        reason = self.backend.zero_copy_unavailable()
        if reason is None:
            reason = zc.layout_reason(manifest, vmm.granularity(self.device))
        mem = None
        if requested is not False and reason is None:
            try:
                built = zc.build(manifest, rank, self.device, self.num_slots, self.backend.shares_local)
                shards.rehome(lambda nbytes: built.shard_buffer)  # read into place, or one copy if loaded
                mem = built
                reason = zc.own_chunks_alias(mem, manifest, rank, shards.buffer)
            except vmm.VmmError as exc:
                reason = str(exc)
            if reason is not None:
                mem = None
        if self.device.type == "cuda":
            # Every rank takes the same path: with ce, peers read what connect() shares.
            if not all_ranks_agree(mem is not None, self.group, collective_device(self.group, self.device)):
                mem, reason = None, reason or "it could not be set up on another rank"
        decision = zc.decide(requested, None if mem is not None else reason)  # raises if required but impossible
        self.zero_copy, self.zero_copy_reason = decision.use, decision.reason
        if not decision.use:
            log.info("shardprep: own-chunk zero copy off (%s); gathers copy the local chunk", decision.reason)
        return mem

    def _forget_done_events_across_capture(self) -> None:
        # A captured graph cannot wait on events recorded before its capture began, and eager work
        # cannot rely on events recorded only inside a capture: across that boundary, a slot's last
        # reader or writer is waited for through the compute stream instead (state READ).
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing or self._last_captured:
            for slot in self._slots:
                if slot.state in (SlotState.RELEASED, SlotState.GATHERING):
                    slot.state = SlotState.READ
        self._last_captured = capturing

    def _drain(self) -> None:
        # CPU gathers still in flight (from an abandoned forward) complete before new ones are issued.
        for slot in self._slots:
            if slot.work is not None:
                self._wait_work(slot, None)

    def _wait_work(self, slot: Slot, layer: int | None) -> None:
        work, slot.work = slot.work, None
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            what = f"layer {layer}'s gather" if layer is not None else "a gather"
            raise RuntimeShardError(
                f"{what} did not complete within {self.timeout}: a peer stopped issuing gathers or is at another "
                f"layer (turn on debug_alignment to find it) ({str(exc).strip().splitlines()[0] if str(exc) else ''})"
            ) from None

    def _out_of_order(self, layer: int) -> str:
        if self._phase is Phase.FAILED:
            return self._failure
        if layer not in self._position:
            return f"layer {layer} is not gathered (the manifest's layers are {list(self.layers)})"
        if self._phase is not Phase.FORWARD or self._next_wait >= self._n:
            return f"wait({layer}) outside a forward; call begin() first"
        return (f"wait({layer}) while layer {self.layers[self._next_wait]} is next; layers must be waited "
                "on once per forward in manifest order, because every rank gathers them in that order")
