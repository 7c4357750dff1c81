"""Zero-copy views of a gathered layer: a flat uint8 slot seen as the layer's named tensors.

Views are built once per (layer, slot) when the gatherer is constructed; the per-layer hot path only
returns the dict.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import RuntimeShardError
from ..manifests.dtypes import torch_dtype
from ..manifests.manifest import LayerRecord
from .storage_span import rebind


def layer_views(record: LayerRecord, slot: torch.Tensor, own_storages: bool = False,
                strides: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """name → tensor for every entry and fused view of `record`, viewing the flat uint8 `slot` (no copy).

    `slot` must hold the layer's full buffer T (at least `record.total_bytes` bytes); it is usually
    one of the gatherer's ping-pong slots. With `own_storages`, each view reaches the same bytes through
    a storage object of its own (`own_storage`). `strides`: entry name → the strides of an entry whose
    bytes are a strided tensor's storage span (storage_span.py), seen with those strides again.

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
    strides = strides or {}
    views: dict[str, torch.Tensor] = {}
    for e in record.entries:
        if e.name in strides:
            continue
        views[e.name] = _view(slot, e.name, e.dtype, e.shape, e.offset, e.nbytes)
    for v in record.views:
        views[v.name] = _view(slot, v.name, v.dtype, v.shape, v.offset, v.nbytes)
    if own_storages:
        views = {name: own_storage(t) for name, t in views.items()}
    for e in record.entries:
        if e.name in strides:
            span = slot[e.offset:e.offset + e.nbytes].view(torch_dtype(e.dtype, tensor=e.name))
            views[e.name] = rebind(own_storage(span) if own_storages else span, e.shape, strides[e.name])
    return views


def _view(slot: torch.Tensor, name: str, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> torch.Tensor:
    # Offsets are 16-byte aligned (checked when the manifest was parsed), so viewing the bytes as any
    # dtype of at most 16 bytes per element is legal without a copy.
    return slot[offset:offset + nbytes].view(torch_dtype(dtype, tensor=name)).view(shape)


def own_storage(flat: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor `flat`'s bytes, dtype and shape, through a storage object of its own (no copy).

    The gatherer gives every weight view a storage of its own, so a compiler sees each weight as
    memory of its own. `shardprep::layer_begin`/`layer_end` declare that they write the layer's
    weights (runtime/layer_ops.py); if weights were views of one shared slot storage, AOTAutograd
    would merge them into one base (which it refuses for views of another dtype than their
    storage's) or copy them before the op, and Inductor could not run the ops in place. The slot
    schedule, not the compiler, keeps the layers that share a slot apart. The result keeps `flat`
    alive.

    >>> slot = torch.arange(8, dtype=torch.uint8)
    >>> alias = own_storage(slot[2:6])
    >>> alias.tolist(), alias.data_ptr() == slot.data_ptr() + 2
    ([2, 3, 4, 5], True)
    >>> alias.untyped_storage()._cdata != slot.untyped_storage()._cdata
    True
    """
    if not flat.is_contiguous():
        raise RuntimeShardError("own_storage takes a contiguous tensor")
    if flat.numel() == 0 or flat.device.type == "meta":
        return flat
    raw = flat.reshape(-1).view(torch.uint8)
    if flat.device.type == "cuda":
        alias = torch.as_tensor(_CudaBytes(raw), device=flat.device)
    elif flat.device.type == "cpu":
        window = (ctypes.c_uint8 * raw.numel()).from_address(raw.data_ptr())
        window.keep_alive = raw  # type: ignore[attr-defined]
        alias = torch.frombuffer(window, dtype=torch.uint8)
    else:
        return flat
    return alias.view(flat.dtype).view(flat.shape)


class _CudaBytes:
    """A CUDA tensor's bytes as `__cuda_array_interface__`, which torch.as_tensor wraps in a new storage."""

    def __init__(self, flat: torch.Tensor):
        self.flat = flat  # the new tensor holds this object, so it keeps `flat` alive

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.flat.numel(),), "typestr": "|u1", "data": (self.flat.data_ptr(), False),
                "version": 3, "strides": None, "stream": None}


def placeholder(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                device: torch.device | str | None = None) -> torch.Tensor:
    """One zero element seen in `shape`: what a target parameter holds before `bind` points it at its view.

    Nothing of the shape is allocated; `device=None` takes the current device context (as a model constructor
    sees it).

    >>> p = placeholder((4096, 4096), torch.bfloat16)
    >>> tuple(p.shape), p.untyped_storage().nbytes()
    ((4096, 4096), 2)
    """
    return torch.zeros(1, dtype=dtype, device=device).expand(shape)
