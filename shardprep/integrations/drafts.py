"""Drafts in sharded mode: the draft model's sharded layers gathered by the target's gatherer, after the target's.

Where a draft lives, floor by floor (each file says the rest):
- manifests/draft_layers.py: the manifest's draft record (which layers are a draft's, of which kind), pure;
- planning/accounting.py `draft_account`: what sharding the draft adds, per rank;
- runtime/binding.py: the schedule a bound draft layer follows (`bind_draft`; the first pass of a step waits for
  its gather, later passes read the slot as it is, the next target forward releases it);
- here: loading a draft model in a server's sharded mode, and its startup line;
- processed_layers.py `process_draft_layers`: a quantized target's draft processed at load like the target.

A server builds the draft model after the target is loaded, with a loader of its own that sees nothing of the
target's load but the server's deployment objects (vLLM's speculative config, shared by the target's and the
draft's `VllmConfig`s). So the target's `ShardedLoad`, when the server runs a draft, is handed over under that object
(`hand_to_draft`), and the draft's load takes it from there (`target_for`): no path keys it, so two engines of one
directory in one process never see each other's.

The draft's layers are gathered in the target's group and slots: the target's last layer's wait dispatches the
draft's first gather (it hides behind that layer), and every rank issues them in the same order, per target forward.

A draft model from its own checkpoint (DFlash, EAGLE-3: `DraftLayers.is_model`, converted for the same N) has rank
files of its own: each rank's chunks of the draft follow its chunks of the target in one buffer (`joined_shards`;
the draft's layers renumbered after the target's, their names unchanged), and the target's binding moves onto a
gatherer over both (`Binding.rehome`, `join_draft_model`). Beside a target processed at load (block FP8), the
target's chunks in that buffer are its processed ones, and the draft's (unquantized: a quantized draft model is
refused) follow them as converted; the target's strided views keep their strides. A server copying a draft's
weights at load (DFlash's fused K/V projection of every layer, used before the draft's first layer runs) copies the
gathered weights (`ServerAdapter.copy_draft_weights_at_load`), so the draft computes what full mode computes.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ShardprepError
from ..loader.rank_shards import RankShards, open_rank
from ..manifests.draft_layers import DraftLayers, target_mismatch
from ..manifests.layout import align_up
from ..manifests.manifest import Manifest
from ..manifests.strict_json import read_json_file
from ..planning.accounting import account, draft_account
from ..runtime.binding import Binding, BoundLayer, bind_draft, draft_layers
from ..runtime.gatherer import LayerGatherer
from ..runtime.views import layer_views
from .load_options import ShardprepLoadOptions
from .processed_layers import PlaceholderGatherer, ProcessedLayers, gather_in_place, process_draft_layers
from .server import Built, ServerAdapter
from .sharded_load import (
    ShardedLoad,
    bound_later,
    check_built_were_bound,
    keep_bound_modules_plain,
    layer_name_parts,
    load_replicated,
    serving_manifest,
)

_targets: dict[int, ShardedLoad] = {}
"""The target loads handed to their drafts, by the id of the server's deployment object, while it lives."""
_held: dict[int, object] = {}
"""Deployment objects that cannot be weakly referenced, held so that their id stays theirs while `_targets` is keyed
by it (one per process and server: the entry lives as long as the process)."""


def hand_to_draft(deployment: object, target: ShardedLoad) -> None:
    """Leave `target` (loaded) for the draft model's load in this process, under the server's `deployment` object."""
    key = id(deployment)
    _targets[key] = target
    try:
        weakref.finalize(deployment, _targets.pop, key, None)
    except TypeError:  # no weak references to it (SGLang's ServerArgs, a msgspec Struct): held instead
        _held[key] = deployment


def target_for(deployment: object) -> ShardedLoad | None:
    """The target load `hand_to_draft` left under `deployment`, if any."""
    return _targets.get(id(deployment))


