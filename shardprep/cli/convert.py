"""`shardprep convert SRC OUT --ranks N`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..prep.convert import ConvertSummary, CopyMode
from ..prep.requant_jobs import RequantMode, RequantRecipe, RequantScope, ScaleFormat
from ._errors import cli_errors, stop_signals_interrupt
from ._format import (
    AllowPresetMismatch,
    ChunkAlignment,
    byte_progress,
    draft_line,
    human_bytes,
    print_json,
    rank_files_phrase,
)
from ._help import Debug


def convert_command(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Local HF model directory, or a hub repo id (fetched a "
                                                           "file or two at a time; see --keep-source).")],
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Output directory (created; must be empty unless "
                                                            "--overwrite).")],
    ranks: Annotated[int, typer.Option("--ranks", "-n", metavar="N", help="Number of ranks N to shard across.")],
    target: Annotated[list[str] | None, typer.Option("--target", "-t", metavar="GLOB",
                      help="fnmatch glob over full tensor names; repeatable.")] = None,
    preset: Annotated[str | None, typer.Option(metavar="NAME|FILE", help="Built-in preset (see `shardprep "
                                                                        "presets`) or a preset JSON file; a DFlash "
                                                                        "or EAGLE-3 draft's checkpoint gets its own "
                                                                        "without one.")] = None,
    allow_preset_mismatch: AllowPresetMismatch = False,
    layers: Annotated[str | None, typer.Option(metavar="LAYERS", help="Layers to shard: N, A-B, A-, -B, a range "
                                               "with a stride (1-:2 = every other layer from 1), lists (1,3,5-9), or "
                                               "'all'; `shardprep plan` prints one. Default 1-: layer 0, whose "
                                               "compute hides layer 1's gather, stays replicated; a DFlash or "
                                               "EAGLE-3 draft's checkpoint: all.")] = None,
    layer_pattern: Annotated[str | None, typer.Option(metavar="REGEX", help="Regex with one group capturing the "
                                                                            "layer index.")] = None,
    revision: Annotated[str | None, typer.Option(metavar="REV", help="Hub revision (branch, tag or commit).")]
    = None,
    copy_mode: Annotated[CopyMode, typer.Option(help="auto: hard-link unchanged files when possible.")]
    = CopyMode.AUTO,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a previous output in OUT (atomically).")]
    = False,
    keep_source: Annotated[bool, typer.Option("--keep-source", help="A hub id: download the whole snapshot into "
                                                                    "the HF cache and keep it (default: fetch a "
                                                                    "file or two at a time, each dropped once "
                                                                    "converted).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the selection and the sizes; write nothing.")]
    = False,
    requant: Annotated[RequantMode, typer.Option(help="Requantize block-FP8 weights to UE8M0 (power-of-two) "
                                                      "scales.")] = RequantMode.AUTO,
    requant_scope: Annotated[RequantScope, typer.Option(help="Which block-FP8 weights to requantize.")]
    = RequantScope.ALL,
    requant_recipe: Annotated[RequantRecipe, typer.Option(help="sglang: bit-exact with SGLang/DeepGEMM; fp32: "
                                                               "vLLM's.")] = RequantRecipe.SGLANG,
    scale_format: Annotated[ScaleFormat, typer.Option(help="f32: power-of-two float32 weight_scale_inv; e8m0: "
                                                           "F8_E8M0 tensors.")] = ScaleFormat.F32,
    allow_nonfinite: Annotated[bool, typer.Option("--allow-nonfinite", help="Requantize weights with inf/nan "
                                                                        "instead of refusing.")]
    = False,
    device: Annotated[str, typer.Option(metavar="DEVICE", help="Device for requantization: cpu or cuda.")]
    = "cpu",
    workers: Annotated[int, typer.Option(metavar="N", help="Requant worker threads (0 = one per core).")] = 0,
    chunk_alignment: ChunkAlignment = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or summary.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary "
                                                          "(schema shardprep/convert-summary/1).")] = False,
    debug: Debug = False,
) -> None:
    """Convert a HF safetensors checkpoint into per-rank flat chunks plus a manifest."""
    from ..prep.convert import convert
    from ..prep.requant_jobs import RequantOptions

    with (stop_signals_interrupt(), cli_errors(),
          byte_progress("convert", not (quiet or json_out or dry_run)) as progress):
        options = RequantOptions(mode=requant, scope=requant_scope, recipe=requant_recipe, scale_format=scale_format,
                                 allow_nonfinite=allow_nonfinite, device=device, workers=workers)
        summary = convert(
            src, out, ranks, targets=target or (), preset=preset, layers=layers, layer_pattern=layer_pattern,
            revision=revision, copy_mode=copy_mode, overwrite=overwrite, requant=options, dry_run=dry_run,
            chunk_alignment=chunk_alignment, progress=progress, allow_preset_mismatch=allow_preset_mismatch,
            keep_source=keep_source,
        )
    if summary.preset and preset is None and not target and not (quiet or json_out):
        typer.echo(f"preset {summary.preset}: {src}'s config.json is a {summary.preset} draft model's (no --preset "
                   "given); every layer sharded unless --layers says otherwise")
    if json_out:
        print_json(summary.to_dict())
    elif dry_run:
        _print_dry_run(summary.plan)
    elif not quiet:
        typer.echo(
            f"wrote {summary.out}: {len(summary.layers)} layers, {summary.target_tensors} target tensors "
            f"({human_bytes(summary.target_bytes)}) in {summary.world_size} rank files of "
            f"{rank_files_phrase(summary)}; "
            f"{summary.replicated_tensors} replicated tensors "
            f"({human_bytes(summary.replicated_bytes)}, {len(summary.linked_files)} files linked); "
            f"{summary.seconds:.1f} s"
        )
        if summary.quantization:
            typer.echo(_requant_line(summary))
        if summary.source_peak_bytes is not None:
            typer.echo(f"fetched {human_bytes(summary.fetched_bytes or 0)} from the hub, a layer at a time: at most "
                       f"{human_bytes(summary.source_peak_bytes)} of the source on disk at once")


def _requant_line(summary: ConvertSummary) -> str:
    """What the requant did, from the summary's counts and its `quantization` (the manifest's record)."""
    record: dict[str, Any] = summary.quantization or {}
    block = "×".join(str(b) for b in record["block"])
    scope = ", targets only" if record["scope"] == "targets" else ""
    scales = "F8_E8M0 tensors" if record["scale_format"] == "e8m0" else "float32 powers of two"
    return (f"requantized {summary.requantized_weights} block-FP8 weights ({summary.requantized_blocks} "
            f"{block} blocks{scope}) to UE8M0 scales ({scales}), {record['recipe']} recipe")


def _print_dry_run(plan: dict) -> None:
    draft = plan["draft"]
    # A draft model's own checkpoint is all draft (its line below says so): no target layer to tell its layers from.
    drafted = {str(i) for i in draft["layers"]} if draft and "target" not in draft else set()
    for layer, names in plan["layers"].items():
        fused = plan["fused_views"].get(layer, [])
        whose = f" (draft: {draft['kind'].upper()} layer, not the target model's)" if layer in drafted else ""
        typer.echo(f"layer {layer}{whose}: {len(names)} targets" + (f", fused {', '.join(fused)}" if fused else ""))
        for name in names:
            typer.echo(f"    {name}")
    n = plan["world_size"]
    memory = plan["memory"]
    typer.echo(
        f"dry run, nothing written: {plan['target_tensors']} targets, Σ|T| = {human_bytes(plan['sharded_bytes'])} "
        f"in {n} rank files of {human_bytes(plan['rank_file_bytes'])}; per rank resident "
        f"{human_bytes(memory['resident_bytes'])} (R/N + slots) instead of {human_bytes(plan['sharded_bytes'])}, "
        f"saved {human_bytes(memory['saved_bytes'])}; {plan['requantized_weights']} block-FP8 weights to requantize"
    )
    if draft:
        typer.echo(draft_line(draft))
