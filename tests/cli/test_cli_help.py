"""`--help` on an 80-column terminal: every option of every command named whole, plain metavars, no line past 80
columns; `--debug` after the command works, and a root-only option there says where it goes."""

import re

import pytest
import typer
from typer.testing import CliRunner

from shardprep.cli import app

runner = CliRunner()
COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def help_at_80_columns(*command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def test_every_command_is_listed():
    assert set(COMMANDS) == {"convert", "reshard", "export", "validate", "inspect", "presets", "profile", "plan", "run"}


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_option_name_appears_whole_in_help_at_80_columns(command):
    group = typer.main.get_command(app)
    cmd = group.commands[command] if command else group  # type: ignore[attr-defined]
    text = help_at_80_columns(*([command] if command else []))
    names = [name for p in cmd.params if p.param_type_name == "option" and not p.hidden
             for name in (*p.opts, *p.secondary_opts)]
    assert names and "--help" in text
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{command} --help lacks {name} whole"
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long, too_long
    assert "…" not in text, "a name or a help text was cut"
    # Plain metavars: no Python type names (`<bool>`, `<list[Path]>`, `<int range>`) and no `{ARG}` usage.
    assert not re.search(r"<[a-z][\w\[\]| ]*>", text), re.findall(r"<[^>]*>", text)
    assert "{" not in text.splitlines()[0]


def test_help_names_no_internal_symbol():
    for command in COMMANDS:
        text = help_at_80_columns(command)
        assert "GPU_HBM_GB" not in text and "expert_parallel" not in text and "parallel_layout" not in text


def test_debug_is_accepted_after_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPREP_DEBUG", "")  # --debug sets it in this process; undone after the test
    result = runner.invoke(app, ["convert", str(tmp_path / "nope"), str(tmp_path / "out"), "-n", "2",
                                 "--preset", "llama", "--debug"])
    # --debug: the library's exception itself, not `error: ...` and exit 2
    assert result.exit_code != 0 and "No such option" not in result.output
    assert type(result.exception).__name__ == "SourceError", result.output


def test_a_root_only_option_after_the_command_says_where_it_goes(tmp_path):
    result = runner.invoke(app, ["validate", str(tmp_path), "--version"])
    assert result.exit_code == 2
    assert "--version goes before the command: shardprep --version" in result.output