class DraftLoad:
    """One rank's sharded-mode load of a draft model, after its target's (`ShardedLoad` with a deployment).

    The draft's layers in the target's manifest (an MTP layer, `manifest.draft`), or those of the draft's own
    output (a draft model: DIR is the draft's directory), are bound to the draft model's modules
    (`adapter.draft_layer_modules`) and gathered after the target's layers; everything else of the draft comes
    from the replicated part. A manifest that shards no draft layer has the draft loaded whole.

    >>> load = DraftLoad(adapter, "out/", options, vllm_config.speculative_config)  # doctest: +SKIP
    >>> draft = load.build(lambda: build_the_draft())  # doctest: +SKIP
    >>> load.load(draft)  # doctest: +SKIP
    """

    def __init__(self, adapter: ServerAdapter, directory: str | Path, options: ShardprepLoadOptions,
                 deployment: object):
        self.adapter, self.directory, self.options = adapter, directory, options
        self.manifest = serving_manifest(directory)
        self.target = target_for(deployment)
        self.built: Built = []
        self.binding: Binding | None = None
        """The target's binding, now also the draft's (None: the draft was loaded whole)."""
        self.processed: ProcessedLayers | None = None
        self._targets = bound_later(self.manifest, draft=True)

    def build(self, construct: Callable[[], nn.Module]) -> nn.Module:
        """The draft model `construct()` builds, its sharded layers' weights built without storage."""
        with self.adapter.targets_without_storage(self._is_target) as made:
            model = construct()
        self.built = made
        return model

    def load(self, model: nn.Module) -> Binding | None:
        """Bind the draft's layers to the target's gatherer and load the rest; log the draft's startup line.

        Collective over the shard group when the target was processed at load.
        """
        adapter, directory, manifest = self.adapter, self.directory, self.manifest
        draft = manifest.draft
        if draft is None:
            load_replicated(adapter, model, directory, manifest, self.options.verify, bound=set())
            check_built_were_bound(self.built, model, (), directory, "a draft target")
            return None
        target = self.target
        if target is None or target.binding is None or target.shards is None:
            raise ShardprepError(f"{directory}: the draft model was loaded before the target, or the target was not "
                                 "served sharded with its draft; shard_weights loads the target first")
        if draft.is_model:
            return self._load_draft_model(model, target)
        found = adapter.draft_layer_modules(model, draft.layers)
        model_name = adapter.model_name(model)
        if target.processed is None:
            bound = bind_draft(target.binding, found, model_name)
        else:  # bound to placeholders, for processing to read them (processed_layers.process_draft_layers)
            placeholders = PlaceholderGatherer(target.shards)
            bound = draft_layers(target.shards.manifest, placeholders.layers, found, model_name)
            for layer in bound:
                layer.point(placeholders.views(layer.index))
        ids = {id(param) for layer in bound for param, _ in layer.params}
        if target.processed is None and any(adapter.is_quantized(m) for m in model.modules()
                                            if any(id(p) in ids for p in m.parameters(recurse=False))):
            raise ShardprepError(f"{directory}: the draft's layer {draft.layers[0]} is quantized but the target's "
                                 "layers are not; a sharded draft is processed with a processed target only; serve "
                                 "it in full mode")
        keep_bound_modules_plain(adapter, model, ids, str(directory))
        load_replicated(adapter, model, directory, manifest, self.options.verify, ids)
        if target.processed is None:
            self.binding = target.binding
        else:
            self.processed = process_draft_layers(target.processed, target.shards, target.group, bound,
                                                  adapter.is_quantized, adapter.process_quantized)
            self.binding = self.processed.binding
        check_built_were_bound(self.built, model, self.binding.draft_parameters.values(), directory,
                               "a draft target")
        adapter.logger().info(draft_startup_line(self.binding, directory, self.processed, adapter.spelling.server))
        return self.binding


    def _load_draft_model(self, model: nn.Module, target: ShardedLoad) -> Binding:
        """A draft model converted from its own checkpoint, bound into the target's gatherer over a joined buffer."""
        adapter, directory, manifest = self.adapter, self.directory, self.manifest
        draft = manifest.draft
        assert draft is not None and target.binding is not None and target.shards is not None
        n, target_n = manifest.world_size, target.manifest.world_size
        if n != target_n:
            raise ShardprepError(f"{directory}: the draft was converted for {n} ranks and its target "
                                 f"{target.directory} for {target_n}; convert the draft with --ranks {target_n} (or "
                                 f"`shardprep reshard {directory} NEW --ranks {target_n}`)")
        problem = target_mismatch(draft, _config(target.directory))
        if problem is not None:
            raise ShardprepError(f"{directory}: {problem}; serve it beside the target it was trained for")
        targets = {name: p for name, p in model.named_parameters() if self._is_target(name)}
        adapter.refuse_unshardable(model, targets, str(directory))
        found = adapter.draft_layer_modules(model, draft.layers)
        binding = target.binding
        served = binding.shards.manifest.without_draft()
        own = open_rank(directory, binding.shards.rank, world_size=n, device=binding.shards.device,
                        verify=self.options.verify, manifest=manifest)
        offset = join_draft_model(binding, own, target.processed)
        joined = binding.shards
        if target.processed is None:
            target.shards = joined  # the target's first buffer goes with its gatherer
        renamed = renumbered_names(manifest, offset)
        bound = bind_draft(binding, {layer + offset: found[layer] for layer in draft.layers}, renamed)
        ids = {id(param) for layer in bound for param, _ in layer.params}
        refuse_quantized_draft_model(adapter, model, ids, directory, draft, target.processed is not None)
        keep_bound_modules_plain(adapter, model, ids, str(directory))
        load_replicated(adapter, model, directory, manifest, self.options.verify, ids)
        check_built_were_bound(self.built, model, binding.draft_parameters.values(), directory, "a draft target")
        with whole_layers(bound, joined, binding.gatherer):
            adapter.copy_draft_weights_at_load(model)
        self.binding = binding
        adapter.logger().info(model_draft_startup_line(binding, directory, manifest, served, target.processed,
                                                       adapter.spelling.server))
        return binding

    def _is_target(self, name: str) -> bool:
        """Whether a draft model's parameter (by the model's name) is one of the draft's sharded layers."""
        name = self.adapter.manifest_name(name)
        if self.manifest.draft is not None and self.manifest.draft.is_model:
            name = self.adapter.draft_manifest_name(name)
        return self._targets(name)


