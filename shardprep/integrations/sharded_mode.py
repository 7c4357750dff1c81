"""Sharded mode: DP attention inside a server (vLLM, SGLang), each data-parallel rank holding only its own rank
file. Server-agnostic: each server's `model_loader.py` calls `load_sharded` with its `compat`'s callbacks.

Written in vLLM's terms. vLLM's data-parallel size is k·N (N = the manifest's world size): the DP ranks form k shard
groups of N consecutive DP ranks (`runtime/shard_groups.py`). DP rank r maps only `rank_files[r mod N]`,
binds the model's target parameters, once, to a `LayerGatherer`'s views over its group (gloo on the
CPU), and loads only the non-targets into the model. Before each bound decoder layer runs, its
weights are gathered into one of two slots, one layer ahead, by the two ops that `bind` puts around
the layer (runtime/layer_ops.py), which vLLM's compiled model calls like any op; vLLM's idle DP ranks
run dummy forwards of MoE models (all DP ranks step together), so every rank of a group issues the
same gathers. A quantized target is processed once at load and sharded as its kernel reads it
(processed_layers.py). Nothing here imports a server: what depends on one comes in through `ParallelLayout`
(parallel_layout.py) and the callbacks (`keep_plain_linear`, `refuse_post_processed`, `is_quantized`,
`process_quantized`).

A draft's layers in DIR (`manifest.draft`: DeepSeek's MTP layer) are checked and left unread when vLLM serves
the target alone. With vLLM's MTP speculative decoding, the target's gatherer gathers them too, after the
target's layers (the draft's gather is dispatched, one layer ahead as any, before the target's last layer
computes), and `load_draft` binds
them to the draft model, which vLLM loads second (runtime/binding.py, `bind_draft`). With quantized targets
processed at load, the draft's layers are processed too, but only in `load_draft`: their processed layout exists
once the draft model does (`processed_layers.add_draft`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ShardprepError
from ..loader.rank_shards import RankShards, iter_replicated, open_rank
from ..manifests.manifest import Manifest, load_manifest
from ..manifests.shard_groups import group_size_problem
from ..manifests.strict_json import read_json_file
from ..planning.accounting import account, draft_account
from ..runtime.binding import Binding, bind, bind_draft, draft_layers, split_layer_name
from ..runtime.gatherer import LayerGatherer
from ..runtime.shard_groups import shard_group
from .output_weights import check_all_loaded
from .parallel_layout import ParallelLayout
from .processed_layers import PlaceholderGatherer, ProcessedLayers, add_draft, needs_processing, process_layers


@dataclass(frozen=True)
class _ServedWithDraft:
    """A target served with its draft, as the draft's load finds it: the target's binding, and when the target was
    processed at load, what processing the draft's layers the same way takes."""

    binding: Binding
    processed: ProcessedLayers | None = None
    shards: RankShards | None = None
    """The rank file as opened (the draft's checkpoint bytes still unread), when the target was processed."""
    group: Any = None
    process_quantized: Callable[[nn.Module], None] | None = None


# Per process, each directory served with its draft: the draft model, loaded after the target by the same worker,
# binds its layers to the target's gatherer.
_with_draft: dict[str, _ServedWithDraft] = {}


def serving_manifest(directory: str | Path) -> Manifest:
    """DIR's manifest, its draft's layers as the server must treat them (checked against DIR's config.json).

    >>> serving_manifest("out/").draft  # doctest: +SKIP
    """
    config = read_json_file(Path(directory) / "config.json", max_bytes=16 << 20, what="config.json",
                            allow_duplicate_keys=True)
    return load_manifest(directory).with_serving_draft(config if isinstance(config, dict) else None, str(directory))


