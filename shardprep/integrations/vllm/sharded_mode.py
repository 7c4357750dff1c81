"""Sharded mode: DP attention inside vLLM, each data-parallel rank holding only its own rank file.

Rank r of N (N = the manifest's world size = vLLM's data-parallel size) maps only
`rank_files[r]`, binds the model's target parameters to a `LayerGatherer` over a group of the N DP
ranks (gloo on the CPU), and loads only the non-targets into the model. Before each bound decoder
layer runs, its weights are gathered into one of two slots, one layer ahead; vLLM's idle DP ranks run
dummy forwards of MoE models, so every rank issues the same gathers. Nothing here imports vLLM:
what depends on it comes in through `ParallelLayout` and the `keep_plain_linear` callback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ...errors import ShardprepError
from ...loader.rank_shards import iter_replicated, open_rank
from ...manifests.accounting import account
from ...manifests.manifest import Manifest, load_manifest
from ...runtime.binding import Binding, bind
from ...runtime.gatherer import LayerGatherer
from .compat import ParallelLayout
from .full_mode import check_all_loaded


def check_layout(layout: ParallelLayout, manifest: Manifest, directory: str | Path) -> None:
    """Refuse, in one line, a parallel configuration in which sharded mode cannot work.

    >>> check_layout(layout, load_manifest("out/"), "out/")  # doctest: +SKIP
    """
    if not layout.eager:
        raise ShardprepError(
            "shard_weights needs enforce_eager=True (--enforce-eager): the gathers run in forward hooks, which "
            "vLLM's torch.compile and CUDA graphs do not capture yet (see docs/serving.md)"
        )
    if layout.tp_size != 1 or layout.pp_size != 1:
        raise ShardprepError(
            f"shard_weights is DP attention: tensor_parallel_size and pipeline_parallel_size must be 1, got "
            f"{layout.tp_size} and {layout.pp_size}; use data_parallel_size={manifest.world_size}, or full mode"
        )
    if manifest.world_size > 1 and not layout.lockstep_dp:
        raise ShardprepError(
            "shard_weights needs a MoE model: vLLM runs the data-parallel ranks of a dense model independently "
            "(no dummy forwards on idle ranks), so their gathers could not pair up; serve it in full mode"
        )
    if layout.dp_size != manifest.world_size:
        raise ShardprepError(
            f"{directory}: converted for {manifest.world_size} ranks, but vLLM runs data_parallel_size="
            f"{layout.dp_size}; launch {manifest.world_size} DP ranks or re-run `shardprep convert --ranks "
            f"{layout.dp_size}`"
        )
    if layout.platform not in ("cpu", "cuda"):
        raise ShardprepError(f"shard_weights runs on CPU and CUDA workers, not on {layout.platform}; use full mode")


def load_sharded(
    model: nn.Module,
    directory: str | Path,
    layout: ParallelLayout,
    keep_plain_linear: Callable[[nn.Module], None],
    verify: bool = True,
) -> Binding:
    """Bind `model`'s targets to this DP rank's shards and load its other weights; returns the binding.

    Collective over the DP ranks (each builds the same gatherer). `keep_plain_linear(module)` is called
    for every module that owns a bound parameter, before vLLM post-processes the weights.

    >>> binding = load_sharded(model, "out/", compat.current_layout(), compat.keep_plain_linear)  # doctest: +SKIP
    """
    manifest = load_manifest(directory)
    check_layout(layout, manifest, directory)
    shards = open_rank(directory, layout.dp_rank, world_size=layout.dp_size, device=layout.device, verify=verify,
                       manifest=manifest)
    backend = "gloo" if layout.device.type == "cpu" else "nccl"
    # A group of its own, so that the gathers never interleave with vLLM's collectives.
    group = torch.distributed.new_group(list(layout.dp_world_ranks), backend=backend)
    gatherer = LayerGatherer(shards, group=group, backend="auto")
    binding = bind(model, shards, gatherer)
    bound = {id(p) for p in binding.target_parameters.values()}
    for module in model.modules():
        if any(id(p) in bound for p in module.parameters(recurse=False)):
            keep_plain_linear(module)
    # One tensor at a time, file-backed on the host, as vLLM's own loader hands them: each is copied into its
    # parameter, so the replicated part is never held twice.
    loaded = model.load_weights(iter_replicated(directory, manifest, "cpu", verify))  # type: ignore[operator]
    check_all_loaded(model, loaded, directory, also=_names_of(model, bound))
    return binding


def startup_line(binding: Binding, directory: str | Path) -> str:
    """The one line each rank logs at startup: what it holds against what full weights would take.

    Rank, world size, the layers bound, the gather backend, and the resident target bytes (its chunks,
    R/N, plus the slots, 2·max|T|) against R, all read from the buffers themselves (docs/serving.md).

    >>> log.info(startup_line(binding, "out/"))  # doctest: +SKIP
    """
    shards, gatherer = binding.shards, binding.gatherer
    manifest = shards.manifest
    local = sum(shards.chunk(layer).numel() for layer in gatherer.layers)
    layers = [layer.index for layer in binding.layers]
    full = account(manifest).sharded_bytes
    return (f"shardprep: DP rank {shards.rank} of {shards.world_size} serves {directory} sharded: "
            f"{len(layers)} layers bound ({layers[0]}..{layers[-1]}), gather backend {gatherer.backend_name}; "
            f"resident target bytes {local + gatherer.slot_bytes} = R/N {local} + {gatherer.num_slots} slots "
            f"{gatherer.slot_bytes} (+ {shards.nbytes - local} alignment padding), against {full} for full weights")


def _names_of(model: nn.Module, ids: set[int]) -> set[str]:
    return {name for name, p in model.named_parameters() if id(p) in ids}
