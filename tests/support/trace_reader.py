"""Open a Chrome trace JSON in a real trace reader that runs offline: Chrome DevTools' trace engine.

The Performance panel's parser (npm `@paulirish/trace_engine`) runs under node (`trace_reader.mjs`);
`read_trace` returns what it placed on each thread. Where node or the package is missing, tests that
need it skip. .ci/run installs it (`npm install --prefix "$HOME/.cache/shardprep-trace-reader"
@paulirish/trace_engine@0.0.65`); SHARDPREP_TRACE_ENGINE may point at the package elsewhere.

Perfetto's own trace processor is no option offline: the `perfetto` package downloads its binary at
run time. Nor is chrome://tracing: headless Chromium (Debian's 156) does not serve it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("trace_reader.mjs")
DEFAULT_ENGINE = Path.home() / ".cache" / "shardprep-trace-reader" / "node_modules" / "@paulirish" / "trace_engine"


def engine_dir() -> Path | None:
    where = Path(os.environ.get("SHARDPREP_TRACE_ENGINE", DEFAULT_ENGINE))
    return where if (where / "analyze-trace.mjs").is_file() else None


def read_trace(path: Path) -> dict[str, Any]:
    """What DevTools' trace engine read from `path`: {processes: {pid: {threads: {tid: {name, roots,
    entries: [{name, ph, ts, dur}]}}}}, processNames: {pid: name}, warnings: {kind: count}}. Skips the
    test where node or the engine is not installed."""
    node, engine = shutil.which("node"), engine_dir()
    if node is None or engine is None:
        pytest.skip("no offline trace reader: needs node and @paulirish/trace_engine "
                    "(see tests/support/trace_reader.py)")
    proc = subprocess.run([node, str(SCRIPT), str(engine), str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"DevTools' trace engine could not read {path}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
