"""Sharded mode: DP attention inside vLLM, each data-parallel rank holding only its own rank file.

vLLM's data-parallel size is k·N (N = the manifest's world size): the DP ranks form k shard groups
of N consecutive DP ranks (`runtime/shard_groups.py`). DP rank r maps only `rank_files[r mod N]`,
binds the model's target parameters, once, to a `LayerGatherer`'s views over its group (gloo on the
CPU), and loads only the non-targets into the model. Before each bound decoder layer runs, its
weights are gathered into one of two slots, one layer ahead, by the two ops that `bind` puts around
the layer (runtime/layer_ops.py), which vLLM's compiled model calls like any op; vLLM's idle DP ranks
run dummy forwards of MoE models (all DP ranks step together), so every rank of a group issues the
same gathers. A quantized target is processed once at load and sharded as its kernel reads it
(processed_layers.py). Nothing here imports vLLM: what depends on it comes in through `ParallelLayout` and
the callbacks (`keep_plain_linear`, `refuse_post_processed`, `is_quantized`, `process_quantized`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import torch
from torch import nn

from ...errors import ShardprepError
from ...loader.rank_shards import iter_replicated, open_rank
from ...manifests.manifest import Manifest, load_manifest
from ...manifests.shard_groups import group_size_problem
from ...planning.accounting import account
from ...runtime.binding import Binding, bind, split_layer_name
from ...runtime.gatherer import LayerGatherer
from ...runtime.shard_groups import shard_group
from ..output_weights import check_all_loaded
from .compat import ParallelLayout
from .processed_layers import PlaceholderGatherer, ProcessedLayers, needs_processing, process_layers


def check_layout(layout: ParallelLayout, manifest: Manifest, directory: str | Path,
                 group_size: int | None = None) -> None:
    """Refuse, in one line, a parallel configuration in which sharded mode cannot work.

    `group_size`: the `shard_group_size` the user asked for (None: not given), which must be the manifest's N.

    >>> check_layout(layout, load_manifest("out/"), "out/")  # doctest: +SKIP
    """
    n = manifest.world_size
    if layout.tp_size != 1 or layout.pp_size != 1:
        raise ShardprepError(
            f"shard_weights is DP attention: tensor_parallel_size and pipeline_parallel_size must be 1, got "
            f"{layout.tp_size} and {layout.pp_size}; use data_parallel_size={n} (or a multiple), or full mode"
        )
    if n > 1 and not layout.lockstep_dp:
        raise ShardprepError(
            "shard_weights needs a MoE model: vLLM runs the data-parallel ranks of a dense model independently "
            "(no dummy forwards on idle ranks), so their gathers could not pair up; serve it in full mode"
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
            f"{directory}: converted for {n} ranks, but vLLM runs data_parallel_size={layout.dp_size} ({problem}); "
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
    gives defaults, which DIR need not hold (`compat.defaulted_parameters`).

    >>> binding, _ = load_sharded(model, "out/", compat.current_layout(), compat.keep_plain_linear)  # doctest: +SKIP
    """
    manifest = load_manifest(directory) if manifest is None else manifest
    check_layout(layout, manifest, directory, group_size)
    if tuple(layout.dp_world_ranks) != tuple(range(torch.distributed.get_world_size())):
        # Shard groups divide the world: with TP = PP = 1 vLLM's world is the DP ranks, in DP rank order.
        raise ShardprepError(f"shard_weights: vLLM's DP ranks {list(layout.dp_world_ranks)} are not its whole "
                             f"torch.distributed world of {torch.distributed.get_world_size()}; serve in full mode")
    backend = "gloo" if layout.device.type == "cpu" else "nccl"
    # Groups of their own (even for one group), so that the gathers never interleave with vLLM's collectives.
    group = shard_group(manifest.world_size, backend=backend, own_communicator=True,
                        allow_cross_node_groups=allow_cross_node_groups)
    shards = open_rank(directory, group.rank_file, world_size=manifest.world_size, device=layout.device,
                       verify=verify, manifest=manifest)
    # Bound first to placeholders (no memory), to check the targets before anything is read; the gatherer comes
    # once the replicated weights are in, over the rank file or over the processed layers.
    binding = bind(model, shards, PlaceholderGatherer(shards))  # type: ignore[arg-type]
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
        return bind(model, shards, LayerGatherer(shards, group=group.process_group, backend="auto")), None
    if process_quantized is None:
        raise ShardprepError(f"{directory}: a bound module is quantized, and no step to process it was given")
    processed = process_layers(binding, group.process_group, is_quantized, process_quantized)
    return processed.binding, processed


