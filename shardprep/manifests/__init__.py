"""The format, pure: dtypes, layout math, the rank file's header, manifest dataclasses + JSON schema +
invariants, and the strict readers every loader shares (exact reads, checksums, safe paths,
hostile JSON, safetensors headers, the replicated part).

No torch at import (`dtypes.torch_dtype` imports it when called) and nothing that writes files.
"""

from .layout import (
    ENTRY_ALIGNMENT,
    FILE_ALIGNMENT,
    NO_CHUNK_ALIGNMENT,
    Entry,
    FusedGroup,
    FusedView,
    LayerLayout,
    TensorSpec,
    align_up,
    chunk_range,
    file_alignment_for,
    plan_file_offsets,
    plan_layer,
)
from .manifest import (
    MANIFEST_NAME,
    REPLICATED_INDEX,
    FileRecord,
    LayerRecord,
    Manifest,
    check_invariants,
    load_manifest,
)
from .rank_file import plan_rank_file, rank_file_header, rank_file_name

__all__ = [
    "ENTRY_ALIGNMENT", "FILE_ALIGNMENT", "MANIFEST_NAME", "NO_CHUNK_ALIGNMENT", "REPLICATED_INDEX",
    "Entry", "FileRecord", "FusedGroup", "FusedView", "LayerLayout", "LayerRecord", "Manifest",
    "TensorSpec", "align_up", "check_invariants", "chunk_range", "file_alignment_for", "load_manifest",
    "plan_file_offsets", "plan_layer", "plan_rank_file", "rank_file_header", "rank_file_name",
]
