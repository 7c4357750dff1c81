"""What a user meets at the command line: version, help, presets, dry runs, schema-tagged JSON, run's checks."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from shardprep import __version__
from shardprep.cli import app

runner = CliRunner()


def invoke(*args):
    # A wide terminal, so that rich's help table does not wrap a choice list across lines.
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})


def test_version_and_short_help():
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"shardprep {__version__}"
    result = invoke("convert", "-h")
    assert result.exit_code == 0 and "--ranks" in result.output


def test_help_lists_choices_and_metavars_instead_of_python_types():
    text = invoke("convert", "--help").output
    for choice in ("auto|ue8m0|none", "sglang|fp32", "f32|e8m0", "auto|link|copy", "GLOB", "SRC", "OUT"):
        assert choice in text, choice
    assert "list[str]" not in text and "{src}" not in text
    run_help = invoke("run", "--help").output
    assert "ce|nccl|nccl-symm|gloo" in run_help and "--nproc-per-node" in run_help


def test_presets_lists_every_builtin_with_its_globs():
    from shardprep.prep.selection import builtin_presets

    result = invoke("presets", "--json")
    doc = json.loads(result.output)
    assert doc["schema"] == "shardprep/presets/1"
    assert [p["name"] for p in doc["presets"]] == builtin_presets()
    assert all(p["targets"] and p["description"] for p in doc["presets"])
    text = invoke("presets").output
    assert "*.layers.*.self_attn.q_proj.weight" in text and "fused self_attn.qkv_proj.weight" in text


def test_a_preset_that_matches_nothing_says_so_and_suggests_target(checkpoint_cache, tmp_path):
    result = invoke("convert", checkpoint_cache("bert"), tmp_path / "out", "-n", 2, "--preset", "llama",
                    "--allow-preset-mismatch")  # without it: refused as a preset for other model types
    assert result.exit_code == 2
    assert "preset 'llama' matches no tensor in this checkpoint" in result.stderr and "--target" in result.stderr
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_selection_and_sizes_and_writes_nothing(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    text = invoke("convert", checkpoint_cache("llama"), out, "-n", 2, "--preset", "llama", "--dry-run")
    assert text.exit_code == 0, text.output
    assert "model.layers.1.self_attn.q_proj.weight" in text.output and "nothing written" in text.output
    doc = json.loads(invoke("convert", checkpoint_cache("llama"), out, "-n", 2, "--preset", "llama", "--dry-run",
                            "--json").output)
    assert doc["schema"] == "shardprep/convert-summary/1" and doc["dry_run"] is True
    assert doc["plan"]["layers"]["1"] and doc["plan"]["memory"]["world_size"] == 2
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_every_json_output_carries_a_schema_tag(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    summary = json.loads(invoke("convert", checkpoint_cache("llama"), out, "-n", 2, "--preset", "llama",
                                "--json").output)
    assert summary["schema"] == "shardprep/convert-summary/1"
    assert json.loads(invoke("inspect", out, "--json").output)["schema"] == "shardprep/inspect/1"


def test_run_backend_choices_match_the_runtime_backends():
    from shardprep.cli.run import Backend
    from shardprep.runtime.backends import BACKENDS
    from shardprep.standalone.runner import BACKEND_CHOICES

    assert {b.value for b in Backend} == set(BACKEND_CHOICES) == {"auto", *BACKENDS}


@pytest.mark.parametrize("args, fragment", [
    (["--device", "cpu", "--backend", "ce"], "--backend ce needs"),
    (["--device", "cuda"], "needs CUDA"),
    (["--backend", "nccl"], "needs CUDA"),
])
def test_run_refuses_a_gpu_backend_on_the_cpu_before_starting_ranks(checkpoint_cache, tmp_path, args, fragment):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out"
    assert invoke("convert", checkpoint_cache("llama"), out, "-n", 2, "--preset", "llama", "-q").exit_code == 0
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "shardprep", "run", str(out), *args], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