def _config(directory: str | Path) -> dict[str, Any] | None:
    config = read_json_file(Path(directory) / "config.json", max_bytes=16 << 20, what="config.json",
                            allow_duplicate_keys=True)
    return config if isinstance(config, dict) else None


def refuse_quantized_draft_model(adapter: ServerAdapter, model: nn.Module, bound: set[int], directory: str | Path,
                                 draft: DraftLayers, beside_processed: bool) -> None:
    """Refuse a draft model (DFlash, EAGLE-3) whose sharded layers the server quantized: they are gathered as
    converted, unprocessed, which a quantized module's processed kernel would not read; whatever the target.
    `bound`: the ids of the draft's bound parameters; `beside_processed`: whether the target was processed at load.

    >>> refuse_quantized_draft_model(adapter, draft_model, ids, "draft-out/", manifest.draft, True)  # doctest: +SKIP
    """
    beside = "a target processed at load" if beside_processed else "an unquantized target"
    for name, module in model.named_modules():
        if adapter.is_quantized(module) and any(id(p) in bound for p in module.parameters(recurse=False)):
            raise ShardprepError(
                f"{directory}: {draft.describe()} is quantized ({name}) and sharded beside {beside}, which is not "
                "supported (a draft model is sharded unquantized only); serve the draft apart (draft_load_config "
                "with the server's own load format) or convert an unquantized draft")


