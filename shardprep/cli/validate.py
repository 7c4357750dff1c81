"""`shardprep validate OUT [--source SRC]` and `validate --manifest-only PATH...`: exit 0 valid, 1 invalid,
2 could not run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..prep.validate import MAX_PROBLEMS
from ._errors import EXIT_ERROR, EXIT_INVALID, cli_errors
from ._format import byte_progress, human_bytes, print_json
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
    with cli_errors(), byte_progress("validate", not json_out and not manifest_only) as progress:
        if manifest_only:
            from ..prep.validate_manifest import validate_manifest

            reports = [validate_manifest(p, source=source, revision=revision) for p in paths]
        else:
            from ..prep.validate import validate

            reports = [validate(paths[0], source=source, revision=revision, progress=progress)]
    if json_out:
        print_json(reports[0].to_dict() if len(reports) == 1 else [r.to_dict() for r in reports])
    else:
        for report in reports:
            _print(report, source, manifest_only)
    if not all(r.ok for r in reports):
        raise typer.Exit(EXIT_INVALID)


SHOWN_PROBLEMS = 20
"""Problem lines printed before the summary; `--json` lists every one (up to the report's cap)."""


def _print(report: ValidationReport, source: str | None, manifest_only: bool) -> None:
    for p in report.problems[:SHOWN_PROBLEMS]:
        typer.echo(f"invalid: {p.message}", err=True)
    for w in report.warnings:
        if report.ok or w.code != "source_not_recorded":  # an invalid report's summary names that source
            typer.echo(f"warning: {w.message}", err=True)
    if not report.ok:
        # One problem's own line says it all; more end with a line that sums them up.
        other = any(w.code == "source_not_recorded" for w in report.warnings)
        if report.problem_count > 1 or other:
            typer.echo(summary_line(report), err=True)
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


def summary_line(report: ValidationReport) -> str:
    """One line after an invalid report's problems: how many, of which kinds, and the source the manifest
    records when --source named another.

    >>> from shardprep.manifests.problems import Problem
    >>> from shardprep.prep.validate import ValidationReport
    >>> r = ValidationReport("out")
    >>> for code in ("target_bytes_differ", "target_bytes_differ", "source_tensor_missing"):
    ...     r.add(Problem(code, "..."))
    >>> summary_line(r)
    'invalid: out: 3 problems (target_bytes_differ 2, source_tensor_missing 1)'
    """
    counts = Counter(p.code for p in report.problems)
    kinds = ", ".join(f"{code} {n}" for code, n in counts.most_common())
    unseen = report.problem_count - len(report.problems)
    shown = (f"; the first {SHOWN_PROBLEMS} above, up to {MAX_PROBLEMS} in --json"
             if len(report.problems) > SHOWN_PROBLEMS else "")
    line = (f"invalid: {report.directory}: {report.problem_count} problem{'s' if report.problem_count != 1 else ''}"
            f" ({kinds}{f', and {unseen} more' if unseen else ''}){shown}")
    other = next((w.message for w in report.warnings if w.code == "source_not_recorded"), None)
    return line + (f"; {other}: was --source the wrong checkpoint?" if other else "")
