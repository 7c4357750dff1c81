"""Zero-copy own chunk: each layer's gather view maps this rank's chunk straight from the shard buffer.

Without it a gather writes all of T into a slot, this rank's own chunk included: a local copy of
|T|/N bytes per layer (read and write) that buys nothing, since the bytes are already resident.
With it, each sharded layer ℓ (position i, chunk C = chunk_bytes) has one view of N·C bytes, built
once at startup with CUDA virtual memory (`vmm.py`) and never remapped:

    view of layer ℓ:  [ peers 0..r−1 | own chunk r | peers r+1..N−1 ]
                        slot i%S,      shard buffer,  slot i%S,
                        bytes [0, r·C) [file_offset,   bytes [r·C, (N−1)·C)
                                        file_offset+C)

A gather then writes only the N−1 peer parts (ce: N−1 pulls; nccl: an in-place all-gather), and a
slot holds (N−1)·max C bytes instead of N·max C: slot memory falls by a factor (N−1)/N.

Mappings have a granularity (2 MiB on Hopper): every chunk must start (file_offset) and end
(chunk_bytes) on it, which `convert --chunk-alignment` provides. Otherwise, or without CUDA VMM
(CPU, gloo, no cuda-bindings, an old driver), the gatherer keeps the copy path and says so once.

This file holds the pure layout math and the decision (`plan_views`, `decide`), unit-tested on the
CPU, and `build_views`, which makes the mappings on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import RuntimeShardError
from ..manifests.manifest import LayerRecord, Manifest

MIB = 1 << 20


@dataclass(frozen=True)
class Mapping:
    """`nbytes` at byte `at` of a layer's view come from byte `offset` of the slot or of the shard buffer."""

    at: int
    nbytes: int
    source: str  # "slot" or "shard"
    offset: int


@dataclass(frozen=True)
class ViewPlan:
    """Where every byte of every layer's view comes from, and how large a slot must be."""

    granularity: int
    slot_bytes: int  # per slot: (N−1)·max chunk_bytes
    layers: tuple[tuple[Mapping, ...], ...]  # per layer position, in view order

    @property
    def mappings(self) -> int:
        return sum(len(m) for m in self.layers)


def misalignment(manifest: Manifest, granularity: int) -> str | None:
    """Why the manifest's chunks cannot be mapped at `granularity`, or None when every chunk can.

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord, Manifest
    >>> lay = plan_layer(1, [TensorSpec("l.1.w", "BF16", (1024, 1024))], world_size=2)
    >>> m = Manifest(2, ("a", "b"), (LayerRecord.from_layout(lay, 0),))
    >>> misalignment(m, 2 * MIB)
    "layer 1's chunk_bytes (1048576) is not a multiple of the 2 MiB mapping granularity"
    >>> misalignment(m, MIB) is None
    True
    """
    for r in manifest.layers:
        if r.chunk_bytes % granularity:
            return f"layer {r.layer}'s chunk_bytes ({r.chunk_bytes}) is not a multiple of the {_size(granularity)} " \
                   "mapping granularity"
        if r.file_offset % granularity:
            return f"layer {r.layer}'s file_offset ({r.file_offset}) is not a multiple of the {_size(granularity)} " \
                   "mapping granularity"
    return None


def layer_mappings(record: LayerRecord, rank: int, world_size: int) -> tuple[Mapping, ...]:
    """The (at most three) mappings of one layer's view: peers before `rank`, the own chunk, peers after.

    Peer p's part comes from slot bytes [p'·C, (p'+1)·C) with p' = p for p < rank and p − 1 after it,
    so the N−1 peer parts fill the first (N−1)·C bytes of the slot in rank order.

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord
    >>> lay = plan_layer(1, [TensorSpec("l.1.w", "BF16", (4096, 1024))], world_size=4)
    >>> [(m.at >> 20, m.nbytes >> 20, m.source, m.offset >> 20)
    ...  for m in layer_mappings(LayerRecord.from_layout(lay, 6 * MIB), rank=1, world_size=4)]
    [(0, 2, 'slot', 0), (2, 2, 'shard', 6), (4, 4, 'slot', 2)]
    """
    c, r = record.chunk_bytes, rank
    pieces = [Mapping(0, r * c, "slot", 0), Mapping(r * c, c, "shard", record.file_offset),
              Mapping((r + 1) * c, (world_size - 1 - r) * c, "slot", r * c)]
    return tuple(m for m in pieces if m.nbytes)


def plan_views(manifest: Manifest, rank: int, granularity: int) -> ViewPlan:
    """The mappings of every layer's view (manifest order) and the slot size; LayoutError-free once
    `misalignment(manifest, granularity)` is None.

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord, Manifest, plan_file_offsets
    >>> lays = [plan_layer(i, [TensorSpec(f"l.{i}.w", "BF16", (2048 * (i + 1), 1024))], world_size=2)
    ...         for i in range(2)]
    >>> offs = plan_file_offsets([l.chunk_bytes for l in lays], 2 * MIB)
    >>> m = Manifest(2, ("a", "b"), tuple(LayerRecord.from_layout(l, o) for l, o in zip(lays, offs)))
    >>> p = plan_views(m, rank=0, granularity=2 * MIB)
    >>> p.slot_bytes >> 20, p.mappings
    (4, 4)
    """
    problem = misalignment(manifest, granularity)
    if problem is not None:
        raise RuntimeShardError(f"cannot map the own chunks: {problem}")
    n = manifest.world_size
    max_c = max(r.chunk_bytes for r in manifest.layers)
    return ViewPlan(granularity, (n - 1) * max_c, tuple(layer_mappings(r, rank, n) for r in manifest.layers))