def joined_shards(target: RankShards, draft: RankShards, offset: int) -> RankShards:
    """One rank's chunks of a target and of its draft model in one buffer: the target's bytes as they are, then each
    of the draft's layers, renumbered `offset + i`, at the next aligned place (names unchanged). Holds the target's
    chunks twice until the caller lets the old buffer go.

    >>> joined = joined_shards(binding.shards, open_rank("draft/", rank), offset=4)  # doctest: +SKIP
    """
    old = target.manifest
    records, at = list(old.layers), old.rank_file_bytes
    for r in draft.manifest.layers:
        at = align_up(at, old.file_alignment)
        records.append(dataclasses.replace(r, layer=r.layer + offset, file_offset=at))
        at += r.chunk_bytes
    facts = draft.manifest.draft
    assert facts is not None
    manifest = dataclasses.replace(old, layers=tuple(records), draft=dataclasses.replace(
        facts, layers=tuple(i + offset for i in facts.layers)))
    buffer = torch.zeros(manifest.rank_file_bytes, dtype=torch.uint8, device=target.device)
    buffer[:old.rank_file_bytes].copy_(target.buffer)
    for r, moved in zip(draft.manifest.layers, records[len(old.layers):]):
        draft.read_chunk(r.layer, into=buffer[moved.file_offset:moved.file_offset + r.chunk_bytes])
    return RankShards(manifest, target.rank, buffer)


def join_draft_model(binding: Binding, draft: RankShards, processed: ProcessedLayers | None = None) -> int:
    """Move `binding` (the target's) onto one buffer holding its chunks, then `draft`'s (a draft model's own rank
    file), and a gatherer over both; returns the offset added to the draft's layer numbers. With the target
    processed at load (`processed`), its chunks are the processed ones (R'/N, as its kernels read them) and the
    draft's follow them as converted; the target's strided tensors (packed scales) keep their strides. Bind the
    draft's layers afterwards (`bind_draft`, by `renumbered_names`).

    >>> offset = join_draft_model(target.binding, open_rank("draft-out/", rank), target.processed)  # doctest: +SKIP
    """
    strides = None if processed is None else processed.strides
    # The gatherer keys strides by tensor name, and the draft's names are its own checkpoint's, kept as they are.
    clash = sorted({e.name for r in draft.manifest.layers for e in r.entries} & set(strides or ()))
    if clash:
        raise ShardprepError(f"{clash[0]}: a tensor of the draft model and a strided tensor of the processed target "
                             "have this one name, so the draft's would be seen with the target's strides; serve "
                             "the draft apart (draft_load_config with the server's own load format)")
    offset = max(binding.gatherer.layers) + 1
    joined = joined_shards(binding.shards, draft, offset)
    binding.rehome(joined, LayerGatherer(joined, group=binding.gatherer.group, backend="auto", strides=strides))
    return offset


def renumbered_names(manifest: Manifest, offset: int) -> Callable[[str], str]:
    """A draft manifest's tensor name → the same name with its layer numbered `offset` more (`layers.0.x` →
    `layers.4.x`; an unnumbered `midlayer.x` → `midlayer.4.x`): what `bind` splits a joined draft layer's names by.

    >>> from shardprep.manifests import Manifest
    >>> m = Manifest(1, ("r",), (), version=1, selection={"unnumbered_layers": {"midlayer": 0}})
    >>> renumbered_names(m, 4)("midlayer.self_attn.o_proj.weight")
    'midlayer.4.self_attn.o_proj.weight'
    """
    layer_of = {name: r.layer for r in manifest.layers for name in [*(e.name for e in r.entries),
                                                                    *(v.name for v in r.views)]}

    def renamed(name: str) -> str:
        layer = layer_of[name]
        outer, inner = layer_name_parts(manifest, name, layer)
        outer = outer[:-len(f".{layer}")] if outer.endswith(f".{layer}") else outer
        return f"{outer}.{layer + offset}.{inner}"

    return renamed


