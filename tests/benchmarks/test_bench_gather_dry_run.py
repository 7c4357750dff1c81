"""benchmarks/bench_gather.py runs once on GPUs, so its CPU dry run must stay green here."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_measures_every_configuration_without_errors(tmp_path):
    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_gather.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    configs = {s["config"] for s in data["steps"] if s["ms"] is not None}
    # Every sharding choice (all layers, odd layers), with and without alignment tags; FSDP2 on all.
    assert configs == {"replicated", "shardprep-gloo", "shardprep-gloo-notags", "shardprep-gloo [odd]",
                       "shardprep-gloo-notags [odd]", "fsdp2", "fsdp2-prefetch"}
    assert data["sizes"]["sharded"] == {"all": [0, 1, 2], "odd": [1]}
    assert all(data["checks"].values()) and len(data["checks"]) == 6
    assert "| shardprep-gloo [odd] |" in proc.stdout and "Alignment tags" in proc.stdout
