"""The convert plan: every decision convert makes, taken before a byte is written.

`make_plan` reads headers (and, for block-FP8 checkpoints, the small scale tensors) and decides which
tensors are targets, what the requant rewrites, how every layer is laid out, where each chunk sits in
the rank files (and with which chunk alignment), and what happens to every replicated file. The writer
(`output/writer.py`) carries a plan out; `convert --dry-run` prints one. Nothing here writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import LayoutError, SelectionError, SourceError
from ..manifests.draft_layers import DraftLayers, draft_of_config, draft_tensor_problem
from ..manifests.layout import (
    NO_CHUNK_ALIGNMENT,
    LayerLayout,
    TensorSpec,
    alignment_padding_bytes,
    file_alignment_for,
    is_chunk_alignment,
    plan_layer,
    used_bytes,
)
from ..manifests.manifest import MANIFEST_NAME, LayerRecord, Manifest
from ..manifests.rank_file import header_json_bytes, plan_rank_file, rank_file_name
from ..manifests.replicated import NOTICE_FILE, NOTICE_TENSOR, SHARDED_SENTINEL
from ..planning.accounting import ZERO_COPY_MIN_ALIGNMENT
from .requant_jobs import RequantOptions, RequantPlan, plan_requant
from .selection import Selection, TargetPlan, draft_preset_hint, select_targets
from .source import INDEX_NAME, SINGLE_NAME, SourceCheckpoint

# What `--chunk-alignment auto` tries: the CUDA virtual-memory mapping granularity the zero-copy runtime
# needs, taken only when its padding costs at most AUTO_MAX_PADDING of Σ|T| per rank.
AUTO_CHUNK_ALIGNMENT = ZERO_COPY_MIN_ALIGNMENT
AUTO_MAX_PADDING = 0.01
# transformers loads a top-level model.safetensors before it looks at the index, which would bypass the
# sentinel: the replicated part of a single-file checkpoint gets the one-shard name instead.
SINGLE_OUT_NAME = "model-00001-of-00001.safetensors"
_SIZE = re.compile(r"(\d+)\s*(B|KiB|MiB|GiB)?")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_chunk_alignment(value: str | int) -> int | None:
    """`--chunk-alignment`: None for `auto`, 16 for `none`, else a size like `2MiB` (a power of two, 16 B–64 MiB).

    >>> parse_chunk_alignment("auto"), parse_chunk_alignment("none"), parse_chunk_alignment("2MiB")
    (None, 16, 2097152)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size: int | None = value
    elif value == "auto":
        return None
    elif value == "none":
        return NO_CHUNK_ALIGNMENT
    else:
        m = _SIZE.fullmatch(str(value).strip())
        size = int(m.group(1)) * _UNITS[m.group(2)] if m else None
    if not is_chunk_alignment(size):
        raise LayoutError(f"--chunk-alignment {value!r}: expected auto, none, or a power of two from 16 B to "
                          "64 MiB such as 2MiB")
    assert size is not None
    return size


@dataclass(frozen=True)
class ReplicatedFile:
    """One source safetensors file in the output: linked or copied whole (`tensors` None), or rewritten.

    A rewritten file keeps `tensors` (non-targets, in the order written); an empty list drops the file.
    `out_name` is its name in the output (the source's, except `model.safetensors`: see SINGLE_OUT_NAME).
    """

    name: str
    tensors: tuple[TensorSpec, ...] | None
    out_name: str = ""

    @property
    def unchanged(self) -> bool:
        return self.tensors is None


@dataclass(frozen=True)
class RankFileLayout:
    """The layers laid out for one chunk alignment: layouts, where each chunk sits, the rank file header."""

    chunk_alignment: int
    layouts: tuple[LayerLayout, ...]
    file_offsets: tuple[int, ...]
    header: bytes
    world_size: int

    @property
    def rank_file_bytes(self) -> int:
        return self.file_offsets[-1] + self.layouts[-1].chunk_bytes

    @property
    def sharded_bytes(self) -> int:
        return sum(lay.total_bytes for lay in self.layouts)

    @property
    def padding_bytes(self) -> int:
        """Alignment padding per rank: everything in a rank file but the JSON header and ⌈used/N⌉ per layer."""
        return alignment_padding_bytes(self.rank_file_bytes, header_json_bytes(self.header),
                                       [used_bytes(lay.entries) for lay in self.layouts], self.world_size)


