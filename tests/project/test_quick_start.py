"""README's quick start, run as written (minus the install): a block-FP8 checkpoint, converted with its requant."""

import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from shardprep.cli import app

REPO = Path(__file__).resolve().parents[2]


def quick_start() -> tuple[list[list[str]], str]:
    """The quick start's commands after the install, each as argv, and the requant line README says convert prints."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's quick start has no ```bash block"
    steps = [shlex.split(step) for step in block.group(1).replace("\\\n", " ").split("&&")]
    commands = [argv for argv in steps if argv[:3] != ["python3", "-m", "pip"]]
    quoted = re.search(r"`(requantized [^`]*)`", section)
    assert quoted, "README's quick start does not show the requant line convert prints"
    return commands, " ".join(quoted.group(1).split())  # the quote may wrap across lines


def run_step(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """One step in this process: the fixture script as `python3` runs it, a shardprep command through its app."""
    if argv[0] == "python3":
        monkeypatch.setattr(sys, "argv", argv[1:])
        runpy.run_path(str(REPO / argv[1]), run_name="__main__")
        return capsys.readouterr().out
    assert argv[0] == "shardprep", argv
    result = CliRunner().invoke(app, argv[1:], env={"COLUMNS": "250"})
    assert result.exit_code == 0, (argv, result.output)
    return result.output


def test_readme_quick_start_converts_a_block_fp8_checkpoint_and_says_what_it_requantized(
        tmp_path, monkeypatch, capsys):
    commands, readme_line = quick_start()
    assert [argv[:2] for argv in commands] == [["python3", "tests/support/checkpoints.py"], ["shardprep", "convert"],
                                               ["shardprep", "validate"], ["shardprep", "inspect"]]
    assert "--fp8" in commands[0]
    monkeypatch.chdir(tmp_path)  # the relative paths (examples/..., out/) land here, not in the repo
    made, converted, validated, inspected = (run_step(argv, monkeypatch, capsys) for argv in commands)

    assert "block FP8" in made
    source = tmp_path / commands[0][2]
    with safe_open(source / "model.safetensors", "pt") as f:
        names = set(f.keys())
        fp8_weights = [n for n in names if n + "_scale_inv" in names]
        blocks = sum(f.get_slice(n + "_scale_inv").get_shape()[0] * f.get_slice(n + "_scale_inv").get_shape()[1]
                     for n in fp8_weights)
    assert fp8_weights
    requant_line = next(line for line in converted.splitlines() if line.startswith("requantized "))
    assert requant_line == (f"requantized {len(fp8_weights)} block-FP8 weights ({blocks} 128×128 blocks) to UE8M0 "
                            "scales (float32 powers of two), sglang recipe")
    assert requant_line == readme_line
    assert validated.startswith("valid: out")
    assert ("quantization: block FP8 (128×128 blocks), requantized to UE8M0 scales (float32 powers of two), sglang "
            "recipe") in inspected
