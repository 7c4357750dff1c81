"""The code's own checks: lint clean, docstring examples of the pure modules run, the layers stay apart."""

import doctest
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Modules whose import needs what CI does not have (vLLM, a CUDA driver binding, Triton): their examples are skipped.
OPTIONAL = ("shardprep.integrations.", "shardprep.standalone.fp8_activation_kernel")


def package_modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "shardprep").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


@pytest.mark.parametrize("module", [m for m in package_modules() if not m.startswith(OPTIONAL)])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0


def test_most_pure_modules_have_runnable_examples():
    attempted = {m: doctest.testmod(importlib.import_module(m)).attempted for m in
                 ("shardprep.manifests.layout", "shardprep.manifests.manifest", "shardprep.manifests.dtypes",
                  "shardprep.planning.accounting", "shardprep.prep.selection", "shardprep.planning.kv_cache",
                  "shardprep.planning.capacity", "shardprep.planning.step_time",
                  "shardprep.planning.profile_format", "shardprep.planning.layer_choice")}
    assert all(attempted.values()), attempted


def test_no_skipped_example_shows_invented_output():
    # A skipped example never runs, so any output printed under it was made up: say it in prose instead.
    bad = []
    for path in sorted((ROOT / "shardprep").rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines[:-1]):
            nxt = lines[i + 1].strip()
            if "doctest: +SKIP" in line and line.lstrip().startswith((">>>", "...")) and nxt \
                    and not nxt.startswith((">>>", "...", '"""')):
                bad.append(f"{path.relative_to(ROOT)}:{i + 2}: {nxt}")
    assert not bad, "\n".join(bad)


def test_manifests_package_imports_neither_torch_nor_file_writers():
    code = ("import sys; import shardprep.manifests, shardprep.prep.selection; "
            "bad = [m for m in ('torch', 'torch.distributed', 'shardprep.loader') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cli_help_does_not_import_torch():
    code = "import sys; from shardprep.cli import app; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


@pytest.mark.skipif(shutil.which("ruff") is None and importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed")
def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "shardprep", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_mypy_is_clean():
    # The configuration (and its strictness) is in pyproject.toml's [tool.mypy].
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-5000:]
