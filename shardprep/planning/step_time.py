"""The step-time model: how long one forward takes when some layers are gathered (pure arithmetic).

A forward is a sequence of segments (what runs before the first layer, each layer, what runs after the
last), each with its compute time alone and, when sharded, the time of its gather alone. Two streams:

- compute: segment i starts when segment i−1 is done and, if i is sharded, when its gather is done;
- gather: gathers run one at a time in layer order; the gather of the k-th sharded layer also waits
  until its slot is free, i.e. until the compute of the (k−S)-th sharded layer is done (S slots).

The gatherer issues gathers ahead on the CPU, so the CPU is assumed to be ahead of the GPU: nothing else
delays a gather. While both streams are busy they share HBM: compute runs `1 + compute_slowdown` times
slower and a gather `1 + gather_slowdown` times slower than alone (`Interference`, measured by
`shardprep profile` on the target GPU, since a decode GEMM slows by more than the bytes a gather adds).
The model simulates the two streams event by event and returns the step time.

The floor of a configuration is the longest of three times no schedule can beat:

- the replicated step (Σ compute);
- the compute slowed for as long as gathers stream: Σc + κ·min(Σc, Σg);
- every gather back to back, then the layers from the last sharded one to the end, which cannot start
  before that gather is done: Σg + Σ_{i ≥ last sharded} c_i (for uniform layers, one layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-12


@dataclass(frozen=True)
class Segment:
    """One piece of a forward: its compute time alone (ms) and, if sharded, its gather time alone (ms)."""

    compute_ms: float
    gather_ms: float | None = None


@dataclass(frozen=True)
class Interference:
    """How much slower each stream runs while the other is busy: κ for compute, λ for gathers.

    0.3 means 1.3 times the time alone. Measured per token count (`shardprep profile`).
    """

    compute_slowdown: float = 0.0
    gather_slowdown: float = 0.0


@dataclass(frozen=True)
class StepFloor:
    """The three lower bounds of a step (ms) and the one that sets the floor."""

    replicated_ms: float
    compute_with_interference_ms: float
    gathers_then_tail_ms: float

    @property
    def ms(self) -> float:
        return max(self.replicated_ms, self.compute_with_interference_ms, self.gathers_then_tail_ms)

    @property
    def term(self) -> str:
        """Which bound sets the floor: "replicated", "compute+interference" or "gathers+tail"."""
        bounds = {"replicated": self.replicated_ms, "compute+interference": self.compute_with_interference_ms,
                  "gathers+tail": self.gathers_then_tail_ms}
        return max(bounds, key=lambda k: bounds[k])


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step of one configuration at one token count (ms)."""

    step_ms: float
    replicated_ms: float
    gathers_ms: float
    floor: StepFloor

    @property
    def overhead(self) -> float:
        """step / replicated − 1: 0.05 is a step 5% slower than without sharding."""
        return self.step_ms / self.replicated_ms - 1 if self.replicated_ms > 0 else 0.0

    @property
    def exposed_ms(self) -> float:
        return self.step_ms - self.replicated_ms


@dataclass(frozen=True)
class Span:
    """One piece of work on one stream of the predicted step: segment `segment` from `start_ms` to `end_ms`."""

    segment: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class StepSchedule:
    """The two streams of one predicted forward: every segment's compute span (in order) and every sharded
    segment's gather span (in order); `step_ms` is the end of the last compute span."""

    compute: tuple[Span, ...]
    gathers: tuple[Span, ...]
    step_ms: float
    segments: tuple[Segment, ...] = ()  # what was scheduled: each segment's times alone


def predict_step(segments: Sequence[Segment], interference: Interference = Interference(),
                 num_slots: int = 2) -> StepPrediction:
    """Simulate one forward; see the module docstring for the schedule and the interference.

    >>> layers = [Segment(1.0, 2.0), Segment(1.0, 2.0), Segment(1.0, 2.0)]
    >>> round(predict_step(layers).step_ms, 6)  # gather-bound: 3 gathers of 2 ms, then the last layer
    7.0
    >>> round(predict_step([Segment(3.0), Segment(1.0, 2.0)]).step_ms, 6)  # the gather hides behind 3 ms
    4.0
    >>> round(predict_step([Segment(3.0), Segment(1.0, 2.0)], Interference(0.5)).step_ms, 6)  # 2 ms at 2/3 speed
    4.666667
    """
    t = schedule_step(segments, interference, num_slots).step_ms
    replicated = sum(s.compute_ms for s in segments)
    gathers = sum(s.gather_ms or 0.0 for s in segments)
    return StepPrediction(t, replicated, gathers, step_floor(segments, interference))


