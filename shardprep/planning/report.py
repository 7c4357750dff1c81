"""`shardprep plan --report FILE.html`: the plan as one page to look at and hand to a colleague.

The page is built from `plan --json`'s dict alone (schema shardprep/plan/1), so its figures are the JSON's and
the terminal's: nothing is computed here that the plan did not already decide, only arranged. It holds:

- the step time against tokens per step: replicated and each layer set the plan weighed (every candidate, the
  chosen set, the pays-from set), predicted by the step-time model over the profile's compute times, beside what
  the profile measured (the replicated step, and the profiled directory's own sharded step), each labelled;
- the overhead of each set against tokens per step, the `--max-overhead` bound, and the crossover: the least
  token count from which a set stays within the bound at that count and every larger one planned;
- the per-GPU memory, replicated against sharded: the replicated part, routed experts, the sharded targets
  (whole, or the local chunks), the gather slots, and the KV-cache room left in the HBM.

The figures are inline SVG drawn here, and the page has no script, stylesheet or font from anywhere else: it opens
from a file, offline. The plan's JSON is embedded as `<script type="application/json" id="plan-data">` (with the
figures as drawn), so a reader or a test can take the numbers back out.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .accounting import human_bytes

SERIES_COLOURS = {"replicated": "#333333", "every": "#4c72b0", "chosen": "#55a868", "pays_from": "#dd8452",
                  "measured_replicated": "#333333", "measured_sharded": "#8172b3"}
"""One colour per series in every chart (a measured series is dashed with hollow markers), told apart by the
common colour-vision deficiencies."""
STACK_COLOURS = {"replicated part": "#8c8c8c", "routed experts": "#b07aa1", "sharded targets": "#4c72b0",
                 "gather slots": "#dd8452", "KV-cache room": "#55a868"}
WIDTH, HEIGHT = 640, 320
MARGIN = {"left": 70, "right": 20, "top": 20, "bottom": 45}


def plan_page(plan: Mapping[str, Any]) -> str:
    """The whole HTML page of a plan (`PlanReport.to_dict()`, what `plan --json` prints): see the module docstring.

    >>> report = plan_sharding(PlanRequest("my-llama/", ranks=8, preset="llama"))  # doctest: +SKIP
    >>> Path("plan.html").write_text(plan_page(report.to_dict()))  # doctest: +SKIP
    """
    figures = page_figures(plan)
    title = f"shardprep plan: {plan['source']}, N = {plan['ranks']}"
    parts = [
        _summary(plan),
        "<h2>Step time against tokens per step</h2>",
        _step_section(plan, figures),
        "<h2>Where sharding pays: overhead and the crossover</h2>",
        _crossover_section(plan, figures),
        "<h2>Memory per GPU, replicated against sharded</h2>",
        _memory_section(figures["memory"]),
        _notes(plan),
    ]
    data = json.dumps({"plan": plan, "figures": figures}, indent=1).replace("<", "\\u003c")
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{_text(title)}</title>\n"
            f"<style>{_STYLE}</style>\n</head>\n<body>\n<h1>{_text(title)}</h1>\n" + "\n".join(parts)
            + f"\n<script type=\"application/json\" id=\"plan-data\">\n{data}\n</script>\n</body>\n</html>\n")


def page_figures(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The figures the page draws, taken from the plan's dict: the step-time series, the overhead series with
    each one's crossover, the plan's crossover, and the memory stack.

    >>> crossover = page_figures(plan_sharding(request).to_dict())["crossover"]  # doctest: +SKIP
    """
    bound = plan["max_overhead"]
    sets = _layer_sets(plan)
    overheads = [{"name": name, "label": label, "source": "predicted", "layers": c["layers"],
                  "points": [{"tokens": p["tokens"], "overhead": p["overhead"]} for p in c["predictions"]],
                  "crossover_tokens": crossover_tokens([p["tokens"] for p in c["predictions"]],
                                                       [p["overhead"] for p in c["predictions"]], bound)}
                 for name, label, c in sets if c["predictions"]]
    return {"step_series": _step_series(plan, sets), "overhead_series": overheads,
            "crossover": _plan_crossover(plan, overheads), "memory": memory_stack(plan)}