def check_layout(layout: ParallelLayout, manifest: Manifest, directory: str | Path,
                 group_size: int | None = None) -> None:
    """Refuse, in one line, a parallel configuration in which sharded mode cannot work.

    `group_size`: the `shard_group_size` the user asked for (None: not given), which must be the manifest's N.

    >>> check_layout(layout, load_manifest("out/"), "out/")  # doctest: +SKIP
    """
    n = manifest.world_size
    if layout.tp_size != 1 or layout.pp_size != 1:
        raise ShardprepError(
            f"shard_weights is DP attention: {layout.tp_option} and {layout.pp_option} must be 1, got "
            f"{layout.tp_size} and {layout.pp_size}; use {layout.dp_advice.format(n=n)}, or full mode"
        )
    if n > 1 and not layout.lockstep_dp:
        raise ShardprepError(
            f"{layout.without_lockstep}, so their gathers could not pair up; serve it in full mode"
        )
    if group_size is not None and group_size != n:
        raise ShardprepError(
            f"model_loader_extra_config: shard_group_size {group_size}, but {directory} was converted for {n} "
            f"ranks, its shard group size; leave the key out or set it to {n}, or make a directory for "
            f"{group_size} ranks with `shardprep reshard {directory} NEW --ranks {group_size}`"
        )
    problem = group_size_problem(layout.dp_size, n)
    if problem is not None:
        raise ShardprepError(
            f"{directory}: converted for {n} ranks, but {layout.server} runs {layout.dp_option}={layout.dp_size} "
            f"({problem}); "
            f"launch a multiple of {n} DP ranks (shard groups of {n} consecutive DP ranks), or re-run `shardprep "
            f"convert --ranks {layout.dp_size}`"
        )
    if layout.platform not in ("cpu", "cuda"):
        raise ShardprepError(f"shard_weights runs on CPU and CUDA workers, not on {layout.platform}; use full mode")


def load_sharded(
    model: nn.Module,
    directory: str | Path,
    layout: ParallelLayout,
    keep_plain_linear: Callable[[nn.Module], None],
    verify: bool = True,
    group_size: int | None = None,
    allow_cross_node_groups: bool = False,
    refuse_post_processed: Callable[[nn.Module, Mapping[str, nn.Parameter]], None] | None = None,
    manifest: Manifest | None = None,
    is_quantized: Callable[[nn.Module], bool] = lambda module: False,
    process_quantized: Callable[[nn.Module], None] | None = None,
    optional: Collection[str] = (),
    model_name: Callable[[str], str] | None = None,
    draft: bool = False,
) -> tuple[Binding, ProcessedLayers | None]:
    """Bind `model`'s targets to this DP rank's shards and load its other weights; returns the binding.

    Collective over the DP ranks (each builds every shard group, then its group's gatherer).
    `refuse_post_processed(model, bound)` raises for a bound parameter that the server transforms after
    loading; then `keep_plain_linear(module)` is called for every module that owns a bound parameter and is
    not `is_quantized`. Both run before vLLM post-processes the weights. If some bound module is quantized,
    every bound layer is then processed at load (`process_quantized`, vLLM's step) and sharded as processed
    (processed_layers.py). Returns the binding, and what processing did (None: nothing was quantized).
    `group_size` and `allow_cross_node_groups` are the user's `shard_group_size` and
    `allow_cross_node_groups` options; `manifest`, DIR's if already read; `optional`, parameters the server
    gives defaults, which DIR need not hold (`compat.defaulted_parameters`); `model_name`, the model's name for a
    checkpoint tensor name, as the server's loader maps it (`compat.module_names`; None: the same names).
    `draft`: vLLM runs the draft's layers (`manifest.draft`) as a draft model; they are gathered after the
    target's, for `load_draft` to bind. Without it they are checked with the rest of the rank file and never read.

    >>> binding, _ = load_sharded(model, "out/", compat.current_layout(), compat.keep_plain_linear)  # doctest: +SKIP
    """
    manifest = serving_manifest(directory) if manifest is None else manifest
    check_layout(layout, manifest, directory, group_size)
    draft = draft and manifest.draft is not None
    if tuple(layout.dp_world_ranks) != tuple(range(torch.distributed.get_world_size())):
        # Shard groups divide the world: with TP = PP = 1 vLLM's world is the DP ranks, in DP rank order.
        raise ShardprepError(f"shard_weights: {layout.server}'s DP ranks {list(layout.dp_world_ranks)} are not its "
                             f"whole torch.distributed world of {torch.distributed.get_world_size()}; serve in full "
                             "mode")
    backend = "gloo" if layout.device.type == "cpu" else "nccl"
    # Groups of their own (even for one group), so that the gathers never interleave with vLLM's collectives.
    group = shard_group(manifest.world_size, backend=backend, own_communicator=True,
                        allow_cross_node_groups=allow_cross_node_groups)
    shards = open_rank(directory, group.rank_file, world_size=manifest.world_size, device=layout.device,
                       verify=verify, manifest=manifest, draft=draft)
    # Bound first to placeholders (no memory), to check the targets before anything is read; the gatherer comes
    # once the replicated weights are in, over the rank file or over the processed layers.
    binding = bind(model, shards, PlaceholderGatherer(shards), model_name=model_name)  # type: ignore[arg-type]
    if refuse_post_processed is not None:
        refuse_post_processed(model, binding.target_parameters)
    bound = {id(p) for p in binding.target_parameters.values()}
    for module in model.modules():
        if any(id(p) in bound for p in module.parameters(recurse=False)) and not is_quantized(module):
            keep_plain_linear(module)
    # One tensor at a time, file-backed on the host, as vLLM's own loader hands them: each is copied into its
    # parameter, so the replicated part is never held twice.
    loaded = model.load_weights(iter_replicated(directory, manifest, "cpu", verify))  # type: ignore[operator]
    check_all_loaded(model, loaded, directory, also={*parameter_names(model, bound), *optional})
    if not needs_processing(binding, is_quantized):
        binding.remove()
        served = bind(model, shards, LayerGatherer(shards, group=group.process_group, backend="auto"),
                      model_name=model_name)
        if draft:
            _with_draft[_key(directory)] = _ServedWithDraft(served)
        return served, None
    if process_quantized is None:
        raise ShardprepError(f"{directory}: a bound module is quantized, and no step to process it was given")
    processed = process_layers(binding, group.process_group, is_quantized, process_quantized, model_name)
    if draft:  # the draft's layers are processed once the draft model exists (load_draft)
        _with_draft[_key(directory)] = _ServedWithDraft(processed.binding, processed, shards, group.process_group,
                                                        process_quantized)
    return processed.binding, processed


