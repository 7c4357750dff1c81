"""The code's own checks: lint clean, docstring examples of the pure modules run, the layers stay apart."""

import doctest
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = ["shardprep.manifests.layout", "shardprep.manifests.manifest", "shardprep.prep.selection",
        "shardprep.manifests.accounting", "shardprep.manifests.dtypes", "shardprep.manifests.rank_file",
        "shardprep.manifests.strict_json", "shardprep.manifests.paths", "shardprep.manifests.problems",
        "shardprep.manifests.safetensors_header", "shardprep.manifests.exact_read", "shardprep.manifests.checksums",
        "shardprep.requant.lookup", "shardprep.prep.plan"]


@pytest.mark.parametrize("module", PURE)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


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