def schedule_step(segments: Sequence[Segment], interference: Interference = Interference(),
                  num_slots: int = 2) -> StepSchedule:
    """The simulation `predict_step` runs, with where each compute and gather starts and ends.

    >>> s = schedule_step([Segment(3.0), Segment(1.0, 2.0)])
    >>> [(x.segment, x.start_ms, x.end_ms) for x in s.gathers], [(x.start_ms, x.end_ms) for x in s.compute]
    ([(1, 0.0, 2.0)], [(0.0, 3.0), (3.0, 4.0)])
    """
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    sharded = [i for i, s in enumerate(segments) if s.gather_ms is not None]
    rank_of = {seg: k for k, seg in enumerate(sharded)}
    compute_done = [False] * len(segments)
    gather_done = [False] * len(sharded)
    compute_spans: list[Span] = []
    gather_spans: list[Span] = []
    t = 0.0
    ci = 0  # the segment the compute stream is on
    c_left = segments[0].compute_ms if segments else 0.0
    c_start: float | None = None  # when segment ci's compute began, None while it waits for its gather
    gk = 0  # the next gather to start
    g_left: float | None = None  # work left in the running gather, None when none runs
    g_start = 0.0
    while ci < len(segments):
        if g_left is None and gk < len(sharded) and (gk < num_slots or compute_done[sharded[gk - num_slots]]):
            g_left, g_start = segments[sharded[gk]].gather_ms, t
        computing = ci not in rank_of or gather_done[rank_of[ci]]
        if computing and c_start is None:
            c_start = t
        gathering = g_left is not None
        both = computing and gathering
        rate_c = 1 / (1 + interference.compute_slowdown) if both else 1.0
        rate_g = 1 / (1 + interference.gather_slowdown) if both else 1.0
        to_c = c_left / rate_c if computing else float("inf")
        to_g = g_left / rate_g if g_left is not None else float("inf")
        dt = min(to_c, to_g)
        if dt == float("inf"):  # cannot happen: the gather the compute waits for can always start
            raise RuntimeError(f"step model stalled at segment {ci}")
        t += dt
        if g_left is not None:
            g_left = g_left - dt * rate_g if to_g > dt + _EPS else None
            if g_left is None:
                gather_done[gk] = True
                gather_spans.append(Span(sharded[gk], g_start, t))
                gk += 1
        if computing:
            if to_c > dt + _EPS:
                c_left -= dt * rate_c
            else:
                compute_done[ci] = True
                compute_spans.append(Span(ci, c_start if c_start is not None else t, t))
                c_start = None
                ci += 1
                c_left = segments[ci].compute_ms if ci < len(segments) else 0.0
    return StepSchedule(tuple(compute_spans), tuple(gather_spans), t, tuple(segments))


def step_floor(segments: Sequence[Segment], interference: Interference = Interference(), *,
               replicated_ms: float | None = None, gather_only_ms: float | None = None) -> StepFloor:
    """The three lower bounds of a step (see the module docstring); measured values may replace the
    sums of the segments: `replicated_ms` (a replicated step) and `gather_only_ms` (one forward's
    gathers back to back, e.g. `LayerGatherer.idle_step`).

    >>> f = step_floor([Segment(1.0, 2.0), Segment(1.0, 2.0)], Interference(0.5))
    >>> f.replicated_ms, f.compute_with_interference_ms, f.gathers_then_tail_ms, f.term
    (2.0, 3.0, 5.0, 'gathers+tail')
    """
    compute = sum(s.compute_ms for s in segments)
    gathers = sum(s.gather_ms or 0.0 for s in segments) if gather_only_ms is None else gather_only_ms
    sharded = [i for i, s in enumerate(segments) if s.gather_ms is not None]
    tail = sum(s.compute_ms for s in segments[sharded[-1]:]) if sharded else 0.0
    return StepFloor(
        replicated_ms=compute if replicated_ms is None else replicated_ms,
        compute_with_interference_ms=compute + interference.compute_slowdown * min(compute, gathers),
        gathers_then_tail_ms=gathers + tail if sharded else 0.0,
    )
