"""The predicted step as a timeline: what `shardprep plan --trace FILE` writes.

The file is in the Chrome trace event format (JSON), which Perfetto (ui.perfetto.dev) and chrome://tracing
open locally. It draws the step-time model's own simulation (`step_time.schedule_step`) of the layers the
plan shows, one process per token count ("predicted step, 16 tokens"), each with three threads:

- step: one span, the whole predicted step (its args: replicated step, overhead, the sharded layers);
- compute: each segment's compute ("compute layer 3", "compute before layer 0", "compute after the last
  layer"), and "wait layer 4" where the compute stream stands still until layer 4's gather is done;
- gather: "gather layer 4" from its start to its end, and "slot wait layer 6" where the next gather waits
  for its slot, i.e. for the compute of the layer S gathers earlier (done(ℓ) frees its slot).

Times are microseconds from the start of the step (the format's unit); a span's args give its time alone,
so a span longer than that was slowed by the other stream (HBM interference).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..errors import ShardprepError
from ..planning.step_time import StepSchedule
from .deployment_plan import PlanReport
from .selection import format_layers

TRACE_TIDS = {"step": 0, "compute": 1, "gather": 2}


def segment_name(segment: int, segments: int) -> str:
    """Segment 0 runs before layer 0, segment i + 1 is layer i, the last one runs after the last layer."""
    if segment == 0:
        return "before layer 0"
    if segment == segments - 1:
        return "after the last layer"
    return f"layer {segment - 1}"


def schedule_events(schedule: StepSchedule, *, pid: int, title: str, num_slots: int = 2) -> list[dict[str, Any]]:
    """One predicted step as trace events: metadata naming the process and its threads, then complete ("X")
    spans in microseconds on the step, compute and gather threads (see the module docstring).

    >>> from shardprep.planning.step_time import Segment, schedule_step
    >>> events = schedule_events(schedule_step([Segment(1.0), Segment(1.0, 2.0), Segment(0.5)]), pid=1, title="t")
    >>> [(e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 1]
    [('compute before layer 0', 0.0, 1000.0), ('wait layer 0', 1000.0, 1000.0), ('compute layer 0', 2000.0, 1000.0), \
('compute after the last layer', 3000.0, 500.0)]
    """
    n = len(schedule.segments)

    def span(name: str, cat: str, thread: str, start_ms: float, end_ms: float, **args: Any) -> dict[str, Any]:
        ts = _us(start_ms)
        return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": round(_us(end_ms) - ts, 3), "pid": pid,
                "tid": TRACE_TIDS[thread], "args": args}

    events = [_metadata("process_name", pid, 0, title), {"name": "process_sort_index", "ph": "M", "pid": pid,
                                                           "tid": 0, "args": {"sort_index": pid}}]
    for thread, tid in TRACE_TIDS.items():
        events.append(_metadata("thread_name", pid, tid, thread))
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    replicated = sum(s.compute_ms for s in schedule.segments)
    sharded = [g.segment for g in schedule.gathers]
    events.append(span("predicted step", "step", "step", 0.0, schedule.step_ms, step_ms=schedule.step_ms,
                       replicated_ms=replicated, sharded_layers=[s - 1 for s in sharded]))
    gather_end = {g.segment: g.end_ms for g in schedule.gathers}
    previous_end = 0.0
    for c in schedule.compute:
        name = segment_name(c.segment, n)
        if c.start_ms > previous_end and c.segment in gather_end:
            # The compute stream waits on this layer's gather event: what a sharded layer costs when exposed.
            events.append(span(f"wait {name}", "wait", "compute", previous_end, c.start_ms, for_gather_of=name))
        events.append(span(f"compute {name}", "compute", "compute", c.start_ms, c.end_ms,
                           alone_ms=schedule.segments[c.segment].compute_ms))
        previous_end = c.end_ms
    compute_end = {c.segment: c.end_ms for c in schedule.compute}
    previous_end = 0.0
    for k, g in enumerate(schedule.gathers):
        name = segment_name(g.segment, n)
        if g.start_ms > previous_end and k >= num_slots:
            freed_by = segment_name(sharded[k - num_slots], n)
            events.append(span(f"slot wait {name}", "slot wait", "gather", previous_end, g.start_ms,
                               slot_freed_by=f"done({freed_by})", freed_at_us=_us(compute_end[sharded[k - num_slots]])))
        events.append(span(f"gather {name}", "gather", "gather", g.start_ms, g.end_ms,
                           alone_ms=schedule.segments[g.segment].gather_ms))
        previous_end = g.end_ms
    return events


def plan_trace(report: PlanReport) -> dict[str, Any]:
    """`plan --trace`'s document: the predicted step of the layers the plan shows, one process per token count.

    >>> text = trace_text(plan_trace(plan_sharding(request)))  # doctest: +SKIP
    """
    if not report.schedules:
        raise ShardprepError("--trace needs --profile: the predicted schedule needs each layer's compute time")
    layers = format_layers(report.schedule_layers, num_layers=report.model_layers) or "none"
    events: list[dict[str, Any]] = []
    for pid, (tokens, schedule) in enumerate(zip(report.tokens, report.schedules), start=1):
        events += schedule_events(schedule, pid=pid, num_slots=report.num_slots,
                                  title=f"predicted step, {tokens} tokens, layers {layers} sharded")
    return trace_document(events, shardprep="plan --trace: predicted", source=report.source, ranks=report.ranks,
                          backend=report.backend, gather_source=report.gather_source, tokens=list(report.tokens),
                          sharded_layers=list(report.schedule_layers), num_slots=report.num_slots,
                          step_ms=[s.step_ms for s in report.schedules])


def trace_document(events: Sequence[dict[str, Any]], **other: Any) -> dict[str, Any]:
    """The JSON object trace readers open: the events, the unit they display, and `other` as `otherData`."""
    return {"traceEvents": list(events), "displayTimeUnit": "ms", "otherData": dict(other)}


def trace_text(document: dict[str, Any]) -> str:
    return json.dumps(document, separators=(",", ":")) + "\n"


def _metadata(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _us(ms: float) -> float:
    """Milliseconds to the format's microseconds, to the nanosecond."""
    return round(ms * 1e3, 3)