@dataclass(frozen=True)
class Decision:
    """Whether the gatherer maps own chunks (`use`) and, when it does not, why (`reason`)."""

    use: bool
    reason: str | None = None


def decide(requested: bool | None, reason: str | None) -> Decision:
    """Use zero copy where it works: `requested` None = where possible, True = required, False = never.

    `reason` says why it cannot work here (None: it can). Required but impossible raises, naming it.

    >>> decide(None, None)
    Decision(use=True, reason=None)
    >>> decide(None, "the device is cpu, not CUDA").reason
    'the device is cpu, not CUDA'
    >>> decide(False, None)
    Decision(use=False, reason='turned off (zero_copy=False)')
    """
    if requested is False:
        return Decision(False, "turned off (zero_copy=False)")
    if reason is None:
        return Decision(True)
    if requested:
        raise RuntimeShardError(f"zero_copy=True, but own chunks cannot be mapped: {reason}")
    return Decision(False, reason)


def layout_reason(manifest: Manifest, granularity: int) -> str | None:
    """`misalignment` with the fix appended (the manifest's chunk alignment, when it records one).

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord, Manifest
    >>> lay = plan_layer(1, [TensorSpec("l.1.w", "BF16", (1024, 1024))], world_size=2)
    >>> layout_reason(Manifest(2, ("a", "b"), (LayerRecord.from_layout(lay, 0),)), 2 * MIB).split(";")[1]
    ' convert with --chunk-alignment 2MiB (this manifest has no chunk_alignment)'
    """
    problem = misalignment(manifest, granularity)
    if problem is None:
        return None
    # chunk_alignment arrives with format v2; older manifests have none.
    alignment = getattr(manifest, "chunk_alignment", None)
    recorded = f"its chunk_alignment is {alignment}" if alignment is not None else "has no chunk_alignment"
    return f"{problem}; convert with --chunk-alignment {_size(granularity).replace(' ', '')} (this manifest {recorded})"


def slot_bytes(manifest: Manifest, num_slots: int, zero_copy: bool) -> int:
    """Device bytes of the gather slots: num_slots·max|T|, or num_slots·(N−1)/N·max|T| with zero copy.

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord, Manifest
    >>> lay = plan_layer(1, [TensorSpec("l.1.w", "BF16", (1024, 1024))], world_size=4)
    >>> m = Manifest(4, ("a", "b", "c", "d"), (LayerRecord.from_layout(lay, 0),))
    >>> slot_bytes(m, 2, False) / MIB, slot_bytes(m, 2, True) / MIB  # one layer: one slot
    (2.0, 1.5)
    """
    slots = min(num_slots, len(manifest.layers))
    max_c = max(r.chunk_bytes for r in manifest.layers)
    return slots * (manifest.world_size - (1 if zero_copy else 0)) * max_c


# -- on the GPU ------------------------------------------------------------------------------------
@dataclass
class ZeroCopyViews:
    """The mapped views (one per layer position) and the slots' own contiguous mappings."""

    views: tuple[torch.Tensor, ...]
    slots: tuple[torch.Tensor, ...]
    plan: ViewPlan


def build_views(manifest: Manifest, rank: int, shard_buffer: torch.Tensor, num_slots: int) -> ZeroCopyViews:
    """Map every layer's view: its own chunk from `shard_buffer`'s pages, its peer parts from its slot's.

    The shard buffer must be VMM memory whose first byte sits on a granularity boundary of its
    allocation (`vmm.allocate`, or the ce backend's symmetric memory); anything else raises.
    Each slot is new physical memory of `plan.slot_bytes`, also mapped once on its own (`slots`).

    >>> zc = build_views(shards.manifest, shards.rank, shards.buffer, num_slots=2)  # doctest: +SKIP
    """
    from . import vmm

    device = shard_buffer.device
    gran = vmm.granularity(device)
    plan = plan_views(manifest, rank, gran)
    shard, base = vmm.backing(shard_buffer)
    physical = []
    try:
        if base % gran:
            raise vmm.VmmError(f"the shard buffer starts {base} bytes into its allocation, not on a "
                               f"{_size(gran)} boundary")
        slots = min(num_slots, len(manifest.layers))
        physical = [vmm.create(plan.slot_bytes, device) for _ in range(slots)]
        slot_views = tuple(vmm.map_pieces([vmm.Piece(0, plan.slot_bytes, p, 0)], plan.slot_bytes, device)
                           for p in physical)
        views = []
        for i, (record, mappings) in enumerate(zip(manifest.layers, plan.layers)):
            pieces = [vmm.Piece(m.at, m.nbytes, shard if m.source == "shard" else physical[i % slots],
                                m.offset + (base if m.source == "shard" else 0)) for m in mappings]
            views.append(vmm.map_pieces(pieces, record.total_bytes, device))
    finally:
        shard.release()  # the mappings keep every page alive
        for p in physical:
            p.release()
    return ZeroCopyViews(tuple(views), slot_views, plan)


def own_chunks_alias(zc: ZeroCopyViews, manifest: Manifest, rank: int, shard_buffer: torch.Tensor) -> str | None:
    """Check once that each view's own-chunk part shows the shard buffer's bytes; None, or what differs.

    >>> own_chunks_alias(zc, shards.manifest, shards.rank, shards.buffer)  # doctest: +SKIP
    """
    for view, record in zip(zc.views, manifest.layers):
        c = record.chunk_bytes
        own = view[rank * c:(rank + 1) * c]
        chunk = shard_buffer[record.file_offset:record.file_offset + c]
        if not torch.equal(own, chunk):
            return f"layer {record.layer}'s view does not show the shard buffer's chunk"
    return None


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes % MIB == 0 else f"{nbytes} bytes"
