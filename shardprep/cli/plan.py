"""`shardprep plan SRC_OR_OUT --ranks N`: does sharding pay, and which layers should `convert --layers` shard?"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import ShardprepError
from ._errors import cli_errors
from ._format import (
    AllowPresetMismatch,
    ContextLen,
    Dp,
    Ep,
    Gpu,
    GpusPerNode,
    HbmGb,
    KvDtype,
    NumSlots,
    Tp,
    capacity_rows,
    draft_line,
    human_bytes,
    kind_runs,
    kind_totals_line,
    parse_fraction,
    parse_token_counts,
    plain_table,
    print_json,
)
from ._help import Debug
from ._output_file import replaced_on_success
from .run import Backend

if TYPE_CHECKING:
    from ..prep.deployment_plan import PlanReport


def plan_command(
    source: Annotated[str, typer.Argument(
        metavar="SRC_OR_OUT", help="A HF checkpoint (local or hub id) or an output directory of `shardprep convert`.")],
    ranks: Annotated[int | None, typer.Option("--ranks", "-n", metavar="N", help="Ranks N to shard across: the "
                                                "shard group size (default: OUT's own N; with --dp, the largest that "
                                                "fits a node).")]
    = None,
    preset: Annotated[str | None, typer.Option(
        metavar="NAME|FILE", help="Built-in preset or preset JSON file (SRC only).")] = None,
    target: Annotated[list[str] | None, typer.Option(
        "--target", "-t", metavar="GLOB", help="fnmatch glob over tensor names; repeatable (SRC only).")] = None,
    layers: Annotated[str, typer.Option(
        metavar="LAYERS", help="Candidate layers (convert --layers syntax); the plan picks among them.")] = "all",
    layer_pattern: Annotated[str | None, typer.Option(
        metavar="REGEX", help="Regex with one group capturing the layer index.")] = None,
    draft: Annotated[str | None, typer.Option(
        metavar="DRAFT", help="A DFlash or EAGLE-3 draft to serve beside the target (its checkpoint or converted "
                              "directory): its saving apart from the target's, and both together.")] = None,
    revision: Annotated[str | None, typer.Option(metavar="REV", help="Hub revision (SRC only).")] = None,
    allow_preset_mismatch: AllowPresetMismatch = False,
    profile: Annotated[Path | None, typer.Option(
        metavar="FILE", help="A `shardprep profile` JSON of the target machine: compute, gathers, interference.")]
    = None,
    link_gbps: Annotated[float | None, typer.Option(
        metavar="GBPS", help="Gather bandwidth received per rank, GB/s, instead of the profile's (alone it gives "
                             "only the gather side).")] = None,
    backend: Annotated[Backend | None, typer.Option(
        help="Which profiled backend to plan for (default: the first profiled).")] = None,
    tokens: Annotated[str | None, typer.Option(
        metavar="T,T,...", help="Token counts per step to hold the overhead at (default: all the profile has).")]
    = None,
    max_overhead: Annotated[str, typer.Option(
        metavar="PCT", help="Largest predicted step-time overhead allowed, e.g. 5% or 0.05.")] = "5%",
    budget_gb: Annotated[float | None, typer.Option(
        metavar="GB", help="Instead: free at least this many GB (10^9 B) per rank at the least overhead.")] = None,
    hbm_gb: HbmGb = None,
    gpu: Gpu = None,
    context_len: ContextLen = 8192,
    kv_dtype: KvDtype = "auto",
    num_slots: NumSlots = 2,
    dp: Dp = None,
    gpus_per_node: GpusPerNode = 8,
    ep: Ep = 1,
    tp: Tp = 1,
    chunk_alignment: Annotated[str | None, typer.Option(
        metavar="auto|none|SIZE", help="Chunk alignment convert will use, e.g. 2MiB (SRC: default auto, as "
                                       "convert; OUT has its own).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (schema shardprep/plan/1).")]
    = False,
    trace: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Also write the predicted per-layer schedule (compute, gathers, waits) as a Chrome "
                             "trace JSON for ui.perfetto.dev or chrome://tracing (needs --profile).")] = None,
    report_html: Annotated[Path | None, typer.Option(
        "--report", metavar="FILE.html", help="Also write the plan as one self-contained HTML page: step time "
                                              "against tokens per step, the crossover, the memory per GPU.")] = None,
    debug: Debug = False,
) -> None:
    """Per rank: memory saved, the KV-cache tokens and requests it buys, the startup peak; per layer: gather
    against compute; the layers to shard and the `convert --layers` argument; a one-line verdict."""
    from ..planning.expert_parallel import hbm_bytes
    from ..planning.report import plan_page
    from ..prep.convert_plan import parse_chunk_alignment
    from ..prep.deployment_plan import PlanRequest, plan_sharding
    from ..prep.schedule_trace import plan_trace, trace_text

    with cli_errors(), ExitStack() as stack:
        if trace is not None and profile is None:
            raise ShardprepError("--trace needs --profile: the predicted schedule needs each layer's compute time")
        trace_part = stack.enter_context(replaced_on_success(trace, "--trace")) if trace is not None else None
        page_part = stack.enter_context(replaced_on_success(report_html, "--report")) if report_html else None
        request = PlanRequest(
            source=source, ranks=ranks, targets=tuple(target or ()), preset=preset, layers=layers,
            layer_pattern=layer_pattern, revision=revision, profile=profile, link_gbps=link_gbps, draft=draft,
            backend=backend.value if backend else None,
            tokens=parse_token_counts(tokens) if tokens else None, hbm_bytes=hbm_bytes(gpu, hbm_gb),
            context_len=context_len, max_overhead=parse_fraction(max_overhead, "--max-overhead"),
            budget_bytes=None if budget_gb is None else int(budget_gb * 10**9), kv_dtype=kv_dtype,
            num_slots=num_slots,
            chunk_alignment=parse_chunk_alignment(chunk_alignment) if chunk_alignment else None,
            dp=dp, gpus_per_node=gpus_per_node, ep=ep, tp=tp, allow_preset_mismatch=allow_preset_mismatch,
        )
        report = plan_sharding(request)
        if trace_part is not None:
            trace_part.write_text(trace_text(plan_trace(report)))
        if page_part is not None:
            page_part.write_text(plan_page(report.to_dict()), encoding="utf-8")
    if json_out:
        print_json(report.to_dict())
    else:
        print_plan(report)


def print_plan(report: PlanReport) -> None:
    """Tables: per layer, predicted steps, per rank; then the convert command, notes and the verdict. Tables fit
    80 columns; prose is soft-wrapped (the terminal folds it, and a pasted line stays whole)."""
    from rich.console import Console

    console = Console()
    say = partial(console.print, soft_wrap=True)
    shown = report.chosen or report.every_layer
    picked = set(report.chosen.layers) if report.chosen else set()
    say(f"{report.source} ({report.kind}), N = {report.ranks}, {report.model_layers} layers, "
        f"{len(report.candidates)} with targets")
    say(f"slots: {report.slot_model}")
    say(f"shard groups: {report.groups.describe()}")
    if report.gather_source:
        say(f"gathers: {report.gather_source}")
    # No C = |T|/N column (`--json` has it): with five token counts it would not fit 80 columns.
    layers = plain_table("layer", "|T|", "gather", *map(str, report.tokens), "shard",
                         title="per layer: |T|, its gather alone (ms), its compute with replicated weights at "
                               "each token count (ms)" if report.tokens else "per layer: |T|, its gather alone (ms)")
    for r in report.rows:
        layers.add_row(str(r.layer), human_bytes(r.total_bytes) if r.total_bytes else "",
                       f"{r.gather_ms:.3f}" if r.gather_ms is not None else "",
                       *(f"{ms:.3f}" for ms in r.compute_ms), "✓" if r.layer in picked else "")
    console.print(layers)
    for line in kind_runs({r.layer: r.kinds for r in report.rows if r.kinds}):
        say(line)
    if report.kinds:
        say(kind_totals_line(report.kinds))
    choices = [("every", report.every_layer)]
    if report.chosen is not None and report.chosen.layers != report.every_layer.layers:
        choices.append(("chosen", report.chosen))
    if report.every_layer.predictions:
        steps = plain_table("layers", "tokens", "replicated", "sharded", "overhead", "floor", "floor set by",
                            title="predicted step (ms) against replicated; floor: the longest of replicated, "
                                  "compute with interference, gathers + the layers after the last one")
        for name, choice in choices:
            for t, p in zip(report.tokens, choice.predictions):
                steps.add_row(f"{name} ({len(choice.layers)})", str(t), f"{p.replicated_ms:.3f}",
                              f"{p.step_ms:.3f}", f"{p.overhead:+.1%}", f"{p.floor.ms:.3f}", p.floor.term)
        console.print(steps)
    memory = plain_table("", "", title=f"per rank, sharding {len(shown.layers)} layers", show_header=False)
    memory.columns[0].justify = "left"
    for label, value in capacity_rows(shown.memory.to_dict(), report.capacity.to_dict(),
                                      report.kv.to_dict() if report.kv else None, report.experts.to_dict()):
        memory.add_row(label, value)
    console.print(memory)
    if report.draft is not None:
        say(draft_line(report.draft))
    if report.convert_command:
        say(f"convert argument: --layers {report.convert_layers}")
        say(f"  {report.convert_command}")
    for note in report.notes:
        say(f"note: {note}")
    say(report.verdict_line)