def load_draft(
    model: nn.Module,
    directory: str | Path,
    manifest: Manifest,
    modules: Callable[[nn.Module, tuple[int, ...]], Mapping[int, nn.Module]],
    keep_plain_linear: Callable[[nn.Module], None],
    verify: bool = True,
    is_quantized: Callable[[nn.Module], bool] = lambda module: False,
    optional: Collection[str] = (),
    refuse_post_processed: Callable[[nn.Module, Mapping[str, nn.Parameter]], None] | None = None,
) -> tuple[Binding | None, ProcessedLayers | None]:
    """Load vLLM's draft model (DeepSeekMTP) of a directory served sharded: its layers in the manifest bound to the
    target's gatherer (`load_sharded(..., draft=True)` ran first in this process), everything else from the
    replicated part. `modules(model, layers)` finds each draft layer's module. Returns the target's binding, now
    also the draft's (None when the manifest shards no draft layer: the draft is then loaded whole from the
    replicated part), and, when the target was processed at load, what processing did with the draft's layers too
    (`processed_layers.add_draft`: they are processed the same way, quantized or not, and gathered after the
    target's). Collective over the shard group when the target was processed.

    >>> load_draft(mtp, "out/", serving_manifest("out/"), compat.mtp_blocks, compat.keep_plain_linear)  # doctest: +SKIP
    """
    if manifest.draft is None:
        loaded = model.load_weights(iter_replicated(directory, manifest, "cpu", verify))  # type: ignore[operator]
        check_all_loaded(model, loaded, directory, also=optional)
        return None, None
    served = _with_draft.get(_key(directory))
    if served is None:
        raise ShardprepError(f"{directory}: the draft model was loaded before the target, or the target was not "
                             "served sharded with its draft; shard_weights loads the target first")
    found = modules(model, manifest.draft.layers)
    if served.processed is None:
        bound = bind_draft(served.binding, found)
    else:  # bound to placeholders, for processing to read them (processed_layers.add_draft)
        assert served.shards is not None
        placeholders = PlaceholderGatherer(served.shards)
        bound = draft_layers(served.shards.manifest, placeholders.layers, found)
        for layer in bound:
            layer.point(placeholders.views(layer.index))
    if refuse_post_processed is not None:
        refuse_post_processed(model, {name: p for layer in bound for p, name in layer.params})
    ids = {id(param) for layer in bound for param, _ in layer.params}
    for module in model.modules():
        if any(id(p) in ids for p in module.parameters(recurse=False)):
            if not is_quantized(module):
                keep_plain_linear(module)
            elif served.processed is None:
                raise ShardprepError(f"{directory}: the draft's layer {manifest.draft.layers[0]} is quantized but "
                                     "the target's layers are not; a sharded draft is processed with a processed "
                                     "target only; serve it in full mode")
    loaded = model.load_weights(iter_replicated(directory, manifest, "cpu", verify))  # type: ignore[operator]
    check_all_loaded(model, loaded, directory, also={*parameter_names(model, ids), *optional})
    if served.processed is None:
        return served.binding, None
    assert served.shards is not None and served.process_quantized is not None
    processed = add_draft(served.processed, served.shards, served.group, bound, is_quantized,
                          served.process_quantized)
    return processed.binding, processed


