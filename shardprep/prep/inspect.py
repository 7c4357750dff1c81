"""`shardprep inspect`: what a converted directory holds and what it costs per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import IntegrityError, ManifestError
from ..manifests.accounting import account
from ..manifests.manifest import load_manifest
from ..manifests.paths import resolve_inside
from ..manifests.replicated import MAX_INDEX_BYTES
from ..manifests.strict_json import is_int, read_json_file


def inspect(directory: str | Path, num_slots: int = 2) -> dict[str, Any]:
    """Per-layer sizes and per-rank memory/communication totals of an output directory.

    >>> info = inspect("out/")  # doctest: +SKIP
    >>> info["totals"]["resident_bytes"]  # doctest: +SKIP
    1234567
    """
    root = Path(directory)
    m = load_manifest(root)
    totals = account(m, non_target_bytes=_non_target_bytes(root, m.replicated_index),
                     num_slots=num_slots).to_dict()
    return {
        "directory": str(root),
        "format_version": m.version,
        "world_size": m.world_size,
        "chunk_alignment": m.chunk_alignment,
        "quantization": m.quantization,
        "source": m.source,
        "selection": m.selection,
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


def _non_target_bytes(root: Path, rel: str) -> int:
    """The index's `metadata.total_size` (0 when absent); an unreadable index is a ManifestError."""
    try:
        index = read_json_file(resolve_inside(root, rel, what="index"), max_bytes=MAX_INDEX_BYTES,
                               what="safetensors index")
    except IntegrityError as exc:
        if exc.code == "missing_file":
            return 0
        raise ManifestError(str(exc), code=exc.code) from None
    metadata = index.get("metadata") if isinstance(index, dict) else None
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    return total if isinstance(total, int) and is_int(total) and total >= 0 else 0
