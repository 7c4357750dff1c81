"""`shardprep reshard OUT NEW --ranks M`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..prep.output.writer import CopyMode
from ._errors import cli_errors, stop_signals_interrupt
from ._format import ChunkAlignment, byte_progress, human_bytes, not_carried_phrase, print_json, rank_files_phrase
from ._help import Debug


def reshard_command(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="An output directory of `shardprep convert` (format "
                                                            "version 2) for N ranks.")],
    new: Annotated[Path, typer.Argument(metavar="NEW", help="The directory to write for M ranks (created; must be "
                                                            "empty unless --overwrite).")],
    ranks: Annotated[int, typer.Option("--ranks", "-n", metavar="M", help="Number of ranks M to shard across.")],
    chunk_alignment: ChunkAlignment = "auto",
    copy_mode: Annotated[CopyMode, typer.Option(help="auto: hard-link the files that do not depend on N when "
                                                     "possible.")] = CopyMode.AUTO,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a previous output in NEW (atomically).")]
    = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or summary.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary "
                                                          "(schema shardprep/reshard-summary/1).")] = False,
    debug: Debug = False,
) -> None:
    """Rewrite an output directory for another number of ranks, without the source checkpoint."""
    from ..prep.reshard import reshard

    with stop_signals_interrupt(), cli_errors(), byte_progress("reshard", not (quiet or json_out)) as progress:
        summary = reshard(out, new, ranks, overwrite=overwrite, chunk_alignment=chunk_alignment, copy_mode=copy_mode,
                          progress=progress)
    if json_out:
        print_json(summary.to_dict())
    elif not quiet:
        typer.echo(
            f"wrote {summary.new}: {len(summary.layers)} layers resharded from {summary.from_world_size} to "
            f"{summary.world_size} rank files of {rank_files_phrase(summary)}; "
            f"{summary.replicated_files} other files ({human_bytes(summary.replicated_bytes)}, "
            f"{len(summary.linked_files)} linked); {summary.seconds:.1f} s" + not_carried_phrase(summary)
        )
