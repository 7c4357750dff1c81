"""`shardprep convert SRC OUT --ranks N`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ._errors import cli_errors
from ._format import byte_progress, human_bytes, print_json


def convert_command(
    src: Annotated[str, typer.Argument(help="Local HF model directory, or a hub repo id (resolved via the HF cache).")],
    out: Annotated[Path, typer.Argument(help="Output directory (created; must be empty unless --overwrite).")],
    ranks: Annotated[int, typer.Option("--ranks", "-n", help="Number of ranks N to shard across.")],
    target: Annotated[list[str] | None, typer.Option("--target", "-t",
                      help="fnmatch glob over full tensor names; repeatable.")] = None,
    preset: Annotated[str | None, typer.Option(help="Built-in preset (llama, qwen3-moe, deepseek-v3) or a preset "
                                                    "JSON file.")] = None,
    layers: Annotated[str, typer.Option(help="Layer range A-B, A-, or 'all'. Default skips layer 0, whose "
                                             "compute hides layer 1's gather.")] = "1-",
    layer_pattern: Annotated[str | None, typer.Option(help="Regex with one group capturing the layer index.")] = None,
    revision: Annotated[str | None, typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    copy_mode: Annotated[str, typer.Option(help="auto: hard-link unchanged files when possible; link; copy.")] = "auto",
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty OUT (atomically).")] = False,
    requant: Annotated[str, typer.Option(help="auto|ue8m0|none: requantize block-FP8 weights to UE8M0 scales.")]
    = "auto",
    requant_scope: Annotated[str, typer.Option(help="all|targets: which block-FP8 weights to requantize.")] = "all",
    requant_recipe: Annotated[str, typer.Option(help="sglang (bit-exact with SGLang/DeepGEMM) or fp32 (vLLM).")]
    = "sglang",
    scale_format: Annotated[str, typer.Option(help="f32: pow2 float32 weight_scale_inv; e8m0: F8_E8M0 tensors.")]
    = "f32",
    allow_nonfinite: Annotated[bool, typer.Option(help="Requantize weights with inf/nan instead of refusing.")]
    = False,
    device: Annotated[str, typer.Option(help="Device for requantization: cpu or cuda.")] = "cpu",
    workers: Annotated[int, typer.Option(help="Requant worker threads (0 = one per core).")] = 0,
    chunk_alignment: Annotated[str, typer.Option(help="auto: 2MiB when its padding costs <= 1% of the sharded "
                                                      "bytes, else none; none: 16 bytes; or a size like 2MiB "
                                                      "(for the zero-copy runtime).")] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or summary.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Convert a HF safetensors checkpoint into per-rank flat chunks plus a manifest."""
    from ..prep.convert import convert
    from ..prep.requant_jobs import RequantOptions

    with cli_errors(), byte_progress("convert", not (quiet or json_out)) as progress:
        options = RequantOptions(mode=requant, scope=requant_scope, recipe=requant_recipe, scale_format=scale_format,
                                 allow_nonfinite=allow_nonfinite, device=device, workers=workers)
        summary = convert(
            src, out, ranks, targets=target or (), preset=preset, layers=layers, layer_pattern=layer_pattern,
            revision=revision, copy_mode=copy_mode, overwrite=overwrite, requant=options,
            chunk_alignment=chunk_alignment, progress=progress,
        )
    if json_out:
        print_json(summary.to_dict())
    elif not quiet:
        typer.echo(
            f"wrote {summary.out}: {len(summary.layers)} layers, {summary.target_tensors} target tensors "
            f"({human_bytes(summary.target_bytes)}) in {summary.world_size} rank files of "
            f"{human_bytes(summary.rank_file_bytes)} (chunk alignment {human_bytes(summary.chunk_alignment)}, "
            f"{human_bytes(summary.alignment_padding_bytes)} of alignment padding per rank); "
            f"{summary.replicated_tensors} replicated tensors "
            f"({human_bytes(summary.replicated_bytes)}, {len(summary.linked_files)} files linked); "
            + (f"{summary.requantized_tensors} tensors requantized; " if summary.requantized_tensors else "")
            + f"{summary.seconds:.1f} s"
        )
