"""benchmarks/bench_manifest.py on a small manifest: it writes, reads and validates through the CLI, and compares."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_manifest_times_every_phase_against_a_baseline_checkout(tmp_path):
    out = tmp_path / "bench.json"
    # The checkout itself as the baseline: the comparison's plumbing, not a speed-up, is under test.
    proc = subprocess.run([sys.executable, "benchmarks/bench_manifest.py", "--layers", "3", "--targets", "7",
                           "--fused-experts", "--runs", "2", "--repeat", "1", "--baseline", str(ROOT),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["entries"] == [21, 21] and data["fused_views_per_layer"] == 2
    for name in ("this", "baseline"):
        assert len(data["runs"][name]) == 2
        assert all(run[key] > 0 for run in data["runs"][name] for key in ("first", "later_same", "later_other"))
    assert len(data["cli_manifest_only"]) == 2 and set(data["speedup_vs_baseline"]) >= {"first", "later_same_cpu"}
    assert "| this |" in proc.stdout and "`validate --manifest-only`" in proc.stdout
