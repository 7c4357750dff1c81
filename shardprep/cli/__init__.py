"""The `shardprep` command: a thin typer shell over shardprep's Python API (one module per command)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from .._version import __version__
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
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"shardprep {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors.")] = False,
    version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    if debug:
        os.environ["SHARDPREP_DEBUG"] = "1"


app.command("convert")(convert_command)
app.command("reshard")(reshard_command)
app.command("export")(export_command)
app.command("validate")(validate_command)
app.command("inspect")(inspect_command)
app.command("presets")(presets_command)
app.command("profile")(profile_command)
app.command("plan")(plan_command)
app.command("run", context_settings={"allow_extra_args": False})(run_command)


def main() -> None:
    """Console entry point (`shardprep ...` and `python -m shardprep ...`)."""
    app()
