"""LayerGatherer: rebuild each layer's weights with one gather, one layer ahead, into ping-pong slots.

Schedule (S = num_slots = 2; G(ℓ) = gather of layer ℓ into slot ℓ % S):

    compute stream:  begin ─ wait(0) ─ [layer 0] done(0) ─ wait(1) ─ [layer 1] done(1) ─ wait(2) ─ ...
                          │      ▲                   │         ▲                   │
    gather stream:      G(0)    G(1) ┄┄┄┄┄┄┄┄┄┄┄┄┄┄ ▼ G(2) ... │ (G(2) waits for done(0): slot 0 is free)
                                 └ issued by wait(0)            └ issued by wait(1)

- wait(ℓ) issues G(ℓ+1) first, so it overlaps layer ℓ's compute, then makes the compute stream wait
  for G(ℓ) (the only cross-stream wait the compute stream does per layer) and returns ℓ's views.
- Every gather into slot s waits on the done() event of the layer that last used slot s (in this
  forward or the previous one), so a slot is never overwritten while it is still read, and nothing
  else is waited for: the next forward's first gathers overlap the previous forward's last layer.
- Where that event is missing (first forward, a skipped done(), an abandoned forward, or inside a
  CUDA graph capture, which cannot wait on events recorded outside it), the gather waits for all
  work queued on the compute stream so far instead.

Every decision (order, slots, offsets, views, backend ops, streams, events) is made in __init__;
the per-layer path only issues ops and records or waits on events.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import RuntimeShardError
from ..loader.rank_shards import RankShards
from .alignment import AlignmentCheck
from .backends import GatherBackend, make_backend
from .backends.base import group_and_rank
from .views import layer_views


class LayerGatherer:
    """Gather each layer of `shards` back into full weights, one layer ahead of the compute.

    Collective: every rank of `group` constructs it with the same arguments and then calls
    begin()/wait()/done() (or idle_step()) for the same forwards, in the same order.

    - `backend`: "auto", "gloo", "nccl", "ce", "nccl-symm", or a backend instance.
    - `num_slots`: gather slots of max|T| bytes each (2 = ping-pong).
    - `debug_alignment`: at every begin(), all ranks compare their step over a gloo side group and
      raise an error naming the disagreeing ranks instead of hanging (costs one small all-reduce).
    - `timeout`: how long a CPU (gloo) gather or the alignment check may wait. NCCL gathers use the
      timeout of their process group (`init_process_group(timeout=...)`).

    begin() twice in a row is harmless: the second call does nothing (the first layer's gather is
    already in flight). begin() after some wait() abandons that forward: the gathers already issued
    still complete (peers issue them too), and the schedule restarts at the first layer; every rank
    must do the same. Skipping done(ℓ) is safe but slower: the gather that reuses ℓ's slot then waits
    for all work queued on the compute stream when it is issued instead of for ℓ's done() event.

    >>> gatherer = LayerGatherer(open_rank("out/", rank, device="cuda:0"))  # doctest: +SKIP
    >>> gatherer.begin()  # doctest: +SKIP
    >>> for layer in gatherer.layers:  # doctest: +SKIP
    ...     w = gatherer.wait(layer)
    ...     x = attention(x, w[f"model.layers.{layer}.self_attn.qkv_proj.weight"], ...)
    ...     gatherer.done(layer)
    """

    def __init__(
        self,
        shards: RankShards,
        group: dist.ProcessGroup | None = None,
        backend: str | GatherBackend = "auto",
        num_slots: int = 2,
        debug_alignment: bool = False,
        timeout: timedelta = timedelta(minutes=10),
    ):
        group, rank, world_size = group_and_rank(group)
        if world_size != shards.world_size or rank != shards.rank:
            raise RuntimeShardError(
                f"the shards were opened for rank {shards.rank} of {shards.world_size}, but this process is rank "
                f"{rank} of {world_size} in the gather group; open_rank(DIR, rank=dist.get_rank(group))"
            )
        if num_slots < 2:
            raise RuntimeShardError(f"num_slots must be >= 2 (one computes while the next gathers), got {num_slots}")
        manifest = shards.manifest
        self.shards = shards
        self.group = group
        self.device = shards.device
        self.timeout = timeout
        self.backend = make_backend(backend, group, self.device) if isinstance(backend, str) else backend
        if not self.backend.owns(shards.buffer):
            shards.rehome(self.backend.allocate_local)

        records = manifest.layers
        self.layers: tuple[int, ...] = tuple(r.layer for r in records)
        self.num_slots = min(num_slots, len(records))
        self._slots = [self.backend.allocate_slot(manifest.max_total_bytes) for _ in range(self.num_slots)]
        self.backend.connect(shards.buffer, self._slots)
        n, s = len(records), self.num_slots
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        self._views = tuple(layer_views(r, self._slots[i % s]) for i, r in enumerate(records))
        self._ops = tuple(self.backend.plan(shards.chunk(r.layer), self._slots[i % s][:r.total_bytes])
                          for i, r in enumerate(records))
        self._works: list = [None] * s
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            # gather_stream: every gather of a forward except a prefetched first one.
            # first_stream: prefetch_first()'s gather, issued before begin() (e.g. while sampling).
            self.gather_stream = torch.cuda.Stream(self.device)
            self.first_stream = torch.cuda.Stream(self.device)
            # gathered[s]: on the stream that gathered into slot s, after that gather.
            # done[s]: on the compute stream, after the compute of the layer in slot s (done()).
            # forked: on the compute stream at begin()/prefetch_first()/a skipped done(): all work so far.
            self._gathered = [torch.cuda.Event() for _ in range(s)]
            self._done = [torch.cuda.Event() for _ in range(s)]
            self._forked = torch.cuda.Event()
        self._alignment = AlignmentCheck(group, timeout) if debug_alignment else None

        self._n = n
        self._next_issue = n  # index of the next layer to gather in this forward
        self._next_wait = n  # index of the next layer wait() accepts; n = no forward in progress
        self._slot_done = [False] * s  # done() recorded for the slot's current layer
        self._in_forward = False  # from begin() until done() of the last layer
        self._prefetched = False  # the first layer's gather was issued by prefetch_first()
        self._prefetch_captured = False  # ... while a CUDA graph was being captured
        self._last_captured = False  # the last begin()/prefetch_first() ran inside a CUDA graph capture
        self._forwards = 0
        self._gathers = 0

    # -- per layer ------------------------------------------------------------------------------
    def wait(self, layer: int) -> dict[str, torch.Tensor]:
        """Issue the next layer's gather, wait for `layer`'s, and return its views (name → tensor).

        The views stay valid until the layer's slot is reused: after done(layer) and the next wait().

        >>> w = gatherer.wait(3)  # doctest: +SKIP
        """
        i = self._position.get(layer, -1)
        if i != self._next_wait:
            raise RuntimeShardError(self._out_of_order(layer))
        if i + 1 == self._next_issue and i + 1 < self._n:
            self._issue(i + 1, self.gather_stream if self._cuda else None)
        s = i % self.num_slots
        work = self._works[s]
        if work is not None:  # CPU backends: block until the bytes are in the slot
            self._works[s] = None
            self._wait_work(work, layer)
        if self._cuda:
            # Protects the slot's bytes: layer ℓ's compute must not read them before G(ℓ) wrote them.
            torch.cuda.current_stream(self.device).wait_event(self._gathered[s])
        self._next_wait = i + 1
        return self._views[i]

    def _issue(self, j: int, stream: torch.cuda.Stream | None) -> None:
        s = j % self.num_slots
        if self._cuda:
            if self._slot_done[s]:
                # Protects slot s: the layer that last used it (this forward's j − S, or the previous
                # forward's) may still be read by its compute.
                stream.wait_event(self._done[s])
            else:
                # No done() event to trust: protect the slot from everything queued on the compute stream.
                self._forked.record(torch.cuda.current_stream(self.device))
                stream.wait_event(self._forked)
        self._works[s] = self._ops[j](stream)
        if self._cuda:
            self._gathered[s].record(stream)
        self._slot_done[s] = False
        self._next_issue = j + 1
        self._gathers += 1

    def done(self, layer: int) -> None:
        """Record that `layer`'s compute has been issued, so its slot may be refilled after it runs.

        >>> gatherer.done(3)  # doctest: +SKIP
        """
        i = self._position.get(layer, -1)
        if not 0 <= i < self._next_wait:
            raise RuntimeShardError(f"done({layer}) before wait({layer}) in this forward")
        s = i % self.num_slots
        if i + self.num_slots >= self._next_issue:  # else the slot was refilled already (done() came late)
            if self._cuda:
                self._done[s].record(torch.cuda.current_stream(self.device))
            self._slot_done[s] = True
        if i == self._n - 1:
            self._in_forward = False

    # -- per forward ----------------------------------------------------------------------------
    def begin(self, step: int | None = None) -> None:
        """Start a forward: reset the schedule and dispatch the first layer's gather.

        `step` (optional) is the caller's step number, compared across ranks when debug_alignment is on.

        >>> gatherer.begin()  # doctest: +SKIP
        """
        if self._in_forward and self._next_wait == 0:
            return  # begin() twice in a row: the first layer's gather is already in flight
        if not self._prefetched:  # a prefetched first gather is the only one in flight: keep it
            self._drain()
        if self._alignment is not None:
            self._alignment(self._forwards if step is None else step, self._forwards, self._gathers)
        if self._cuda:
            if self._prefetched and self._prefetch_captured != torch.cuda.is_current_stream_capturing():
                raise RuntimeShardError("prefetch_first() and begin() must both run inside the CUDA graph being "
                                        "captured, or both outside it")
            self._forget_done_events_across_capture()
        self._next_wait = 0
        self._in_forward = True
        self._forwards += 1
        if self._prefetched:
            self._prefetched = False
            self._next_issue = 1
        else:
            self._issue(0, self.gather_stream if self._cuda else None)

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

        Call it between forwards: after done() of the last layer. begin() then skips that gather.

        >>> gatherer.done(gatherer.layers[-1]); gatherer.prefetch_first()  # doctest: +SKIP
        """
        if self._prefetched:
            return
        if self._in_forward:
            raise RuntimeShardError(
                f"prefetch_first() during a forward; call it after done({self.layers[-1]}) of the last layer"
            )
        self._drain()
        stream = None
        if self._cuda:
            stream = self.first_stream
            self._forget_done_events_across_capture()
        self._issue(0, stream)  # waits only for the previous reader of slot 0, not the whole last layer
        self._prefetched = True
        self._prefetch_captured = self._cuda and torch.cuda.is_current_stream_capturing()

    def wait_first(self) -> dict[str, torch.Tensor]:
        """Views of the first layer: the prefetched gather if there is one; a cold start gathers inline.

        >>> w = gatherer.wait_first()  # doctest: +SKIP
        """
        if not (self._in_forward and self._next_wait == 0):
            self.begin()
        return self.wait(self.layers[0])

    # -- sizes and helpers -------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Device bytes of all gather slots: num_slots · max|T|."""
        return sum(slot.numel() for slot in self._slots)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def _forget_done_events_across_capture(self) -> None:
        # A captured graph cannot wait on events recorded before its capture began, and eager work
        # cannot rely on events recorded only inside a capture: across that boundary, wait for everything.
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing or self._last_captured:
            self._slot_done = [False] * self.num_slots
        self._last_captured = capturing

    def _drain(self) -> None:
        # CPU gathers still in flight (from an abandoned forward) complete before new ones are issued.
        for s, work in enumerate(self._works):
            if work is not None:
                self._works[s] = None
                self._wait_work(work, None)

    def _wait_work(self, work, layer: int | None) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            what = f"layer {layer}'s gather" if layer is not None else "a gather"
            raise RuntimeShardError(
                f"{what} did not complete within {self.timeout}: a peer stopped issuing gathers or is at another "
                f"layer (turn on debug_alignment to find it) ({str(exc).strip().splitlines()[0] if str(exc) else ''})"
            ) from None

    def _out_of_order(self, layer: int) -> str:
        if layer not in self._position:
            return f"layer {layer} is not gathered (the manifest's layers are {list(self.layers)})"
        if self._next_wait >= self._n:
            return f"wait({layer}) outside a forward; call begin() first"
        return (f"wait({layer}) while layer {self.layers[self._next_wait]} is next; layers must be waited "
                "on once per forward in manifest order, because every rank gathers them in that order")