@contextmanager
def whole_layers(layers: list[BoundLayer], shards: RankShards, gatherer: LayerGatherer) -> Iterator[None]:
    """Inside this block each of `layers` has its full weights, gathered once into memory of its own (all of them
    at once: the draft's whole R, at load only); after it, their parameters point at `gatherer`'s views again.
    Collective over the shard group."""
    held = []
    for layer in layers:
        record = shards.manifest.layer(layer.index)
        full = torch.empty(shards.world_size * record.chunk_bytes, dtype=torch.uint8, device=shards.device)
        mine = full[shards.rank * record.chunk_bytes:(shards.rank + 1) * record.chunk_bytes]
        mine.copy_(shards.chunk(layer.index))
        gather_in_place(full, mine, shards.rank, shards.world_size, gatherer.group)
        layer.point(layer_views(record, full))
        held.append(full)
    try:
        yield
    finally:
        for layer in layers:
            layer.point(gatherer.views(layer.index))
        del held


def draft_startup_line(binding: Binding, directory: str | Path, processed: ProcessedLayers | None = None,
                       server: str = "the server") -> str:
    """The line each rank logs once its draft is bound: which layers, where their gather hides, and the draft's
    resident and saved bytes apart from the target's; with the draft processed at load (`processed`), those are
    the processed bytes, and the line says how many modules were processed.

    >>> log.info(draft_startup_line(binding, "out/", server="vLLM"))  # doctest: +SKIP
    """
    manifest, gatherer = binding.shards.manifest, binding.gatherer
    draft = draft_account(manifest, gatherer.num_slots)
    assert draft is not None and manifest.draft is not None
    layers = ", ".join(map(str, manifest.draft.layers))
    group_ranks = torch.distributed.get_process_group_ranks(gatherer.group)
    return (f"shardprep: DP rank {group_ranks[binding.shards.rank]} binds the {manifest.draft.kind.upper()} draft of "
            f"{directory}: layer {layers} gathered after the target's layers (dispatched before the target's last "
            "layer computes), into the target's slots, held through the draft's passes of a step; resident draft bytes "
            f"{draft['resident_bytes']}, saved {draft['saved_bytes']} against {draft['sharded_bytes']} for its full "
            "weights"
            + ("" if processed is None else
               f"; processed at load: {len(processed.modules)} quantized modules, its bytes as {server}'s kernels "
               f"read them (the rank file held {processed.rank_file_bytes})"))


def model_draft_startup_line(binding: Binding, directory: str | Path, draft: Manifest, target: Manifest,
                             processed: ProcessedLayers | None = None, server: str = "the server") -> str:
    """The line each rank logs once a draft model from its own checkpoint is bound: its layers, where their gathers
    hide, and its resident and saved bytes apart from the target's (gathered in the target's slots). `target`: the
    target's layers as served (with the target processed at load, `processed`, the processed layout, whose largest
    layer sizes the slots); the line then also gives the target's processed bytes.

    >>> log.info(model_draft_startup_line(binding, "draft-out/", draft_manifest, target_manifest))  # doctest: +SKIP
    """
    assert draft.draft is not None
    target = target.without_draft()
    figures = draft_account(draft, binding.gatherer.num_slots, target=target)
    assert figures is not None
    layers = ", ".join(map(str, draft.draft.layers))
    joined = binding.shards.manifest.draft
    assert joined is not None
    held = sum(binding.shards.chunk(i).numel() for i in joined.layers)  # read from the buffer itself
    group_ranks = torch.distributed.get_process_group_ranks(binding.gatherer.group)
    return (f"shardprep: DP rank {group_ranks[binding.shards.rank]} binds {draft.draft.describe()} of {directory}: "
            f"layers {layers} gathered after the target's layers (the first dispatched before the target's last layer "
            f"computes), into the target's slots; this rank holds {held} bytes of its chunks (R/N); resident draft "
            f"bytes {figures['resident_bytes']}, saved {figures['saved_bytes']} against {figures['sharded_bytes']} "
            "for its full weights"
            + ("" if processed is None else
               f"; beside a target processed at load ({len(processed.modules)} quantized modules): the target's "
               f"processed bytes {account(target).sharded_bytes}, {server}'s kernels' layout (its rank file held "
               f"{processed.rank_file_bytes} a rank), the draft's as converted"))
