"""`shardprep validate OUT [--source SRC]` and `validate --manifest-only PATH...`: exit 0 valid, 1 invalid,
2 could not run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ._errors import EXIT_ERROR, EXIT_INVALID, cli_errors
from ._format import human_bytes, print_json
from ._help import Debug

if TYPE_CHECKING:
    from ..prep.validate import ValidationReport


def validate_command(
    paths: Annotated[list[Path], typer.Argument(
        metavar="PATH", help="Output directory of `shardprep convert`; with --manifest-only, manifest files "
                             "or directories holding one (several allowed).")],
    manifest_only: Annotated[bool, typer.Option(
        "--manifest-only", help="Check the manifest alone (no weight bytes): schema, its own checksum, layout, "
                                "the rank header it implies, names and paths; with --source, against the "
                                "source's headers only.")] = False,
    source: Annotated[str | None, typer.Option(
        metavar="SRC", help="Also rebuild every target and compare with this source (a directory or a hub repo id); "
                            "with --manifest-only, compare with its headers.")] = None,
    revision: Annotated[str | None, typer.Option(
        metavar="REV", help="Hub revision of --source (default: the commit the manifest records).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable report (a list of them "
                                                          "for several paths).")] = False,
    debug: Debug = False,
) -> None:
    """Check a converted directory: schema, layout invariants, file sizes, headers, padding, every checksum;
    or, with --manifest-only, manifests alone (no weight bytes)."""
    if len(paths) > 1 and not manifest_only:
        typer.echo("error: give one OUT directory (several paths are for --manifest-only)", err=True)
        raise typer.Exit(EXIT_ERROR)
    with cli_errors():
        if manifest_only:
            from ..prep.validate_manifest import validate_manifest

            reports = [validate_manifest(p, source=source, revision=revision) for p in paths]
        else:
            from ..prep.validate import validate

            reports = [validate(paths[0], source=source, revision=revision)]
    if json_out:
        print_json(reports[0].to_dict() if len(reports) == 1 else [r.to_dict() for r in reports])
    else:
        for report in reports:
            _print(report, source, manifest_only)
    if not all(r.ok for r in reports):
        raise typer.Exit(EXIT_INVALID)


def _print(report: ValidationReport, source: str | None, manifest_only: bool) -> None:
    for p in report.problems:
        typer.echo(f"invalid: {p.message}", err=True)
    for w in report.warnings:
        typer.echo(f"warning: {w.message}", err=True)
    if not report.ok:
        return
    c = report.checked
    verdict = "valid, with warnings" if report.warnings else "valid"
    if manifest_only:
        typer.echo(f"{verdict}: {report.directory} (manifest only: {c.get('layers', 0)} layers, "
                   f"{c.get('targets', 0)} targets, {c.get('rank_files', 0)} ranks"
                   + (f"; {c.get('targets_checked_against_source', 0)} targets match the source's headers"
                      if source else "") + ")")
        return
    typer.echo(f"{verdict}: {report.directory} ({c.get('chunks', 0)} chunks, {human_bytes(c.get('bytes', 0))} "
               "checked" + (f", {c.get('target_tensors_compared', 0)} targets and "
                            f"{c.get('replicated_tensors_compared', 0)} replicated tensors match the source"
                            if source else "") + ")")
