"""The format, pure: dtypes, layout math, manifest dataclasses + JSON schema + invariants, accounting.

No torch at import (`dtypes.torch_dtype` imports it when called) and nothing that writes files.
"""

from .accounting import MemoryAccount, account
from .layout import (
    ENTRY_ALIGNMENT,
    FILE_ALIGNMENT,
    Entry,
    FusedGroup,
    FusedView,
    LayerLayout,
    TensorSpec,
    align_up,
    chunk_range,
    plan_file_offsets,
    plan_layer,
)
from .manifest import (
    MANIFEST_NAME,
    REPLICATED_INDEX,
    LayerRecord,
    Manifest,
    check_invariants,
    load_manifest,
    rank_file_name,
)

__all__ = [
    "ENTRY_ALIGNMENT", "FILE_ALIGNMENT", "MANIFEST_NAME", "REPLICATED_INDEX",
    "Entry", "FusedGroup", "FusedView", "LayerLayout", "LayerRecord", "Manifest", "MemoryAccount", "TensorSpec",
    "account", "align_up", "check_invariants", "chunk_range", "load_manifest", "plan_file_offsets", "plan_layer",
    "rank_file_name",
]
