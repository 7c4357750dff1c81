"""Zero-copy views of a gathered layer: a flat uint8 slot seen as the layer's named tensors.

Views are built once per (layer, slot) when the gatherer is constructed; the per-layer hot path only
returns the dict.
"""

from __future__ import annotations

import torch

from ..errors import RuntimeShardError
from ..manifests.dtypes import torch_dtype
from ..manifests.manifest import LayerRecord


def layer_views(record: LayerRecord, slot: torch.Tensor) -> dict[str, torch.Tensor]:
    """name → tensor for every entry and fused view of `record`, viewing the flat uint8 `slot` (no copy).

    `slot` must hold the layer's full buffer T (at least `record.total_bytes` bytes); it is usually
    one of the gatherer's ping-pong slots.

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord
    >>> lay = plan_layer(0, [TensorSpec("l.0.w", "F32", (2, 2))], world_size=2)
    >>> slot = torch.arange(lay.total_bytes, dtype=torch.uint8)
    >>> v = layer_views(LayerRecord.from_layout(lay, 0), slot)
    >>> v["l.0.w"].shape, v["l.0.w"].data_ptr() == slot.data_ptr()
    (torch.Size([2, 2]), True)
    """
    if slot.dtype != torch.uint8 or slot.dim() != 1 or not slot.is_contiguous():
        raise RuntimeShardError("a gather slot must be a contiguous 1-D uint8 tensor")
    if slot.numel() < record.total_bytes:
        raise RuntimeShardError(
            f"layer {record.layer} needs {record.total_bytes} bytes but the slot has {slot.numel()}"
        )
    views: dict[str, torch.Tensor] = {}
    for e in record.entries:
        views[e.name] = _view(slot, e.name, e.dtype, e.shape, e.offset, e.nbytes)
    for v in record.views:
        views[v.name] = _view(slot, v.name, v.dtype, v.shape, v.offset, v.nbytes)
    return views


def _view(slot: torch.Tensor, name: str, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> torch.Tensor:
    # Offsets are 16-byte aligned (checked when the manifest was parsed), so viewing the bytes as any
    # dtype of at most 16 bytes per element is legal without a copy.
    return slot[offset:offset + nbytes].view(torch_dtype(dtype, tensor=name)).view(shape)
