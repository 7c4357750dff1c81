"""`shardprep inspect`: what a converted directory holds and what it costs and buys per rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..manifests.accounting import account, manifest_chunk_alignment, zero_copy_applies
from ..manifests.capacity import capacity
from ..manifests.kv_cache import kv_cache_shape
from ..manifests.manifest import Manifest, load_manifest

DEFAULT_HBM_BYTES = 141 * 10**9  # one H200
DEFAULT_CONTEXT_LEN = 8192

SCHEMA = "shardprep/inspect/1"


def inspect(directory: str | Path, num_slots: int = 2, *, kv_dtype: str = "auto",
            context_len: int = DEFAULT_CONTEXT_LEN, hbm_bytes: int | None = DEFAULT_HBM_BYTES) -> dict[str, Any]:
    """Per-layer sizes, per-rank memory/communication totals, and what the saving buys, of an output directory.

    The slot formula is the one the runtime uses for this directory: the own chunk aliased into its
    layer view where CUDA can map it (chunks aligned to 2 MiB or more), copied otherwise.

    >>> info = inspect("out/")  # doctest: +SKIP
    >>> info["totals"]["resident_bytes"]  # doctest: +SKIP
    """
    root = Path(directory)
    m = load_manifest(root)
    alignment = manifest_chunk_alignment(m)
    aliased = zero_copy_applies(alignment)
    memory = account(m, non_target_bytes=replicated_bytes(root, m), num_slots=num_slots, aliased_own_chunk=aliased)
    config_path = root / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else None
    kv = kv_cache_shape(config, kv_dtype, where=str(config_path)) if config else None
    cap = capacity(memory, kv, replicated_part_bytes=memory.non_target_bytes, context_len=context_len,
                   hbm_bytes=hbm_bytes)
    return {
        "schema": SCHEMA,
        "directory": str(root),
        "world_size": m.world_size,
        "quantization": m.quantization,
        "slot_model": ("aliased own chunk: the rank's chunk is mapped into its layer view (CUDA, chunk alignment "
                       f"{alignment} B)" if aliased else
                       f"copy: a slot holds all of T (chunk alignment {alignment} B is below the 2 MiB that mapping "
                       "the own chunk needs)"),
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
        "totals": memory.to_dict(),
        "kv_cache": kv.to_dict() if kv else None,
        "capacity": cap.to_dict(),
    }


def replicated_bytes(directory: str | Path, manifest: Manifest) -> int:
    """Bytes of the non-target tensors of an output directory (its safetensors index's total_size).

    >>> replicated_bytes("out/", load_manifest("out/"))  # doctest: +SKIP
    """
    index = Path(directory) / manifest.replicated_index
    if not index.is_file():
        return 0
    return int((json.loads(index.read_text()).get("metadata") or {}).get("total_size", 0))
