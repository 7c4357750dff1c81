"""Sharded mode's load of a target model, in the one order every server runs it: DP attention inside a server,
each data-parallel rank holding only its own rank file.

The server's data-parallel size is k·N (N = the manifest's world size): the DP ranks form k shard groups of N
consecutive DP ranks (`runtime/shard_groups.py`). DP rank r maps only `rank_files[r mod N]` and binds the model's
target parameters, once, to a `LayerGatherer`'s views over its group (gloo on the CPU). Before each bound decoder
layer runs, its weights are gathered into one of two slots, one layer ahead, by the two ops that `bind` puts around
the layer (runtime/layer_ops.py), which a compiled model calls like any op; the server runs idle DP ranks in
lockstep, so every rank of a group issues the same gathers. A quantized target is processed once at load and
sharded as its kernel reads it (processed_layers.py).

`ShardedLoad` is the flow, in steps a server's loader calls where its own lifecycle puts them:
1. `build(construct)`: the server builds the model with its targets' weights without storage (no rank ever holds
   them whole);
2. `load(model)`: check the layout, refuse what cannot be sharded, bind to placeholders, keep bound modules plain,
   load the replicated part (and check that every parameter was loaded or bound), process quantized layers or
   bind to the gatherer, check that every weight built without storage was bound, log the startup line;
3. `check_after_processing()`: after the server's own post-load step, check it left every bound parameter where the
   binding put it.
Everything the server decides comes from its `ServerAdapter` (server.py); nothing here imports or names a server.

A draft's layers are loaded by `drafts.py` once the server builds the draft model, with the steps it shares with a
target's load, public here (`__all__`):
- `serving_manifest(directory)`: DIR's manifest, its draft as the server must treat it;
- `bound_later(manifest, draft)`: which model parameter names `bind` will bind (built without storage);
- `layer_name_parts(manifest, name, layer)`: a tensor name split around its layer, as `bind` splits it;
- `keep_bound_modules_plain(adapter, model, bound, directory)`: bound modules kept plain, or refused if quantized
  and the server cannot process them;
- `load_replicated(adapter, model, directory, manifest, verify, bound)`: the replicated part through the model's
  `load_weights`, every parameter then loaded, bound or defaulted;
- `check_built_were_bound(built, model, bound, directory, what)`: no weight built without storage left unbound;
- `ShardedLoad`: the target's load, which a draft's load finds through the server's deployment object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import ShardprepError
from ..loader.rank_shards import RankShards, iter_replicated, open_rank
from ..manifests.manifest import Manifest, load_manifest
from ..manifests.shard_groups import group_size_problem
from ..manifests.strict_json import read_json_file
from ..planning.accounting import account
from ..runtime.binding import Binding, bind, split_layer_name
from ..runtime.gatherer import LayerGatherer
from ..runtime.shard_groups import shard_group
from .load_check import check_all_loaded, tracked_loading
from .load_options import ShardprepLoadOptions
from .processed_layers import PlaceholderGatherer, ProcessedLayers, needs_processing, process_layers
from .server import Built, OptionSpelling, ServerAdapter, WorkerLayout

__all__ = [
    "ShardedLoad",
    "bound_later",
    "bound_places",
    "check_built_were_bound",
    "check_layout",
    "keep_bound_modules_plain",
    "layer_name_parts",
    "load_replicated",
    "parameter_names",
    "refuse_replaced_after_processing",
    "serving_manifest",
    "startup_line",
]


def serving_manifest(directory: str | Path) -> Manifest:
    """DIR's manifest, its draft's layers as the server must treat them (checked against DIR's config.json).

    >>> serving_manifest("out/").draft  # doctest: +SKIP
    """
    config = read_json_file(Path(directory) / "config.json", max_bytes=16 << 20, what="config.json",
                            allow_duplicate_keys=True)
    return load_manifest(directory).with_serving_draft(config if isinstance(config, dict) else None, str(directory))


def check_layout(layout: WorkerLayout, spelling: OptionSpelling, manifest: Manifest, directory: str | Path,
                 group_size: int | None = None) -> None:
    """Refuse, in one line in the server's own option names, a parallel configuration sharded mode cannot serve.

    `group_size`: the `shard_group_size` the user asked for (None: not given), which must be the manifest's N.

    >>> check_layout(adapter.layout(), adapter.spelling, load_manifest("out/"), "out/")  # doctest: +SKIP
    """
    n = manifest.world_size
    if layout.tp_size != 1 or layout.pp_size != 1:
        raise ShardprepError(
            f"shard_weights is DP attention: {spelling.tp_option} and {spelling.pp_option} must be 1, got "
            f"{layout.tp_size} and {layout.pp_size}; use {spelling.dp_advice.format(n=n)}, or full mode"
        )
    if n > 1 and not layout.lockstep_dp:
        raise ShardprepError(f"{spelling.without_lockstep}, so their gathers could not pair up; serve it in full mode")
    if group_size is not None and group_size != n:
        raise ShardprepError(
            f"model_loader_extra_config: shard_group_size {group_size}, but {directory} was converted for {n} "
            f"ranks, its shard group size; leave the key out or set it to {n}, or make a directory for "
            f"{group_size} ranks with `shardprep reshard {directory} NEW --ranks {group_size}`"
        )
    problem = group_size_problem(layout.dp_size, n)
    if problem is not None:
        raise ShardprepError(
            f"{directory}: converted for {n} ranks, but {spelling.server} runs {spelling.dp_option}={layout.dp_size} "
            f"({problem}); launch a multiple of {n} DP ranks (shard groups of {n} consecutive DP ranks), or re-run "
            f"`shardprep convert --ranks {layout.dp_size}`"
        )
    if layout.platform not in ("cpu", "cuda"):
        raise ShardprepError(f"shard_weights runs on CPU and CUDA workers, not on {layout.platform}; use full mode")


class ShardedLoad:
    """One rank's sharded-mode load of a target model from DIR, step by step (the module docstring's order).

    `with_draft`: the server runs the manifest's draft layers (`manifest.draft`, an MTP layer) as a draft model;
    they are gathered after the target's, for `drafts.DraftLoad` to bind once the server builds the draft model.
    Without it they are checked with the rest of the rank file and never read.

    >>> load = ShardedLoad(adapter, "out/", ShardprepLoadOptions(shard_weights=True))  # doctest: +SKIP
    >>> model = load.build(lambda: build_the_model())  # doctest: +SKIP
    >>> binding = load.load(model)  # doctest: +SKIP
    """

    def __init__(self, adapter: ServerAdapter, directory: str | Path, options: ShardprepLoadOptions,
                 with_draft: bool = False):
        self.adapter, self.directory, self.options = adapter, directory, options
        self.manifest = serving_manifest(directory)
        self.with_draft = with_draft and self.manifest.draft is not None
        self.built: Built = []
        """The (name, parameter) pairs built without storage, each to be bound."""
        self.binding: Binding | None = None
        self.processed: ProcessedLayers | None = None
        self.shards: RankShards | None = None
        """The rank file as opened (read into the gatherer's buffer, unless processing replaced it)."""
        self.group: Any = None
        self._targets = bound_later(self.manifest)
        self._places: dict[str, ParameterPlace] = {}

    def is_target(self, name: str) -> bool:
        """Whether a parameter of the model (by the model's name) is a target that `load` binds."""
        return self._targets(self.adapter.manifest_name(name))

    def build(self, construct: Callable[[], nn.Module]) -> nn.Module:
        """The model `construct()` builds, its targets' weights built without storage (the adapter's way)."""
        with self.adapter.targets_without_storage(self.is_target) as made:
            model = construct()
        self.built = made
        return model

    def load(self, model: nn.Module) -> Binding:
        """Bind `model`'s targets to this DP rank's shards and load its other weights; log the startup line.

        Collective over the DP ranks (each builds every shard group, then its group's gatherer).
        """
        adapter, directory, manifest = self.adapter, self.directory, self.manifest
        layout = adapter.layout()
        check_layout(layout, adapter.spelling, manifest, directory, self.options.shard_group_size)
        if tuple(layout.dp_world_ranks) != tuple(range(torch.distributed.get_world_size())):
            # Shard groups divide the world: with attention TP = PP = 1 the world is the DP ranks, in DP rank order.
            raise ShardprepError(f"shard_weights: {adapter.spelling.server}'s DP ranks {list(layout.dp_world_ranks)} "
                                 f"are not its whole torch.distributed world of {torch.distributed.get_world_size()}; "
                                 "serve in full mode")
        adapter.refuse_unshardable(model, {name: p for name, p in model.named_parameters() if self.is_target(name)},
                                   str(directory))
        backend = "gloo" if layout.device.type == "cpu" else "nccl"
        # Groups of their own (even for one group), so that the gathers never interleave with the server's collectives.
        group = shard_group(manifest.world_size, backend=backend, own_communicator=True,
                            allow_cross_node_groups=self.options.allow_cross_node_groups)
        self.group = group.process_group
        shards = self.shards = open_rank(directory, group.rank_file, world_size=manifest.world_size,
                                         device=layout.device, verify=self.options.verify, manifest=manifest,
                                         draft=self.with_draft)
        # Bound first to placeholders (no memory), to check the targets before anything is read; the gatherer comes
        # once the replicated weights are in, over the rank file or over the processed layout.
        model_name = adapter.model_name(model)
        binding = bind(model, shards, PlaceholderGatherer(shards), model_name=model_name)  # type: ignore[arg-type]
        bound = set(map(id, binding.target_parameters.values()))
        keep_bound_modules_plain(adapter, model, bound, str(directory))
        load_replicated(adapter, model, directory, manifest, self.options.verify, bound)
        if not needs_processing(binding, adapter.is_quantized):
            binding.remove()
            self.binding = bind(model, shards, LayerGatherer(shards, group=self.group, backend="auto"),
                                model_name=model_name)
        else:
            self.processed = process_layers(binding, self.group, adapter.is_quantized, adapter.process_quantized,
                                            model_name)
            self.binding = self.processed.binding
        check_built_were_bound(self.built, model, self.binding.target_parameters.values(), directory, "a target")
        self._places = bound_places(model, self.binding.target_parameters)
        adapter.logger().info(startup_line(self.binding, directory, self.processed, adapter.spelling.server,
                                           len(self.built)))
        return self.binding

    def check_after_processing(self) -> None:
        """After the server's own post-load step: every bound parameter still where the binding put it."""
        assert self.binding is not None, "load() first"
        refuse_replaced_after_processing(self._places, self.binding.target_parameters, self.adapter.spelling.server)


def keep_bound_modules_plain(adapter: ServerAdapter, model: nn.Module, bound: set[int], directory: str) -> None:
    """Every module owning a bound parameter (by `id` in `bound`): kept plain if unquantized, else processed at load;
    a quantized one is refused here if the server's adapter cannot process it.

    >>> keep_bound_modules_plain(adapter, model, {id(p) for p in binding.target_parameters.values()},
    ...                          "out/")  # doctest: +SKIP
    """
    for name, module in model.named_modules():
        if not any(id(p) in bound for p in module.parameters(recurse=False)):
            continue
        if not adapter.is_quantized(module):
            adapter.keep_plain(module)
        elif not adapter.processes_quantized():
            method = type(getattr(module, "quant_method", module)).__name__
            raise ShardprepError(f"{directory}: the target {name} is quantized ({method}), and sharded mode does not "
                                 f"process {adapter.spelling.server}'s quantized layers (it rewrites their weights "
                                 "after loading); serve it in full mode, or convert an unquantized checkpoint")


def load_replicated(adapter: ServerAdapter, model: nn.Module, directory: str | Path, manifest: Manifest, verify: bool,
                    bound: set[int]) -> None:
    """The model's `load_weights` fed DIR's replicated part, one tensor at a time, file-backed on the host, as the
    server's own loader hands them (each is copied into its parameter, so the replicated part is never held twice);
    then every parameter must have been loaded, bound (by `id` in `bound`), or defaulted by the server
    (load_check.py).

    >>> load_replicated(adapter, model, "out/", load_manifest("out/"), verify=True, bound=set())  # doctest: +SKIP
    """
    with tracked_loading(model, adapter.default_weight_loader()) as seen:
        loaded = model.load_weights(iter_replicated(directory, manifest, "cpu", verify))  # type: ignore[operator]
    check_all_loaded(model, loaded, directory, also={*parameter_names(model, bound),
                                                     *adapter.defaulted_parameters(model)}, seen=seen)


def check_built_were_bound(built: Built, model: nn.Module, bound: Any, directory: str | Path, what: str) -> None:
    """Refuse a weight built without storage that no manifest tensor was bound to (it would be read as one element).

    By the place each was built at: a module processed at load holds a new parameter object under the same name.
    `bound`: the parameters bound; `what` names what was built so in the refusal ("a target", "a draft target").

    >>> check_built_were_bound(load.built, model, bound_params, "out/", "a target")  # doctest: +SKIP
    """
    places = {id(p): (m, a) for m in model.modules() for a, p in m._parameters.items() if p is not None}
    ids = set(map(id, bound))
    named = parameter_names(model, ids)
    for name, param in built:
        module_attribute = places.get(id(param))
        if module_attribute is None and name not in named:
            continue  # built, then replaced by the model's own constructor (EAGLE-3's wider qkv_proj): never read
        now = module_attribute[0]._parameters.get(module_attribute[1]) if module_attribute else None
        if id(now) not in ids and name not in named:
            raise ShardprepError(f"{name!r} was built without storage as {what} of {directory}, but no manifest "
                                 "tensor was bound to it; was the directory converted from this model?")


class ParameterPlace(NamedTuple):
    """Where a bound parameter is: the module attribute that holds it, and the address of its data."""

    module: nn.Module
    attribute: str
    data_ptr: int


def bound_places(model: nn.Module, bound: Mapping[str, nn.Parameter]) -> dict[str, ParameterPlace]:
    """Manifest name → where that bound parameter is now; taken before the server post-processes the weights.

    >>> before = bound_places(model, binding.target_parameters)  # doctest: +SKIP
    """
    names = {id(p): name for name, p in bound.items()}
    return {names[id(p)]: ParameterPlace(module, attribute, p.data_ptr())
            for module in model.modules() for attribute, p in module._parameters.items()
            if p is not None and id(p) in names}


def refuse_replaced_after_processing(before: Mapping[str, ParameterPlace], bound: Mapping[str, nn.Parameter],
                                     server: str = "the server") -> None:
    """Refuse, naming it, a bound parameter that the server's post-load processing replaced or pointed elsewhere:
    a step the adapter does not know of (a newer server, another platform) shows here, where the module's
    attribute no longer holds the bound parameter, or its data moved.

    >>> refuse_replaced_after_processing(before, binding.target_parameters, "vLLM")  # doctest: +SKIP
    """
    for name, (module, attribute, data_ptr) in before.items():
        if module._parameters.get(attribute) is not bound[name] or bound[name].data_ptr() != data_ptr:
            raise ShardprepError(
                f"shard_weights: {server}'s process_weights_after_loading replaced {name!r} "
                f"({type(module).__name__}.{attribute}), so it would no longer be read from the gathered "
                "weights; convert without it or serve this directory in full mode"
            )


def startup_line(binding: Binding, directory: str | Path, processed: ProcessedLayers | None = None,
                 server: str = "the server", built: int | None = None) -> str:
    """The one line each rank logs at startup: what it holds against what full weights would take.

    DP rank and size, the layers bound, the gather backend, the resident target bytes (its chunks,
    R/N, plus the slots, 2·max|T|) against R, all read from the buffers themselves, and the rank's
    shard group (its DP ranks read back from the gatherer's process group) and rank file (docs/serving/deployment.md).
    With quantized targets processed at load, the bytes are the processed ones (R', |T'|), and the line says
    how many modules were processed and what the rank file held. `built`: how many target weights were built
    without storage.

    >>> log.info(startup_line(binding, "out/", server="vLLM"))  # doctest: +SKIP
    """
    shards, gatherer = binding.shards, binding.gatherer
    manifest = shards.manifest
    layers = [layer.index for layer in binding.layers]
    local = sum(shards.chunk(layer).numel() for layer in layers)
    # A draft's layers gathered with these have a line of their own (drafts.draft_startup_line).
    drafted = sum(shards.chunk(layer).numel() for layer in gatherer.layers if layer not in layers)
    full = account(manifest.without_draft()).sharded_bytes
    # The DP ranks are the world (load checks it), so global ranks are DP ranks.
    group_ranks = torch.distributed.get_process_group_ranks(gatherer.group)
    dp_size, n = torch.distributed.get_world_size(), shards.world_size
    return (f"shardprep: DP rank {group_ranks[shards.rank]} of {dp_size} serves {directory} sharded: "
            f"{len(layers)} layers bound ({layers[0]}..{layers[-1]}), gather backend {gatherer.backend_name}; "
            f"resident target bytes {local + gatherer.slot_bytes} = R/N {local} + {gatherer.num_slots} slots "
            f"{gatherer.slot_bytes} (+ {shards.nbytes - local - drafted} alignment padding), against {full} for full "
            "weights; "
            f"shard group {group_ranks[0] // n} of {dp_size // n} (DP ranks {group_ranks[0]}..{group_ranks[-1]}), "
            f"rank file {shards.rank} of {n}"
            + ("" if processed is None else
               f"; processed at load: {len(processed.modules)} quantized modules, their bytes as {server}'s kernels "
               f"read them (the rank file held {processed.rank_file_bytes})")
            + ("" if built is None else f"; {built} target weights built without storage"))


def parameter_names(model: nn.Module, ids: set[int]) -> set[str]:
    """The names in `model` of the parameters whose `id` is in `ids`.

    >>> parameter_names(model, {id(p) for p in binding.target_parameters.values()})  # doctest: +SKIP
    """
    return {name for name, p in model.named_parameters() if id(p) in ids}


def bound_later(manifest: Manifest, draft: bool = False) -> Callable[[str], bool]:
    """Whether a model parameter name is one `bind` will bind: a target or fused view of the manifest, matched
    as `bind` matches it, by layer index and the name inside the layer (`model.layers.3.self_attn.o_proj.weight`
    → (3, `self_attn.o_proj.weight`)), whatever the model calls its layer list. The target model's layers, or with
    `draft` the draft's (`manifest.draft`: vLLM's DeepSeekMTP names its block's linear layers as the checkpoint does).

    >>> is_target = bound_later(load_manifest("out/"))  # doctest: +SKIP
    >>> model_name_is_target = is_target("model.layers.1.self_attn.qkv_proj.weight")  # doctest: +SKIP
    """
    records = manifest.draft_records if draft else manifest.target_records
    inside = {(r.layer, layer_name_parts(manifest, name, r.layer)[1]) for r in records
              for name in [*(e.name for e in r.entries), *(v.name for v in r.views)]}

    def is_target(name: str) -> bool:
        parts = name.split(".")
        return any(p.isdigit() and (int(p), ".".join(parts[k + 1:])) in inside for k, p in enumerate(parts) if k)

    return is_target


def layer_name_parts(manifest: Manifest, name: str, layer: int) -> tuple[str, str]:
    """A manifest tensor name of `layer` split into the layer's own name and the name inside the layer: around the
    layer's number (`model.layers.3.self_attn.o_proj.weight` → `model.layers.3`, `self_attn.o_proj.weight`), or
    after a layer the selection names instead of numbering (EAGLE-3's `midlayer.`, its `unnumbered_layers`).

    >>> from shardprep.manifests import Manifest
    >>> m = Manifest(1, ("shards/r",), (), version=1, selection={"unnumbered_layers": {"midlayer": 0}})
    >>> layer_name_parts(m, "midlayer.self_attn.o_proj.weight", 0)
    ('midlayer', 'self_attn.o_proj.weight')
    >>> layer_name_parts(m, "layers.2.mlp.down_proj.weight", 2)
    ('layers.2', 'mlp.down_proj.weight')
    """
    unnumbered = (manifest.selection or {}).get("unnumbered_layers") or {}
    for prefix, index in unnumbered.items():
        if index == layer and (name.startswith(f"{prefix}.") or f".{prefix}." in name):
            start = name.index(f"{prefix}.") if name.startswith(f"{prefix}.") else name.index(f".{prefix}.") + 1
            return name[:start + len(prefix)], name[start + len(prefix) + 1:]
    outer, inner = split_layer_name(name, layer)
    return f"{outer}.{layer}", inner
