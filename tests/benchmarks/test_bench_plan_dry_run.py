"""benchmarks/bench_plan.py runs once on GPUs, so its CPU dry run must stay green here."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_profiles_plans_and_compares_three_layer_choices(tmp_path):
    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_plan.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    assert data["profile"]["schema"] == "shardprep/profile/1" and data["plan"]["verdict_line"]
    names = [c["config"] for c in data["configs"]]
    assert names[:2] == ["all", "every other (1-:2)"] and names[2].startswith("plan: ")
    assert [c["layers"] for c in data["configs"][:2]] == [[0, 1, 2, 3], [1, 3]]
    for c in data["configs"]:
        assert [p["tokens"] for p in c["points"]] == [4, 16]
        for p in c["points"]:
            assert p["measured_ms"] > 0 and p["predicted_ms"] > 0 and p["floor_ms"] > 0
            assert p["floor_ms"] == max(p["floor_terms_ms"].values())
    assert "| every other (1-:2) | 16 |" in proc.stdout and "worst |prediction error|" in proc.stdout
