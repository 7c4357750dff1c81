"""`shardprep export OUT DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..prep.output.writer import CopyMode
from ._errors import cli_errors, stop_signals_interrupt
from ._format import byte_progress, human_bytes, not_carried_phrase, print_json
from ._help import Debug


def export_command(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="An output directory of `shardprep convert` or "
                                                            "`reshard` (format version 2).")],
    dest: Annotated[Path, typer.Argument(metavar="DIR", help="The plain HF checkpoint to write (created; must be "
                                                             "empty unless --overwrite).")],
    copy_mode: Annotated[CopyMode, typer.Option(help="auto: hard-link the files carried over from OUT when "
                                                     "possible.")] = CopyMode.AUTO,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a previous export (or output) in DIR, "
                                                                "atomically.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or summary.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary "
                                                          "(schema shardprep/export-summary/1).")] = False,
    debug: Debug = False,
) -> None:
    """Write an output directory as a plain HF checkpoint, for servers without a shardprep loader."""
    from ..prep.export import export

    with stop_signals_interrupt(), cli_errors(), byte_progress("export", not (quiet or json_out)) as progress:
        summary = export(out, dest, overwrite=overwrite, copy_mode=copy_mode, progress=progress)
    if json_out:
        print_json(summary.to_dict())
    elif not quiet:
        typer.echo(
            f"wrote {summary.dest}: {summary.target_tensors} target tensors ({human_bytes(summary.target_bytes)}) of "
            f"{len(summary.layers)} layers rebuilt from {summary.world_size} rank files into "
            f"{len(summary.target_files)} safetensors files; {summary.carried_files} other files "
            f"({human_bytes(summary.carried_bytes)}, {len(summary.linked_files)} linked); {summary.seconds:.1f} s"
            + not_carried_phrase(summary)
        )