def draft_startup_line(binding: Binding, directory: str | Path, processed: ProcessedLayers | None = None) -> str:
    """The line each rank logs once its draft is bound: which layers, where their gather hides, and the draft's
    resident and saved bytes apart from the target's; with the draft processed at load (`processed`: what
    `load_draft` returned), those are the processed bytes, and the line says how many modules were processed.

    >>> log.info(draft_startup_line(binding, "out/"))  # doctest: +SKIP
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
               f"; processed at load: {len(processed.modules)} quantized modules, its bytes as vLLM's kernels read "
               f"them (the rank file held {processed.rank_file_bytes})"))


def _key(directory: str | Path) -> str:
    return str(Path(directory).resolve())


def startup_line(binding: Binding, directory: str | Path, processed: ProcessedLayers | None = None,
                 server: str = "vLLM") -> str:
    """The one line each rank logs at startup: what it holds against what full weights would take.

    DP rank and size, the layers bound, the gather backend, the resident target bytes (its chunks,
    R/N, plus the slots, 2·max|T|) against R, all read from the buffers themselves, and the rank's
    shard group (its DP ranks read back from the gatherer's process group) and rank file (docs/serving.md).
    With quantized targets processed at load, the bytes are the processed ones (R', |T'|), and the line says
    how many modules were processed and what the rank file held (`server`: whose kernels read them).

    >>> log.info(startup_line(binding, "out/"))  # doctest: +SKIP
    """
    shards, gatherer = binding.shards, binding.gatherer
    manifest = shards.manifest
    layers = [layer.index for layer in binding.layers]
    local = sum(shards.chunk(layer).numel() for layer in layers)
    # A draft's layers gathered with these have a line of their own (draft_startup_line).
    drafted = sum(shards.chunk(layer).numel() for layer in gatherer.layers if layer not in layers)
    full = account(manifest.without_draft()).sharded_bytes
    # The DP ranks are the world (load_sharded checks it), so global ranks are DP ranks.
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
               f"read them (the rank file held {processed.rank_file_bytes})"))


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
    inside = {(r.layer, split_layer_name(name, r.layer)[1]) for r in records
              for name in [*(e.name for e in r.entries), *(v.name for v in r.views)]}

    def is_target(name: str) -> bool:
        parts = name.split(".")
        return any(p.isdigit() and (int(p), ".".join(parts[k + 1:])) in inside for k, p in enumerate(parts) if k)

    return is_target
