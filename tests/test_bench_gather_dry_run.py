"""benchmarks/bench_gather.py runs once on GPUs, so its CPU dry run must stay green here."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_measures_every_configuration_without_errors(tmp_path):
    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_gather.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    configs = {s["config"] for s in data["steps"] if s["ms"] is not None}
    assert configs == {"replicated", "shardprep-gloo", "fsdp2", "fsdp2-prefetch"}
    assert all(data["checks"].values()) and len(data["checks"]) == 3
    assert "| shardprep-gloo |" in proc.stdout
