"""The convert plan: every decision convert makes, taken before a byte is written.

`make_plan` reads headers (and, for block-FP8 checkpoints, the small scale tensors) and decides which
tensors are targets, what the requant rewrites, how every layer is laid out, where each chunk sits in
the rank files, and what happens to every replicated file. The writer (`writer.py`) carries a plan
out; `convert --dry-run` prints one. Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..manifests.layout import LayerLayout, TensorSpec, plan_file_offsets, plan_layer
from ..manifests.manifest import Manifest, rank_file_name
from .requant_jobs import RequantOptions, RequantPlan, plan_requant
from .selection import Selection, TargetPlan, select_targets
from .source import INDEX_NAME, SourceCheckpoint


@dataclass(frozen=True)
class ReplicatedFile:
    """One source safetensors file in the output: linked or copied whole (`tensors` None), or rewritten.

    A rewritten file keeps `tensors` (non-targets, in the order written); an empty list drops the file.
    """

    name: str
    tensors: tuple[TensorSpec, ...] | None

    @property
    def unchanged(self) -> bool:
        return self.tensors is None


@dataclass(frozen=True)
class ConvertPlan:
    """What convert will write, down to every offset. See `make_plan`."""

    source: SourceCheckpoint
    world_size: int
    selection: Selection
    targets: TargetPlan
    requant: RequantPlan | None
    rewritten: dict[str, TensorSpec]
    layouts: tuple[LayerLayout, ...]
    file_offsets: tuple[int, ...]
    replicated: tuple[ReplicatedFile, ...]
    other_files: tuple[str, ...] = field(default=())

    @property
    def target_bytes(self) -> int:
        """Bytes of the target tensors themselves (no padding)."""
        return sum(e.nbytes for lay in self.layouts for e in lay.entries)

    @property
    def sharded_bytes(self) -> int:
        """Σ|T| over layers: what every rank would hold without sharding (padding included)."""
        return sum(lay.total_bytes for lay in self.layouts)

    @property
    def rank_file_bytes(self) -> int:
        return self.file_offsets[-1] + self.layouts[-1].chunk_bytes

    @property
    def rewritten_bytes(self) -> int:
        """Bytes of replicated tensors written tensor by tensor (rewritten files), for progress reporting."""
        return sum(t.nbytes for f in self.replicated if f.tensors for t in f.tensors)

    @property
    def replicated_bytes(self) -> int:
        """Bytes of every non-target tensor the output keeps."""
        total = 0
        for f in self.replicated:
            if f.tensors is None:
                total += sum(self.spec(t).nbytes for t in self.source.files[f.name].tensors)
            else:
                total += sum(t.nbytes for t in f.tensors)
        return total

    def spec(self, name: str) -> TensorSpec:
        """The dtype and shape `name` is written with (its requantized form where the requant rewrites it)."""
        rewritten = self.rewritten.get(name)
        if rewritten is not None:
            return rewritten
        t = self.source.tensors[name]
        return TensorSpec(name, t.dtype, t.shape)

    def write_order(self) -> list[str]:
        """Tensor names in the order the writer consumes them (the requant queues its jobs in this order)."""
        order = [e.name for lay in self.layouts for e in lay.entries]
        order += [t.name for f in self.replicated if f.tensors for t in f.tensors]
        return order

    def skeleton_manifest(self) -> Manifest:
        """The manifest this plan produces, without checksums (the writer adds them)."""
        from ..manifests.manifest import LayerRecord

        return Manifest(
            world_size=self.world_size,
            rank_files=tuple(rank_file_name(r, self.world_size) for r in range(self.world_size)),
            layers=tuple(LayerRecord.from_layout(lay, off) for lay, off in zip(self.layouts, self.file_offsets)),
            source=self.source.describe(),
            quantization=self.requant.manifest_record if self.requant else None,
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for `convert --dry-run`: the selection per layer, byte totals, per-rank memory."""
        from ..manifests.accounting import account

        return {
            "world_size": self.world_size,
            "layers": {str(lay.layer): [e.name for e in lay.entries] for lay in self.layouts},
            "fused_views": {str(lay.layer): [v.name for v in lay.views] for lay in self.layouts if lay.views},
            "target_tensors": sum(len(lay.entries) for lay in self.layouts),
            "target_bytes": self.target_bytes,
            "sharded_bytes": self.sharded_bytes,
            "rank_file_bytes": self.rank_file_bytes,
            "requantized_tensors": len(self.rewritten),
            "replicated_files": {f.name: ("unchanged" if f.tensors is None else
                                          "dropped" if not f.tensors else "rewritten") for f in self.replicated},
            "replicated_bytes": self.replicated_bytes,
            "memory": account(self.skeleton_manifest(), non_target_bytes=self.replicated_bytes).to_dict(),
        }


def make_plan(ckpt: SourceCheckpoint, world_size: int, selection: Selection,
              requant: RequantOptions | None = None) -> ConvertPlan:
    """Plan a conversion of `ckpt` into `world_size` rank files; reads headers and scales, writes nothing.

    >>> plan = make_plan(open_source("my-model/"), 8, Selection(preset=load_preset("llama")))  # doctest: +SKIP
    >>> plan.layouts[0].chunk_bytes  # doctest: +SKIP
    """
    targets = select_targets(ckpt.tensors, selection)
    requant_plan = plan_requant(ckpt, targets.names, requant or RequantOptions())
    rewritten = requant_plan.specs() if requant_plan else {}

    def spec(name: str) -> TensorSpec:
        if name in rewritten:
            return rewritten[name]
        t = ckpt.tensors[name]
        return TensorSpec(name, t.dtype, t.shape)

    # Laid out from the rewritten specs, so the layout describes the bytes actually written (a targeted
    # scale written as F8_E8M0 is a quarter of its F32 source).
    layouts = tuple(plan_layer(idx, [spec(n) for n in names], world_size, targets.groups.get(idx, ()))
                    for idx, names in targets.layers.items())
    offsets = tuple(plan_file_offsets([lay.chunk_bytes for lay in layouts]))
    replicated = []
    for name, sf in ckpt.files.items():
        # A requantized weight before its scale, so the scale comes from the weight's result, not a rerun.
        keep = sorted((t for t in sf.tensors if t not in targets.names), key=_weight_before_scale)
        if len(keep) == len(sf.tensors) and not any(t in rewritten for t in keep):
            replicated.append(ReplicatedFile(name, None))
        else:
            replicated.append(ReplicatedFile(name, tuple(spec(t) for t in keep)))
    other = tuple(rel for rel in ckpt.other_files if rel != INDEX_NAME)
    return ConvertPlan(ckpt, world_size, selection, targets, requant_plan, rewritten, layouts, offsets,
                       tuple(replicated), other)


def _weight_before_scale(name: str) -> tuple[str, bool]:
    scale = name.endswith("_scale_inv")
    return (name[: -len("_scale_inv")] if scale else name, scale)