def crossover_tokens(tokens: Sequence[int], overheads: Sequence[float], bound: float) -> int | None:
    """The least token count from which the overhead stays within `bound` at that count and every larger one;
    None when it exceeds the bound at the largest.

    >>> crossover_tokens([1, 16, 128, 1024], [0.4, 0.08, 0.03, 0.01], 0.05)
    128
    >>> crossover_tokens([16, 128], [0.04, 0.06], 0.05) is None
    True
    """
    found = None
    for t, o in sorted(zip(tokens, overheads), reverse=True):
        if o > bound:
            break
        found = t
    return found


def memory_stack(plan: Mapping[str, Any]) -> dict[str, Any]:
    """Per GPU, replicated and sharded: the parts of the weights and the KV-cache room, of the set the capacity is
    reported for (the chosen set, else the pays-from set, else every candidate).

    Replicated, a GPU holds the replicated part, its routed experts and R whole; sharded, R/N and the gather slots
    instead. The KV-cache room is what is left of the HBM (absent when no HBM size is known).
    """
    name, shown = _shown_set(plan)
    memory, cap = shown["memory"], plan["capacity"]
    common = [("replicated part", cap["replicated_part_bytes"]), ("routed experts", cap["expert_shard_bytes"])]
    bars = [("replicated", [*common, ("sharded targets", memory["sharded_bytes"])], cap["kv_room_replicated_bytes"]),
            ("sharded", [*common, ("sharded targets", memory["local_chunk_bytes"]),
                         ("gather slots", memory["slot_bytes"])], cap["kv_room_sharded_bytes"])]
    return {"set": name, "layers": shown["layers"], "hbm_bytes": cap["hbm_bytes"],
            "saved_bytes": memory["saved_bytes"], "kv_tokens": cap["kv_tokens"],
            "bars": [{"name": bar, "weights_bytes": sum(b for _, b in parts),
                      "parts": [{"name": part, "bytes": b} for part, b in parts if b]
                      + ([{"name": "KV-cache room", "bytes": room}] if room else [])}
                     for bar, parts, room in bars]}


