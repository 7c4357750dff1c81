"""`shardprep validate OUT [--source SRC]`: exit 0 valid, 1 invalid, 2 could not run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ._errors import EXIT_INVALID, cli_errors
from ._format import human_bytes, print_json


def validate_command(
    out: Annotated[Path, typer.Argument(help="Output directory of `shardprep convert`.")],
    source: Annotated[str | None, typer.Option(help="Also rebuild every target and compare with this source "
                                                    "(a directory or a hub repo id).")] = None,
    revision: Annotated[str | None, typer.Option(help="Hub revision of --source (default: the commit the "
                                                      "manifest records).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable report.")] = False,
) -> None:
    """Check a converted directory: schema, layout invariants, file sizes, headers, padding, every checksum."""
    from ..prep.validate import validate

    with cli_errors():
        report = validate(out, source=source, revision=revision)
    if json_out:
        print_json(report.to_dict())
    else:
        for p in report.problems:
            typer.echo(f"invalid: {p.message}", err=True)
        for w in report.warnings:
            typer.echo(f"warning: {w.message}", err=True)
        if report.ok:
            c = report.checked
            verdict = "valid, with warnings" if report.warnings else "valid"
            typer.echo(f"{verdict}: {out} ({c.get('chunks', 0)} chunks, {human_bytes(c.get('bytes', 0))} checked"
                       + (f", {c.get('target_tensors_compared', 0)} targets and "
                          f"{c.get('replicated_tensors_compared', 0)} replicated tensors match the source"
                          if source else "") + ")")
    if not report.ok:
        raise typer.Exit(EXIT_INVALID)