@dataclass(frozen=True)
class ConvertPlan:
    """What convert will write, down to every offset. See `make_plan`."""

    source: SourceCheckpoint
    world_size: int
    selection: Selection
    targets: TargetPlan
    requant: RequantPlan | None
    rewritten: dict[str, TensorSpec]
    rank_layout: RankFileLayout
    replicated: tuple[ReplicatedFile, ...]
    other_files: tuple[str, ...] = field(default=())
    requant_options: RequantOptions = field(default_factory=RequantOptions)
    draft: DraftLayers | None = None
    """The sharded layers that are a draft model's: the checkpoint's MTP layers (config.json's
    `num_nextn_predict_layers` after `num_hidden_layers`) that the selection shards, or every layer of a draft
    model's own checkpoint (DFlash, EAGLE-3), with its target's facts (draft_layers.draft_of_config)."""

    @property
    def layouts(self) -> tuple[LayerLayout, ...]:
        return self.rank_layout.layouts

    @property
    def file_offsets(self) -> tuple[int, ...]:
        return self.rank_layout.file_offsets

    @property
    def chunk_alignment(self) -> int:
        return self.rank_layout.chunk_alignment

    @property
    def rank_header(self) -> bytes:
        """The bytes every rank file starts with (its safetensors header, padded to the first chunk)."""
        return self.rank_layout.header

    @property
    def target_bytes(self) -> int:
        """Bytes of the target tensors themselves (no padding)."""
        return sum(e.nbytes for lay in self.layouts for e in lay.entries)

    @property
    def sharded_bytes(self) -> int:
        """Σ|T| over layers: what every rank would hold without sharding (padding included)."""
        return self.rank_layout.sharded_bytes

    @property
    def rank_file_bytes(self) -> int:
        return self.rank_layout.rank_file_bytes

    @property
    def alignment_padding_bytes(self) -> int:
        """Bytes of alignment padding in each rank's file and device buffer (see docs/format.md)."""
        return self.rank_layout.padding_bytes

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
        return Manifest(
            world_size=self.world_size,
            rank_files=tuple(rank_file_name(r, self.world_size) for r in range(self.world_size)),
            layers=tuple(LayerRecord.from_layout(lay, off) for lay, off in zip(self.layouts, self.file_offsets)),
            source=self.source.describe(),
            quantization=self.requant.manifest_record if self.requant else None,
            chunk_alignment=self.chunk_alignment,
            file_alignment=file_alignment_for(self.chunk_alignment),
            selection=self.selection.record(),
            requant_options=self.requant_options.record(),
            draft=self.draft,
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for `convert --dry-run`: the selection per layer, byte totals, per-rank memory."""
        from ..planning.accounting import account, draft_account

        manifest = self.skeleton_manifest()
        return {
            "world_size": self.world_size,
            "layers": {str(lay.layer): [e.name for e in lay.entries] for lay in self.layouts},
            "fused_views": {str(lay.layer): [v.name for v in lay.views] for lay in self.layouts if lay.views},
            "target_tensors": sum(len(lay.entries) for lay in self.layouts),
            "target_bytes": self.target_bytes,
            "sharded_bytes": self.sharded_bytes,
            "chunk_alignment": self.chunk_alignment,
            "rank_file_bytes": self.rank_file_bytes,
            "alignment_padding_bytes": self.alignment_padding_bytes,
            "requantized_tensors": len(self.rewritten),
            "requantized_weights": len(self.requant.jobs) if self.requant else 0,
            "replicated_files": {f.out_name: ("unchanged" if f.tensors is None else
                                              "dropped" if not f.tensors else "rewritten")
                                 for f in self.replicated},
            "replicated_bytes": self.replicated_bytes,
            "memory": account(manifest, non_target_bytes=self.replicated_bytes).to_dict(),
            "draft": draft_account(manifest),
        }


def make_plan(ckpt: SourceCheckpoint, world_size: int, selection: Selection,
              requant: RequantOptions | None = None, chunk_alignment: str | int = "auto") -> ConvertPlan:
    """Plan a conversion of `ckpt` into `world_size` rank files; reads headers and scales, writes nothing.

    `chunk_alignment`: "auto" (2 MiB when its padding costs at most 1% of Σ|T| per rank, else none),
    "none" (16 bytes), or a size such as "2MiB" (see `parse_chunk_alignment`).

    >>> plan = make_plan(open_source("my-model/"), 8, Selection(preset=load_preset("llama")))  # doctest: +SKIP
    >>> plan.layouts[0].chunk_bytes  # doctest: +SKIP
    """
    alignment = parse_chunk_alignment(chunk_alignment)
    options = requant or RequantOptions()
    _check_name_clashes(ckpt)
    try:
        targets = select_targets(ckpt.tensors, selection)
    except SelectionError as exc:
        hint = draft_preset_hint(ckpt.config, selection)
        raise SelectionError(f"{exc}; {hint}" if hint else str(exc)) from None
    draft = draft_of_config(ckpt.config, targets.layers)
    problem = draft and draft_tensor_problem(draft, {name: t.shape for name, t in ckpt.tensors.items()})
    if problem:
        raise SourceError(f"{ckpt.root}: {problem}")
    requant_plan = plan_requant(ckpt, targets.names, options)
    rewritten = requant_plan.specs() if requant_plan else {}

    def spec(name: str) -> TensorSpec:
        if name in rewritten:
            return rewritten[name]
        t = ckpt.tensors[name]
        return TensorSpec(name, t.dtype, t.shape)

    # Laid out from the rewritten specs, so the layout describes the bytes actually written (a targeted
    # scale written as F8_E8M0 is a quarter of its F32 source).
    layers = [(idx, [spec(n) for n in names]) for idx, names in targets.layers.items()]
    if alignment is None:
        rank_layout = choose_rank_layout(layers, targets, world_size)
    else:
        rank_layout = lay_out(layers, targets, world_size, alignment)
    replicated = []
    for name, sf in ckpt.files.items():
        out_name = SINGLE_OUT_NAME if name == SINGLE_NAME else name
        # A requantized weight before its scale, so the scale comes from the weight's result, not a rerun.
        keep = sorted((t for t in sf.tensors if t not in targets.names), key=_weight_before_scale)
        if len(keep) == len(sf.tensors) and not any(t in rewritten for t in keep) and out_name == name:
            replicated.append(ReplicatedFile(name, None, out_name))
        else:
            replicated.append(ReplicatedFile(name, tuple(spec(t) for t in keep), out_name))
    other = tuple(rel for rel in ckpt.other_files if rel != INDEX_NAME)
    return ConvertPlan(ckpt, world_size, selection, targets, requant_plan, rewritten, rank_layout,
                       tuple(replicated), other, options, draft)


def lay_out(layers: list[tuple[int, list[TensorSpec]]], targets: TargetPlan, world_size: int,
            chunk_alignment: int) -> RankFileLayout:
    """Every layer packed with C a multiple of `chunk_alignment`, and where the chunks go in a rank file."""
    layouts = tuple(plan_layer(idx, specs, world_size, targets.groups.get(idx, ()), chunk_alignment=chunk_alignment)
                    for idx, specs in layers)
    offsets, header = plan_rank_file([(lay.layer, lay.chunk_bytes) for lay in layouts], world_size,
                                     file_alignment_for(chunk_alignment))
    return RankFileLayout(chunk_alignment, layouts, tuple(offsets), header, world_size)


def choose_rank_layout(layers: list[tuple[int, list[TensorSpec]]], targets: TargetPlan,
                       world_size: int) -> RankFileLayout:
    """`--chunk-alignment auto`: 2 MiB when the padding it adds per rank is at most 1% of Σ|T|, else none.

    Σ|T| is what every rank would hold without sharding, so the rule reads: the alignment may cost at
    most 1% of the memory that sharding is about.
    """
    plain = lay_out(layers, targets, world_size, NO_CHUNK_ALIGNMENT)
    aligned = lay_out(layers, targets, world_size, AUTO_CHUNK_ALIGNMENT)
    if aligned.padding_bytes - plain.padding_bytes <= AUTO_MAX_PADDING * plain.sharded_bytes:
        return aligned
    return plain


def _check_name_clashes(ckpt: SourceCheckpoint) -> None:
    # Names convert itself writes must not come from the source, or one would silently replace the other.
    ours = {MANIFEST_NAME, SHARDED_SENTINEL, NOTICE_FILE, SINGLE_OUT_NAME if SINGLE_NAME in ckpt.files else ""}
    for name in (*ckpt.files, *ckpt.other_files):
        if name in ours or name.split("/")[0] == "shards":
            raise SourceError(f"{ckpt.root}: holds {name!r}, a name shardprep writes in its output; is this "
                              "already an output of `shardprep convert`?")
    if NOTICE_TENSOR in ckpt.tensors:
        raise SourceError(f"{ckpt.root}: holds a tensor named {NOTICE_TENSOR!r}, which shardprep reserves")


def _weight_before_scale(name: str) -> tuple[str, bool]:
    scale = name.endswith("_scale_inv")
    return (name[: -len("_scale_inv")] if scale else name, scale)
