"""What the vLLM and SGLang engine runners (vllm_engines/engine_runs.py, sglang_engines/sglang_runs.py) share, in
the test's process: declaring a test plugin to a server, and copying the engines' timing lines for CI.

Imported by the runners' `run_engines` only (the test's process, where tests/ is on sys.path), never by the
runner scripts' engine processes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


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
