"""benchmarks/bench_draft_prefetch.py runs once on a GPU, so its CPU dry run must stay green here."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = {"in_target", "prefetch", "inline", "resident"}


def test_dry_run_measures_every_schedule_and_reads_the_drafts_gathered_bytes(tmp_path):
    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_draft_prefetch.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["failures"] == [] and len(data["invocations"]) == 1
    rows = data["invocations"][0]["rows"]
    assert {(r["tokens"], r["vocab"], r["schedule"]) for r in rows} == {
        (4, v, s) for v in (256, 0) for s in SCHEDULES}
    assert all(r["step_ms"] > 0 for r in rows)
    # Every schedule's draft read its first layer's gathered bytes (sampled, compared with the weights).
    assert len(data["checks"]) == 8 and all(data["checks"].values())
    assert "| 4 | 256 | prefetch |" in proc.stdout and "same-device copy standing in" in proc.stdout


def test_bad_options_are_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/bench_draft_prefetch.py", "--out", str(tmp_path / "x.json"),
                           "--tokens", "16,x"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--tokens '16,x'" in proc.stderr
    assert not (tmp_path / "x.json").exists()