def startup_line(binding: Binding, directory: str | Path, processed: ProcessedLayers | None = None) -> str:
    """The one line each rank logs at startup: what it holds against what full weights would take.

    DP rank and size, the layers bound, the gather backend, the resident target bytes (its chunks,
    R/N, plus the slots, 2·max|T|) against R, all read from the buffers themselves, and the rank's
    shard group (its DP ranks read back from the gatherer's process group) and rank file (docs/serving.md).
    With quantized targets processed at load, the bytes are the processed ones (R', |T'|), and the line says
    how many modules were processed and what the rank file held.

    >>> log.info(startup_line(binding, "out/"))  # doctest: +SKIP
    """
    shards, gatherer = binding.shards, binding.gatherer
    manifest = shards.manifest
    local = sum(shards.chunk(layer).numel() for layer in gatherer.layers)
    layers = [layer.index for layer in binding.layers]
    full = account(manifest).sharded_bytes
    # The DP ranks are the world (load_sharded checks it), so global ranks are DP ranks.
    group_ranks = torch.distributed.get_process_group_ranks(gatherer.group)
    dp_size, n = torch.distributed.get_world_size(), shards.world_size
    return (f"shardprep: DP rank {group_ranks[shards.rank]} of {dp_size} serves {directory} sharded: "
            f"{len(layers)} layers bound ({layers[0]}..{layers[-1]}), gather backend {gatherer.backend_name}; "
            f"resident target bytes {local + gatherer.slot_bytes} = R/N {local} + {gatherer.num_slots} slots "
            f"{gatherer.slot_bytes} (+ {shards.nbytes - local} alignment padding), against {full} for full weights; "
            f"shard group {group_ranks[0] // n} of {dp_size // n} (DP ranks {group_ranks[0]}..{group_ranks[-1]}), "
            f"rank file {shards.rank} of {n}"
            + ("" if processed is None else
               f"; processed at load: {len(processed.modules)} quantized modules, their bytes as vLLM's kernels "
               f"read them (the rank file held {processed.rank_file_bytes})"))


def parameter_names(model: nn.Module, ids: set[int]) -> set[str]:
    """The names in `model` of the parameters whose `id` is in `ids`.

    >>> parameter_names(model, {id(p) for p in binding.target_parameters.values()})  # doctest: +SKIP
    """
    return {name for name, p in model.named_parameters() if id(p) in ids}


def bound_later(manifest: Manifest) -> Callable[[str], bool]:
    """Whether a model parameter name is one `bind` will bind: a target or fused view of the manifest, matched
    as `bind` matches it, by layer index and the name inside the layer (`model.layers.3.self_attn.o_proj.weight`
    → (3, `self_attn.o_proj.weight`)), whatever the model calls its layer list.

    >>> is_target = bound_later(load_manifest("out/"))  # doctest: +SKIP
    >>> model_name_is_target = is_target("model.layers.1.self_attn.qkv_proj.weight")  # doctest: +SKIP
    """
    inside = {(r.layer, split_layer_name(name, r.layer)[1]) for r in manifest.layers
              for name in [*(e.name for e in r.entries), *(v.name for v in r.views)]}

    def is_target(name: str) -> bool:
        parts = name.split(".")
        return any(p.isdigit() and (int(p), ".".join(parts[k + 1:])) in inside for k, p in enumerate(parts) if k)

    return is_target
