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
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch import nn

from ..errors import ShardprepError
from ..planning.accounting import draft_account
from ..runtime.binding import Binding, bind_draft, draft_layers
from .load_options import ShardprepLoadOptions
from .processed_layers import PlaceholderGatherer, ProcessedLayers, process_draft_layers
from .server import Built, ServerAdapter
from .sharded_load import (
    ShardedLoad,
    bound_later,
    check_built_were_bound,
    keep_bound_modules_plain,
    load_replicated,
    serving_manifest,
)

_targets: dict[int, ShardedLoad] = {}
"""The target loads handed to their drafts, by the id of the server's deployment object, while it lives."""


def hand_to_draft(deployment: object, target: ShardedLoad) -> None:
    """Leave `target` (loaded) for the draft model's load in this process, under the server's `deployment` object."""
    key = id(deployment)
    _targets[key] = target
    weakref.finalize(deployment, _targets.pop, key, None)


def target_for(deployment: object) -> ShardedLoad | None:
    """The target load `hand_to_draft` left under `deployment`, if any."""
    return _targets.get(id(deployment))


class DraftLoad:
    """One rank's sharded-mode load of a draft model, after its target's (`ShardedLoad` with a deployment).

    The draft's layers in the target's manifest (an MTP layer, `manifest.draft`) are bound to the draft model's
    modules (`adapter.draft_layer_modules`) and gathered after the target's layers; everything else of the draft
    comes from the replicated part. A manifest that shards no draft layer has the draft loaded whole.

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

    def build(self, construct: object) -> nn.Module:
        """The draft model `construct()` builds, its sharded layers' weights built without storage."""
        is_target = bound_later(self.manifest, draft=True)
        with self.adapter.targets_without_storage(lambda name: is_target(self.adapter.manifest_name(name))) as made:
            model = construct()  # type: ignore[operator]
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
        found = adapter.draft_layer_modules(model, draft.layers)
        if target.processed is None:
            bound = bind_draft(target.binding, found)
        else:  # bound to placeholders, for processing to read them (processed_layers.process_draft_layers)
            placeholders = PlaceholderGatherer(target.shards)
            bound = draft_layers(target.shards.manifest, placeholders.layers, found)
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
