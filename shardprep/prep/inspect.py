"""`shardprep inspect`: what a converted directory holds and what it costs per rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..manifests.accounting import account
from ..manifests.manifest import load_manifest

SCHEMA = "shardprep/inspect/1"


def inspect(directory: str | Path, num_slots: int = 2) -> dict[str, Any]:
    """Per-layer sizes and per-rank memory/communication totals of an output directory.

    >>> info = inspect("out/")  # doctest: +SKIP
    >>> info["totals"]["resident_bytes"]  # doctest: +SKIP
    """
    root = Path(directory)
    m = load_manifest(root)
    non_target = 0
    index = root / m.replicated_index
    if index.is_file():
        non_target = int((json.loads(index.read_text()).get("metadata") or {}).get("total_size", 0))
    totals = account(m, non_target_bytes=non_target, num_slots=num_slots).to_dict()
    return {
        "schema": SCHEMA,
        "directory": str(root),
        "world_size": m.world_size,
        "quantization": m.quantization,
        "layers": [
            {
                "layer": r.layer,
                "entries": len(r.entries),
                "views": len(r.views),
                "total_bytes": r.total_bytes,
                "chunk_bytes": r.chunk_bytes,
                "file_offset": r.file_offset,
            }
            for r in m.layers
        ],
        "totals": totals,
    }
