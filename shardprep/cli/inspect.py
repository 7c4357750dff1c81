"""`shardprep inspect OUT`: per-layer sizes and per-rank memory / communication."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ._errors import cli_errors
from ._format import human_bytes, print_json


def inspect_command(
    out: Annotated[Path, typer.Argument(help="Output directory of `shardprep convert`.")],
    num_slots: Annotated[int, typer.Option(help="Gather slots the runtime keeps (full layers resident).")] = 2,
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Show each layer's entries, |T| and C, and the totals per rank."""
    from ..prep.inspect import inspect

    with cli_errors():
        info = inspect(out, num_slots=num_slots)
    if json_out:
        print_json(info)
        return
    from rich.console import Console
    from rich.table import Table

    n = info["world_size"]
    table = Table(title=f"{out}  (format v{info['format_version']}, N = {n}, chunk alignment "
                        f"{human_bytes(info['chunk_alignment'])})")
    for col in ("layer", "entries", "fused views", "|T|", "C = |T|/N", "file offset"):
        table.add_column(col, justify="right")
    for r in info["layers"]:
        table.add_row(str(r["layer"]), str(r["entries"]), str(r["views"]), human_bytes(r["total_bytes"]),
                      human_bytes(r["chunk_bytes"]), str(r["file_offset"]))
    t = info["totals"]
    totals = Table(show_header=False, title="per rank")
    totals.add_column(justify="left")
    totals.add_column(justify="right")
    rows = [
        ("sharded weights R (replicated on every rank without shardprep)", t["sharded_bytes"]),
        ("local chunks R/N", t["local_chunk_bytes"]),
        (f"gather slots {t['num_slots']}·max|T|", t["slot_bytes"]),
        ("resident with sharding R/N + slots", t["resident_bytes"]),
        ("memory saved per rank", t["saved_bytes"]),
        ("AllGather bytes received per forward ((N−1)/N·Σ|T|)", t["gather_recv_bytes_per_forward"]),
        ("non-target (replicated part, unchanged)", t["non_target_bytes"]),
        ("alignment padding in each rank's file and buffer", t["alignment_padding_bytes"]),
    ]
    for label, value in rows:
        totals.add_row(label, human_bytes(value))
    console = Console()
    console.print(table)
    console.print(totals)
    if info["quantization"]:
        console.print(f"quantization: {info['quantization']}")
