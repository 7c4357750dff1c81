"""How every command's `--help` reads: click's plain two-column layout, written here from each option's own
names, metavar and help, so that it fits 80 columns with every option name whole and reads the same under
every typer release the package admits (typer's rich panels cut long names to `--requant-reci…`, and typer
0.29 writes Python types as metavars: `<bool>`, `<list[Path]>`)."""

from __future__ import annotations

import os
from enum import Enum
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

ROOT_ONLY = {"--version": "shardprep --version", "-V": "shardprep --version",
             "--install-completion": "shardprep --install-completion",
             "--show-completion": "shardprep --show-completion"}
"""The root's options that a command does not take, with where they go (`--debug` every command takes)."""


def set_debug(value: bool) -> bool:
    """`--debug`, before or after the command: full tracebacks instead of one-line errors."""
    if value:
        os.environ["SHARDPREP_DEBUG"] = "1"
    return value


Debug = Annotated[bool, typer.Option("--debug", callback=set_debug, is_eager=True,
                                     help="Show full tracebacks instead of one-line errors.")]
"""Every command's `--debug` (also accepted before the command): the option a user adds after a failure, at
the end of the line they just ran."""


def _metavar(param: Any) -> str:
    """An option's value as the help shows it: its metavar, else a choice's values `a|b|c`, else its name."""
    if param.metavar:
        return str(param.metavar)
    # click's Choice (typer < 0.24) or typer's own type descriptor (typer >= 0.24, which vendors click)
    choices = getattr(getattr(param, "type", None), "choices", None) or getattr(
        getattr(param, "type_descriptor", None), "choices", None)
    if choices:
        return "|".join(c.value if isinstance(c, Enum) else str(c) for c in choices)
    return str(param.name).upper()


def _default_text(param: Any) -> str | None:
    default = param.default
    if isinstance(default, Enum):  # a choice's, or click 8.3's UNSET sentinel (an Enum member whose value is object())
        default = default.value
    # A value, not a flag's False, an empty list, None, or that sentinel.
    if param.is_flag or isinstance(default, bool) or not isinstance(default, (str, int, float)):
        return None
    return str(default)


def help_record(param: Any) -> tuple[str, str]:
    """(names and metavar, help) of one option or argument, as the help's two columns print it.

    >>> import click
    >>> help_record(click.Option(["--ranks", "-n"], metavar="N", help="Ranks.", required=True))
    ('--ranks, -n N', 'Ranks. [required]')
    """
    if param.param_type_name == "argument":
        names = _metavar(param) + ("..." if param.nargs != 1 else "")
    else:
        names = ", ".join([*param.opts, *param.secondary_opts])
        if not param.is_flag:
            names += " " + _metavar(param)
    extra = []
    default = _default_text(param) if param.param_type_name == "option" else None
    if default is not None:
        extra.append(f"default: {default}")
    if param.required:
        extra.append("required")
    text = (param.help or "") + (f" [{'; '.join(extra)}]" if extra else "")
    return names, text.strip()


class PlainHelpCommand(TyperCommand):
    """A typer command whose help is click's plain layout over `help_record`, and that names where a root-only
    option goes when it is given after the command."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name, _ = help_record(param)
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments: list[tuple[str, str]] = []
        options: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            if getattr(param, "hidden", False):
                continue
            (arguments if param.param_type_name == "argument" else options).append(help_record(param))
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except Exception as exc:  # click's NoSuchOption: typer >= 0.24 vendors click, so no class to name here
            where = ROOT_ONLY.get(getattr(exc, "option_name", None) or "")
            if where is not None and hasattr(exc, "message"):
                exc.message = f"{exc.option_name} goes before the command: {where}"  # type: ignore[attr-defined]
                exc.possibilities = None  # type: ignore[attr-defined]  # click's "(Possible options: ...)"
            raise


class PlainHelpGroup(TyperGroup):
    """The root `shardprep` group, with the same help layout as its commands."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        rows = [help_record(p) for p in self.get_params(ctx) if not getattr(p, "hidden", False)]
        with formatter.section("Options"):
            formatter.write_dl(rows)
        self.format_commands(ctx, formatter)
