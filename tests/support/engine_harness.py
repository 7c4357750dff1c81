"""What the vLLM and SGLang engine runners (vllm_engines/engine_runs.py, sglang_engines/sglang_runs.py) share, in
the test's process: declaring a test plugin to a server, copying the engines' timing lines for CI, and running one
script per DP rank (the in-process build-and-load tests: k3_loading.py, draft_loading.py).

Imported by the runners' `run_engines` only (the test's process, where tests/ is on sys.path), never by the
runner scripts' engine processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def declare_plugin(directory: Path, group: str, name: str, entry: str) -> None:
    """Make `directory` (on PYTHONPATH) declare `entry` ("module:function") in the entry-point `group` a server
    loads its plugins from (`vllm.general_plugins`, `sglang.srt.plugins`)."""
    meta = directory / f"{name}-0.dist-info"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    (meta / "entry_points.txt").write_text(f"[{group}]\n{name} = {entry}\n")


def record_engine_times(output: str, workdir: Path) -> None:
    """Append the run's ENGINE-TIME lines to the file ENGINE_TIMES names (CI sets it), tagged with the test's
    working directory, so a slow stage can be split into engine start-up and generation."""
    target = os.environ.get("ENGINE_TIMES")
    if target:
        with open(target, "a") as f:
            # DP ranks print at once, so two lines can share one line of the log: find each by its shape.
            f.writelines(f"{workdir.name}: {hit}\n" for hit in re.findall(r"ENGINE-TIME .*? generate [\d.]+ s", output))


def run_per_rank(script: Path, plans: list[dict[str, Any]], root: Path, env: dict[str, str],
                 timeout: float = 1500) -> list[dict[str, Any]]:
    """Run `script PLAN.json RESULTS.json` once per DP rank, all at once (they meet in a process group), each with its
    plan; every rank's results, or an assertion error showing the end of the failed rank's log (rankR.log in `root`).

    A rank that fails stops the others within seconds: its peers would otherwise wait in a collective until
    `timeout`.
    """
    from support.spawn_group import exit_description

    procs = []
    for rank, plan in enumerate(plans):
        (root / f"plan{rank}.json").write_text(json.dumps(plan))
        with open(root / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(script), str(root / f"plan{rank}.json"),
                                           str(root / f"results{rank}.json")], stdout=log, stderr=subprocess.STDOUT,
                                          env=env))
    deadline = time.monotonic() + timeout
    failed = None
    while failed is None and any(p.poll() is None for p in procs):
        failed = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
        if time.monotonic() > deadline:
            failed = -1
        time.sleep(0.5)
    failed = failed if failed is not None else next((r for r, p in enumerate(procs) if p.returncode != 0), None)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if failed == -1:
        raise AssertionError(f"the ranks did not finish within {timeout} s (logs: {root}/rank*.log)")
    if failed is not None:
        text = (root / f"rank{failed}.log").read_text()
        raise AssertionError(f"rank {failed} failed ({exit_description(procs[failed].returncode)}):\n{text[-6000:]}")
    results = []
    for rank in range(len(procs)):
        text = (root / f"rank{rank}.log").read_text()
        assert (root / f"results{rank}.json").exists(), text[-6000:]
        results.append(json.loads((root / f"results{rank}.json").read_text()))
    return results
