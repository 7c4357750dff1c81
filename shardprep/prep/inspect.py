"""`shardprep inspect`: what a converted directory holds and what it costs and buys per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import IntegrityError, ManifestError
from ..manifests.accounting import account, zero_copy_applies
from ..manifests.capacity import capacity
from ..manifests.kv_cache import kv_cache_shape
from ..manifests.layout import alignment_padding_bytes, used_bytes
from ..manifests.manifest import Manifest, load_manifest
from ..manifests.paths import resolve_inside
from ..manifests.replicated import MAX_INDEX_BYTES
from ..manifests.strict_json import is_int, read_json_file
from .source import read_config

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
    alignment = m.chunk_alignment
    aliased = zero_copy_applies(alignment)
    memory = account(m, non_target_bytes=replicated_bytes(root, m), num_slots=num_slots, aliased_own_chunk=aliased)
    config = read_config(root)
    kv = kv_cache_shape(config, kv_dtype, where=str(root / "config.json")) if config else None
    cap = capacity(memory, kv, replicated_part_bytes=memory.non_target_bytes, context_len=context_len,
                   hbm_bytes=hbm_bytes, rank_file_bytes=m.rank_file_bytes)
    return {
        "schema": SCHEMA,
        "directory": str(root),
        "format_version": m.version,
        "world_size": m.world_size,
        "chunk_alignment": m.chunk_alignment,
        "rank_file_bytes": m.rank_file_bytes,
        "alignment_padding_bytes": alignment_padding_bytes(
            m.rank_file_bytes, m.rank_header_json_bytes, [used_bytes(r.entries) for r in m.layers], m.world_size),
        "quantization": m.quantization,
        "source": m.source,
        "selection": m.selection,
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
    """Bytes of the non-target tensors of an output directory (its safetensors index's total_size; 0 without one).

    >>> replicated_bytes("out/", load_manifest("out/"))  # doctest: +SKIP
    """
    try:
        index = read_json_file(resolve_inside(directory, manifest.replicated_index, what="index"),
                               max_bytes=MAX_INDEX_BYTES, what="safetensors index")
    except IntegrityError as exc:
        if exc.code == "missing_file":
            return 0
        raise ManifestError(str(exc), code=exc.code) from None
    metadata = index.get("metadata") if isinstance(index, dict) else None
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    return total if isinstance(total, int) and is_int(total) and total >= 0 else 0
