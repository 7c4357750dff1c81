"""The `shardprep` command: a thin typer shell over shardprep's Python API (one module per command)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from .._version import __version__
from ._help import PlainHelpCommand, PlainHelpGroup
from .convert import convert_command
from .export import export_command
from .inspect import inspect_command
from .plan import plan_command
from .presets import presets_command
from .profile import profile_command
from .reshard import reshard_command
from .run import run_command
from .validate import validate_command

app = typer.Typer(
    name="shardprep",
    help="Pre-shard replicated LLM weights into per-rank flat chunks and gather them back layer by layer.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=PlainHelpGroup,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"shardprep {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors (also "
                                                     "accepted after the command).")] = False,
    version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    if debug:
        os.environ["SHARDPREP_DEBUG"] = "1"


# One short line each for `shardprep --help` (click cuts a docstring's first sentence to fit 80 columns).
_COMMANDS = (
    ("convert", convert_command, "HF checkpoint -> per-rank chunk files + manifest."),
    ("reshard", reshard_command, "An output for N ranks rewritten for M ranks."),
    ("export", export_command, "An output written back as a plain HF checkpoint."),
    ("validate", validate_command, "Check every byte of an output (or a manifest)."),
    ("inspect", inspect_command, "Per-layer sizes and per-rank memory of an output."),
    ("presets", presets_command, "The shipped presets and where each was checked."),
    ("profile", profile_command, "Measure compute and gathers on the GPUs (torch)."),
    ("plan", plan_command, "Which layers to shard, and does it pay."),
    ("run", run_command, "Generate from an output on N local ranks (torch)."),
)
for _name, _function, _short in _COMMANDS:
    app.command(_name, cls=PlainHelpCommand, short_help=_short)(_function)

def main() -> None:
    """Console entry point (`shardprep ...` and `python -m shardprep ...`)."""
    app()