def _shown_set(plan: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """The set `plan` reports its capacity for: the chosen one, else the pays-from one, else every candidate."""
    for name in ("chosen", "pays_from"):
        if plan.get(name) is not None:
            return name, plan[name]
    return "every", plan["every_layer"]


def _layer_sets(plan: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
    """(name, label, choice) of every set the plan weighed, every candidate first; a set equal to an earlier one
    is left out."""
    sets = [("every", f"every candidate ({len(plan['every_layer']['layers'])} layers)", plan["every_layer"])]
    for name, what in (("chosen", "chosen"), ("pays_from", f"pays from {plan['pays_from_tokens']} tokens")):
        choice = plan.get(name)
        if choice is not None and all(choice["layers"] != c["layers"] for _, _, c in sets):
            sets.append((name, f"{what} ({len(choice['layers'])} layers: {_layers_text(choice['layers'])})", choice))
    return sets


def _step_series(plan: Mapping[str, Any], sets: list[tuple[str, str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Predicted step time of replicated and each set, then the profile's measured steps (values ≤ 0 are not
    measurements: a profile that did not time them)."""
    every = plan["every_layer"]["predictions"]
    if not every:
        return []
    series = [{"name": "replicated", "label": "replicated", "source": "predicted", "layers": [],
               "points": [{"tokens": p["tokens"], "ms": p["replicated_ms"]} for p in every]}]
    series += [{"name": name, "label": label, "source": "predicted", "layers": c["layers"],
                "points": [{"tokens": p["tokens"], "ms": p["step_ms"]} for p in c["predictions"]]}
               for name, label, c in sets]
    measured = plan.get("measured")
    if measured:
        where = f"N = {measured['world_size']}, {measured['backend']}{', a dry run' if measured['dry_run'] else ''}"
        layers = measured["sharded_layers"]
        for name, label, values, shards in (
                ("measured_replicated", f"replicated ({where})", measured["replicated_step_ms"], []),
                ("measured_sharded", f"the profiled directory's {len(layers)} layers ({where})",
                 measured["sharded_step_ms"], layers)):
            points = [{"tokens": t, "ms": v} for t, v in zip(plan["tokens"], values) if v > 0]
            if points and (name == "measured_replicated" or layers):
                series.append({"name": name, "label": label, "source": "measured", "layers": shards,
                               "points": points})
    return series


def _plan_crossover(plan: Mapping[str, Any], overheads: list[dict[str, Any]]) -> dict[str, Any]:
    """The plan's own answer to "from how many tokens per step does sharding pay", as a number and a sentence."""
    bound = plan["max_overhead"]
    within = f"within {bound:.0%}"
    if not overheads:
        return {"tokens": None, "bound": bound, "line": "unknown without --profile: the step cost needs each "
                "layer's compute time (`shardprep profile` on the target GPUs)"}
    if plan["chosen"] is not None:
        series = next(s for s in overheads if s["layers"] == plan["chosen"]["layers"])
        t, what = series["crossover_tokens"], f"sharding the chosen {len(series['layers'])} layers"
        if t == min(plan["tokens"]):
            line = f"{what} pays {within} at every token count planned, from {t} tokens per step"
        elif t is not None:
            line = f"{what} pays {within} from {t} tokens per step ({_below(plan['tokens'], t)})"
        else:  # a budget chose it: the least overhead that frees the budget can exceed the bound
            line = f"{what} costs more than {bound:.0%} even at {max(plan['tokens'])} tokens per step"
    elif plan["pays_from_tokens"] is not None:
        t = plan["pays_from_tokens"]
        line = f"sharding pays {within} only from {t} tokens per step ({_below(plan['tokens'], t)})"
    else:
        t = min((s["crossover_tokens"] for s in overheads if s["crossover_tokens"] is not None), default=None)
        line = (f"no set fits {within} at every token count planned; the earliest any set shown does: "
                f"{t} tokens per step" if t is not None else
                f"no set shown fits {within} at any token count planned ({', '.join(map(str, plan['tokens']))})")
    return {"tokens": t, "bound": bound, "line": line}


def _below(tokens: Sequence[int], t: int) -> str:
    smaller = [x for x in tokens if x < t]
    return f"not at {max(smaller)}; counts between were not profiled" if smaller else "the least count planned"


# -- drawing ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Axis:
    """A value range drawn over a pixel range, linear or logarithmic; `at` maps a value to its pixel."""

    low: float
    high: float
    log: bool
    start_px: float
    end_px: float

    def at(self, value: float) -> float:
        """The pixel of `value`: 10 lies halfway between 1 and 100 on a log axis.

        >>> Axis(1, 100, True, 0, 200).at(10)
        100.0
        """
        if self.log:
            f = (math.log10(value) - math.log10(self.low)) / (math.log10(self.high) - math.log10(self.low))
        else:
            f = (value - self.low) / (self.high - self.low)
        return round(self.start_px + f * (self.end_px - self.start_px), 2)

    def ticks(self) -> list[float]:
        if self.log:
            first, last = math.floor(math.log10(self.low)), math.ceil(math.log10(self.high))
            return [10.0**e for e in range(first, last + 1) if self.low <= 10.0**e <= self.high]
        step = _nice_step((self.high - self.low) / 5)
        start = math.ceil(self.low / step) * step
        return [round(start + k * step, 10) for k in range(int((self.high - start) / step + 1e-9) + 1)]

    def attributes(self, name: str) -> str:
        return (f'data-{name}-low="{self.low!r}" data-{name}-high="{self.high!r}" '
                f'data-{name}-log="{int(self.log)}" data-{name}-px="{self.start_px} {self.end_px}"')


def _nice_step(raw: float) -> float:
    magnitude = 10.0 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def token_axis(tokens: Sequence[int]) -> Axis:
    """Tokens per step on a log scale (counts grow by powers), padded to a factor of 2 beyond the ends."""
    return Axis(min(tokens) / 2, max(tokens) * 2, True, MARGIN["left"], WIDTH - MARGIN["right"])


def value_axis(values: Sequence[float], *, zero: bool = False) -> Axis:
    """A y axis for these values: log when they span more than a factor of 10 (small-token steps would flatten
    otherwise) and none is ≤ 0, else linear (from 0 when asked), 10% of headroom either way."""
    low, high = min(values), max(values)
    top, bottom = MARGIN["top"], HEIGHT - MARGIN["bottom"]
    if not zero and low > 0 and high / low > 10:
        return Axis(low / 1.25, high * 1.25, True, bottom, top)
    low = min(0.0, low) if zero else low
    span = (high - low) or abs(high) or 1.0
    return Axis(low - (0.1 * span if not zero or low < 0 else 0.0), high + 0.1 * span, False, bottom, top)


def line_chart(series: Sequence[Mapping[str, Any]], key: str, *, chart_id: str, y_label: str, y_format: str,
               zero: bool = False, rule: float | None = None, marks: Sequence[int] = ()) -> str:
    """An SVG chart of `series` (each `points`: dicts with `tokens` and `key`), tokens on a log x axis: a polyline
    and a circle per point (measured series dashed, hollow markers), a legend, a horizontal `rule` (the bound)
    and vertical `marks` (crossovers). Every drawn point carries its series, tokens and value as data- attributes."""
    xs = token_axis([p["tokens"] for s in series for p in s["points"]])
    values = [p[key] for s in series for p in s["points"]] + ([rule] if rule is not None else [])
    ys = value_axis(values, zero=zero)
    body = [_grid(xs, ys, y_label, y_format)]
    if rule is not None:
        body.append(f'<line class="bound" x1="{xs.start_px}" x2="{xs.end_px}" y1="{ys.at(rule)}" y2="{ys.at(rule)}" '
                    f'stroke="#c44e52" stroke-dasharray="2 3"/><text x="{xs.end_px - 4}" y="{ys.at(rule) - 4}" '
                    f'text-anchor="end" fill="#c44e52">bound {format(rule, y_format)}</text>')
    for t in marks:
        body.append(f'<line class="crossover" data-tokens="{t}" x1="{xs.at(t)}" x2="{xs.at(t)}" y1="{ys.end_px}" '
                    f'y2="{ys.start_px}" stroke="#333" stroke-dasharray="5 3"/>')
    for s in series:
        body.append(_series_marks(s, key, xs, ys, SERIES_COLOURS[s["name"]]))
    legend_height = 18 * len(series) + 10
    legend = [_legend_entry(k, s) for k, s in enumerate(series)]
    return (f'<svg class="chart" id="{chart_id}" role="img" width="{WIDTH}" height="{HEIGHT + legend_height}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT + legend_height}" {xs.attributes("x")} {ys.attributes("y")}>'
            + "".join(body) + "".join(legend) + "</svg>")


def _series_marks(s: Mapping[str, Any], key: str, xs: Axis, ys: Axis, colour: str) -> str:
    dashed = ' stroke-dasharray="6 4"' if s.get("source") == "measured" else ""
    fill = "white" if s.get("source") == "measured" else colour
    coords = [(xs.at(p["tokens"]), ys.at(p[key])) for p in s["points"]]
    line = (f'<polyline data-series="{_attr(s["name"])}" fill="none" stroke="{colour}" stroke-width="2"{dashed} '
            f'points="{" ".join(f"{x},{y}" for x, y in coords)}"/>')
    dots = "".join(f'<circle class="point" data-series="{_attr(s["name"])}" data-tokens="{p["tokens"]}" '
                   f'data-value="{p[key]!r}" cx="{x}" cy="{y}" r="3.5" fill="{fill}" stroke="{colour}">'
                   f'<title>{_text(s["label"])}: {p["tokens"]} tokens, {p[key]:.6g}</title></circle>'
                   for p, (x, y) in zip(s["points"], coords))
    return line + dots


def _legend_entry(k: int, s: Mapping[str, Any]) -> str:
    y = HEIGHT + 8 + 18 * k
    colour = SERIES_COLOURS[s["name"]]
    dashed = ' stroke-dasharray="6 4"' if s.get("source") == "measured" else ""
    return (f'<line x1="{MARGIN["left"]}" x2="{MARGIN["left"] + 24}" y1="{y}" y2="{y}" stroke="{colour}" '
            f'stroke-width="2"{dashed}/><text class="legend" data-series="{_attr(s["name"])}" '
            f'x="{MARGIN["left"] + 30}" y="{y + 4}">{_text(s["source"])}: '
            f'{_text(s["label"])}</text>')


def _grid(xs: Axis, ys: Axis, y_label: str, y_format: str) -> str:
    lines = [f'<rect x="{xs.start_px}" y="{ys.end_px}" width="{xs.end_px - xs.start_px}" '
             f'height="{ys.start_px - ys.end_px}" fill="none" stroke="#999"/>']
    for t in xs.ticks():
        lines.append(f'<line x1="{xs.at(t)}" x2="{xs.at(t)}" y1="{ys.end_px}" y2="{ys.start_px}" stroke="#eee"/>'
                     f'<text class="tick" data-axis="x" data-value="{t!r}" x="{xs.at(t)}" y="{ys.start_px + 16}" '
                     f'text-anchor="middle">{t:g}</text>')
    for v in ys.ticks():
        lines.append(f'<line x1="{xs.start_px}" x2="{xs.end_px}" y1="{ys.at(v)}" y2="{ys.at(v)}" stroke="#eee"/>'
                     f'<text class="tick" data-axis="y" data-value="{v!r}" x="{xs.start_px - 6}" y="{ys.at(v) + 4}" '
                     f'text-anchor="end">{format(v, y_format)}</text>')
    middle = (ys.start_px + ys.end_px) / 2
    lines.append(f'<text x="{(xs.start_px + xs.end_px) / 2}" y="{HEIGHT - 8}" text-anchor="middle">tokens per step '
                 f'(log scale)</text><text x="14" y="{middle}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {middle})">{_text(y_label)}</text>')
    return "".join(lines)


def stack_chart(memory: Mapping[str, Any], *, chart_id: str, with_room: bool) -> str:
    """Two horizontal stacked bars (replicated, sharded), each part's width proportional to its bytes on one scale:
    the weights alone (`with_room` False, scaled to the larger), or with the KV-cache room and the HBM size as a
    line (scaled to the HBM, or to the weights where they exceed it)."""
    bars = [[p for p in b["parts"] if with_room or p["name"] != "KV-cache room"] for b in memory["bars"]]
    hbm = memory["hbm_bytes"] if with_room else None
    full = max([hbm or 0, *(sum(p["bytes"] for p in parts) for parts in bars)]) or 1
    left, right, bar_h = 90, WIDTH - MARGIN["right"], 30
    scale = (right - left) / full
    out = []
    for k, (bar, parts) in enumerate(zip(memory["bars"], bars)):
        y, x = 12 + k * (bar_h + 12), float(left)
        out.append(f'<text x="{left - 8}" y="{y + bar_h / 2 + 4}" text-anchor="end">{bar["name"]}</text>')
        for part in parts:
            w = part["bytes"] * scale
            out.append(f'<rect class="part" data-bar="{bar["name"]}" data-part="{_attr(part["name"])}" '
                       f'data-bytes="{part["bytes"]}" x="{round(x, 3)}" y="{y}" width="{round(w, 3)}" '
                       f'height="{bar_h}" fill="{STACK_COLOURS[part["name"]]}"><title>{_text(part["name"])}: '
                       f'{human_bytes(part["bytes"])}</title></rect>')
            x += w
    bottom = 12 + 2 * bar_h + 12
    if hbm:
        out.append(f'<line class="hbm" x1="{left + hbm * scale}" x2="{left + hbm * scale}" y1="4" y2="{bottom}" '
                   f'stroke="#333" stroke-dasharray="4 3"/>')
    scale_line = f"HBM {human_bytes(hbm)} per GPU" if hbm else f"0 to {human_bytes(round(full))}"
    out.append(f'<text x="{right}" y="{bottom + 14}" text-anchor="end">{scale_line}</text>')
    names = [n for n in STACK_COLOURS if any(p["name"] == n for parts in bars for p in parts)]
    legend = "".join(f'<rect x="{10 + 125 * k}" y="{bottom + 26}" width="10" height="10" fill="{STACK_COLOURS[n]}"/>'
                     f'<text x="{24 + 125 * k}" y="{bottom + 35}">{n}</text>' for k, n in enumerate(names))
    height = bottom + 45
    return (f'<svg class="stack" id="{chart_id}" role="img" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" data-bytes-per-px="{1 / scale!r}" data-left="{left}">'
            + "".join(out) + legend + "</svg>")


# -- the page's text ----------------------------------------------------------------------------------------------


def _summary(plan: Mapping[str, Any]) -> str:
    rows = [("source", f"{plan['source']} ({plan['kind']})"),
            ("model", f"{plan['model_layers']} layers, {len(plan['candidates'])} with targets"),
            ("shard groups", plan["groups"]["description"]), ("slots", plan["slot_model"])]
    if plan["gather_source"]:
        rows.append(("gathers", plan["gather_source"]))
    if plan["convert_command"]:
        rows.append(("convert", f"--layers {plan['convert_layers']}: {plan['convert_command']}"))
    table = "".join(f"<tr><th>{k}</th><td>{_text(v)}</td></tr>" for k, v in rows)
    return f'<p class="verdict" id="verdict">{_text(plan["verdict_line"])}</p>\n<table class="facts">{table}</table>'


def _step_section(plan: Mapping[str, Any], figures: Mapping[str, Any]) -> str:
    series = figures["step_series"]
    if not series:
        gathers = _gathers_without_compute(plan)
        return ('<p class="missing" id="no-step-time">No step-time curve: the step cost needs each layer\'s compute '
                "time, which `shardprep profile` measures on the target GPUs (give it with --profile).</p>" + gathers)
    chart = line_chart(series, "ms", chart_id="step-chart", y_label="step time (ms)", y_format=".3g")
    head = "".join(f"<th>{t}</th>" for t in plan["tokens"])
    rows = "".join(f'<tr data-series="{_attr(s["name"])}"><th>{s["source"]}: {_text(s["label"])}</th>'
                   + "".join(_cell(s["points"], t, "ms", ".3f") for t in plan["tokens"]) + "</tr>" for s in series)
    return (f'<p>Predicted: the step-time model (docs/planning.md) over the profile\'s compute times, '
            f'{_text(plan["gather_source"])}. Measured: what the profile timed.</p>\n{chart}\n'
            f'<table class="numbers" id="step-table"><tr><th>step (ms) at tokens</th>{head}</tr>{rows}</table>')


def _gathers_without_compute(plan: Mapping[str, Any]) -> str:
    gather = {r["layer"]: r["gather_ms"] for r in plan["layers"] if r["gather_ms"] is not None}
    if not gather:
        return ""
    sets = [(label, c["layers"]) for _, label, c in _layer_sets(plan)]
    items = "".join(f"<li>{_text(label)}: {sum(gather[i] for i in layers):.3g} ms of gathers per forward</li>"
                    for label, layers in sets)
    return f"<p>Known without a profile, at {_text(plan['gather_source'])}:</p><ul>{items}</ul>"


def _crossover_section(plan: Mapping[str, Any], figures: Mapping[str, Any]) -> str:
    crossover, series = figures["crossover"], figures["overhead_series"]
    at = "none" if crossover["tokens"] is None else crossover["tokens"]
    line = f'<p class="crossover" id="crossover" data-tokens="{at}">{_text(crossover["line"])}</p>'
    if not series:
        return line
    marks = sorted({s["crossover_tokens"] for s in series if s["crossover_tokens"] is not None})
    chart = line_chart(series, "overhead", chart_id="overhead-chart", y_label="step overhead", y_format="+.0%",
                       zero=True, rule=crossover["bound"], marks=marks)
    rows = "".join(f'<tr data-series="{_attr(s["name"])}"><th>{_text(s["label"])}</th>'
                   + "".join(_cell(s["points"], t, "overhead", "+.1%") for t in plan["tokens"])
                   + f'<td>{s["crossover_tokens"] if s["crossover_tokens"] is not None else "none"}</td></tr>'
                   for s in series)
    head = "".join(f"<th>{t}</th>" for t in plan["tokens"])
    return (f"{line}\n<p>Each set's overhead (step / replicated − 1) against the bound (--max-overhead "
            f"{crossover['bound']:.0%}); a dashed vertical line marks where a set starts to pay.</p>\n{chart}\n"
            f'<table class="numbers" id="overhead-table"><tr><th>overhead at tokens</th>{head}<th>pays from</th></tr>'
            f"{rows}</table>")


def _memory_section(memory: Mapping[str, Any]) -> str:
    rows = "".join(f'<tr data-bar="{bar["name"]}" data-part="{_attr(p["name"])}"><th>{bar["name"]}</th>'
                   f'<td>{_text(p["name"])}</td><td>{human_bytes(p["bytes"])}</td></tr>'
                   for bar in memory["bars"] for p in bar["parts"])
    kv = f" = {memory['kv_tokens']:,} KV-cache tokens" if memory["kv_tokens"] is not None else ""
    hbm = memory["hbm_bytes"]
    over = [bar["name"] for bar in memory["bars"] if hbm and bar["weights_bytes"] > hbm]
    if over:
        kv += f". The weights exceed the HBM ({human_bytes(hbm)}) {' and '.join(over)}: no room for a KV cache"
    return (f"<p>Sharding {len(memory['layers'])} layers ({_text(_layers_text(memory['layers']))}) frees "
            f"{human_bytes(memory['saved_bytes'])} per GPU{kv}. Weights replicated: "
            f"{human_bytes(memory['bars'][0]['weights_bytes'])}; sharded: "
            f"{human_bytes(memory['bars'][1]['weights_bytes'])}. The KV-cache room is what the HBM leaves "
            "(activations and the server's workspace are not counted).</p>\n<h3>Weights</h3>\n"
            + stack_chart(memory, chart_id="weights-stack", with_room=False)
            + ("\n<h3>HBM: weights and the KV-cache room</h3>\n" + stack_chart(memory, chart_id="hbm-stack",
                                                                               with_room=True)
               if memory["hbm_bytes"] else "")
            + f'\n<table class="numbers" id="memory-table">{rows}</table>')


def _notes(plan: Mapping[str, Any]) -> str:
    if not plan["notes"]:
        return ""
    return "<h2>Notes</h2><ul>" + "".join(f"<li>{_text(n)}</li>" for n in plan["notes"]) + "</ul>"


def _cell(points: Sequence[Mapping[str, Any]], tokens: int, key: str, spec: str) -> str:
    value = next((p[key] for p in points if p["tokens"] == tokens), None)
    return "<td></td>" if value is None else f"<td>{format(value, spec)}</td>"


def _layers_text(layers: Sequence[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 12 else f"{layers[0]}, {layers[1]}, … {layers[-1]}"


def _text(value: Any) -> str:
    return html.escape(str(value), quote=False)


def _attr(value: Any) -> str:
    return html.escape(str(value), quote=True)


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 720px; margin: 1.5em auto; color: #222; line-height: 1.4; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1em; margin: .8em 0 0; }
.verdict { font-weight: 600; padding: .6em; background: #f4f6fa; border-left: 4px solid #4c72b0; }
.crossover { font-weight: 600; }
table { border-collapse: collapse; font-size: .85em; margin: .6em 0; }
th, td { padding: 2px 8px; text-align: left; vertical-align: top; }
table.numbers td { text-align: right; font-variant-numeric: tabular-nums; }
table.numbers tr:nth-child(even) { background: #f6f6f6; }
svg { display: block; margin: .5em 0; font-size: 11px; }
svg text.legend { font-size: 12px; }
"""
