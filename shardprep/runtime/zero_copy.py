"""Zero-copy own chunk: each layer's gather view maps this rank's chunk straight from the shard buffer.

Without it a gather writes all of T into a slot, this rank's own chunk included: a local copy of
|T|/N bytes per layer (read and write) that buys nothing, since the bytes are already resident.
With it, each sharded layer ℓ (position i, chunk C = chunk_bytes) has one view of N·C bytes, built
once at startup with CUDA virtual memory (`vmm.py`) and never remapped:

    view of layer ℓ:  [ peer 0 | ... | peer r−1 | own chunk r | peer r+1 | ... | peer N−1 ]
                        slot i%S's units, in rank   the shard     slot i%S's units
                        order (peers only)          buffer's ℓ

A gather then writes only the N−1 peer parts (ce: N−1 pulls; nccl: an in-place all-gather), and a
slot holds (N−1)·max C bytes instead of N·max C: slot memory falls by a factor (N−1)/N.

The driver maps only whole allocations (see vmm.py), so memory is allocated in the pieces views
share: the shard buffer is one allocation per layer chunk (plus one per gap between chunks),
mapped back to back at the chunks' file offsets; a slot is (N−1)·max C / u allocations of u bytes,
u = the gcd of the chunk sizes (one allocation per peer part when all layers have one size).
Every chunk must therefore start (file_offset) and end (chunk_bytes) on the mapping granularity
(2 MiB on Hopper), which `convert --chunk-alignment` provides. Otherwise, or without CUDA VMM
(CPU, gloo, no cuda-bindings, an old driver), the gatherer keeps the copy path and says so once.

This file holds the pure layout math and the decision (`plan_views`, `decide`), unit-tested on the
CPU, and `build`, which allocates and maps on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import RuntimeShardError
from ..manifests.manifest import LayerRecord, Manifest

MIB = 1 << 20


@dataclass(frozen=True)
class Mapping:
    """An allocation mapped at byte `at` of a view or of the shard buffer: `nbytes` long, either the
    chunk of the layer at position `index` ("chunk"), a gap of the shard buffer ("gap", numbered),
    or unit `index` of the view's slot ("unit")."""

    at: int
    nbytes: int
    source: str
    index: int


@dataclass(frozen=True)
class ViewPlan:
    """Every allocation, and where each view and the shard buffer map them."""

    unit: int  # bytes of one slot allocation: the gcd of the chunk sizes
    units_per_slot: int  # (N−1)·max C / unit
    shard: tuple[Mapping, ...]  # the shard buffer: chunks and gaps, back to back from byte 0
    layers: tuple[tuple[Mapping, ...], ...]  # per layer position: its view, in order

    @property
    def slot_bytes(self) -> int:
        return self.unit * self.units_per_slot


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


def view_mappings(record: LayerRecord, position: int, rank: int, world_size: int, unit: int) -> tuple[Mapping, ...]:
    """The mappings of one layer's view: its own chunk at rank·C, each peer part made of slot units.

    Peer p's part takes the slot's units [q·C/u, (q+1)·C/u) with q = p for p < rank and p − 1 after
    it, so the N−1 peer parts fill the first (N−1)·C bytes of the slot in rank order.

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord
    >>> lay = plan_layer(1, [TensorSpec("l.1.w", "BF16", (4096, 1024))], world_size=4)
    >>> [(m.at >> 20, m.source, m.index) for m in view_mappings(LayerRecord.from_layout(lay, 0), 0, 1, 4, 2 * MIB)]
    [(0, 'unit', 0), (2, 'chunk', 0), (4, 'unit', 1), (6, 'unit', 2)]
    """
    c, per = record.chunk_bytes, record.chunk_bytes // unit
    out = []
    for p in range(world_size):
        if p == rank:
            out.append(Mapping(p * c, c, "chunk", position))
            continue
        q = p - (p > rank)
        out += [Mapping(p * c + k * unit, unit, "unit", q * per + k) for k in range(per)]
    return tuple(out)


def plan_views(manifest: Manifest, rank: int, granularity: int) -> ViewPlan:
    """Every allocation and mapping of the zero-copy path for `rank`; raises if `misalignment` is not None.

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord, Manifest, plan_file_offsets
    >>> lays = [plan_layer(i, [TensorSpec(f"l.{i}.w", "BF16", (2048 * (i + 1), 1024))], world_size=2)
    ...         for i in range(2)]
    >>> offs = plan_file_offsets([l.chunk_bytes for l in lays], 2 * MIB)
    >>> m = Manifest(2, ("a", "b"), tuple(LayerRecord.from_layout(l, o) for l, o in zip(lays, offs)))
    >>> p = plan_views(m, rank=0, granularity=2 * MIB)
    >>> p.unit >> 20, p.units_per_slot, [(x.at >> 20, x.source) for x in p.shard]
    (2, 2, [(0, 'chunk'), (2, 'chunk')])
    """
    problem = misalignment(manifest, granularity)
    if problem is not None:
        raise RuntimeShardError(f"cannot map the own chunks: {problem}")
    n = manifest.world_size
    unit = 0
    for r in manifest.layers:
        unit = math.gcd(unit, r.chunk_bytes)
    max_c = max(r.chunk_bytes for r in manifest.layers)
    shard: list[Mapping] = []
    at = gaps = 0
    for i, r in enumerate(manifest.layers):
        if r.file_offset > at:  # header or padding between chunks: memory the loader fills, no view maps
            shard.append(Mapping(at, r.file_offset - at, "gap", gaps))
            gaps += 1
        shard.append(Mapping(r.file_offset, r.chunk_bytes, "chunk", i))
        at = r.file_offset + r.chunk_bytes
    layers = tuple(view_mappings(r, i, rank, n, unit) for i, r in enumerate(manifest.layers))
    return ViewPlan(unit, (n - 1) * max_c // unit, tuple(shard), layers)


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
    """`misalignment` with the fix appended (and the chunk alignment the manifest records).

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord, Manifest
    >>> lay = plan_layer(1, [TensorSpec("l.1.w", "BF16", (1024, 1024))], world_size=2)
    >>> layout_reason(Manifest(2, ("a", "b"), (LayerRecord.from_layout(lay, 0),)), 2 * MIB).split(";")[1]
    " convert with --chunk-alignment 2MiB (this manifest's chunk_alignment is 16)"
    """
    problem = misalignment(manifest, granularity)
    if problem is None:
        return None
    # Format v2 records chunk_alignment; a v1 manifest reads as 16 (its C was a multiple of 16).
    return (f"{problem}; convert with --chunk-alignment {_size(granularity).replace(' ', '')} (this manifest's "
            f"chunk_alignment is {manifest.chunk_alignment})")


# -- on the GPU ------------------------------------------------------------------------------------
@dataclass
class ZeroCopyMemory:
    """What `build` made: the shard buffer, one view per layer position, one contiguous mapping per slot."""

    shard_buffer: torch.Tensor
    views: tuple[torch.Tensor, ...]
    slots: tuple[torch.Tensor, ...]
    plan: ViewPlan

    @property
    def shard_pieces(self) -> tuple[tuple[int, int], ...]:
        """(offset, bytes) of each separate allocation in the shard buffer (what a peer maps, for ce)."""
        return tuple((m.at, m.nbytes) for m in self.plan.shard)


def build(manifest: Manifest, rank: int, device: torch.device, num_slots: int, shareable: bool) -> ZeroCopyMemory:
    """Allocate and map the shard buffer (uninitialised), every layer's view, and the slots.

    `shareable`: the shard buffer's allocations can be exported to peer processes (ce reads them).
    Every allocation is mapped whole; handles are released once mapped, so the memory lives as long
    as the tensors that map it. `rehome` then reads shards that open_rank left unread straight from
    the rank file into the shard buffer, so the chunks' allocations are the only copy of R/N.

    >>> mem = build(shards.manifest, shards.rank, torch.device("cuda", 0), 2, shareable=True)  # doctest: +SKIP
    >>> shards.rehome(lambda nbytes: mem.shard_buffer)  # doctest: +SKIP
    """
    from . import vmm

    plan = plan_views(manifest, rank, vmm.granularity(device))
    slots = min(num_slots, len(manifest.layers))
    made: list[vmm.Physical] = []

    def new(nbytes: int, share: bool = False) -> vmm.Physical:
        made.append(vmm.create(nbytes, device, share))
        return made[-1]

    try:
        pieces = {(m.source, m.index): new(m.nbytes, shareable) for m in plan.shard}
        units = [[new(plan.unit) for _ in range(plan.units_per_slot)] for _ in range(slots)]
        shard_buffer = vmm.map_pieces([vmm.Piece(m.at, pieces[m.source, m.index]) for m in plan.shard],
                                      manifest.rank_file_bytes, device)
        # One rank: each view is its own chunk alone and a slot holds nothing (the driver maps no empty range).
        slot_views = tuple(vmm.map_pieces([vmm.Piece(k * plan.unit, u) for k, u in enumerate(slot_units)],
                                          plan.slot_bytes, device) if plan.slot_bytes
                           else torch.empty(0, dtype=torch.uint8, device=device) for slot_units in units)
        views = tuple(vmm.map_pieces([vmm.Piece(m.at, units[i % slots][m.index] if m.source == "unit"
                                                else pieces["chunk", i]) for m in mappings],
                                     record.total_bytes, device)
                      for i, (record, mappings) in enumerate(zip(manifest.layers, plan.layers)))
    finally:
        for physical in made:
            physical.release()  # the mappings keep every page alive
    return ZeroCopyMemory(shard_buffer, views, slot_views, plan)


def own_chunks_alias(mem: ZeroCopyMemory, manifest: Manifest, rank: int, shard_buffer: torch.Tensor) -> str | None:
    """Check once that each view's own-chunk part is the shard buffer's chunk; None, or what differs.

    Asked of the driver: the first and the last byte of both are backed by the same physical
    allocation (cuMemRetainAllocationHandle), and every mapping maps an allocation whole from its first
    byte, so the two ranges are the same memory. Nothing is read or allocated on the device (comparing
    the bytes took a temporary of one chunk and a read of R/N).

    >>> own_chunks_alias(mem, shards.manifest, shards.rank, shards.buffer)  # doctest: +SKIP
    """
    from . import vmm

    device = shard_buffer.device
    for view, record in zip(mem.views, manifest.layers):
        c = record.chunk_bytes
        own, chunk = view.data_ptr() + rank * c, shard_buffer.data_ptr() + record.file_offset
        for at in (0, c - 1):
            a, b = vmm.retain(own + at, device), vmm.retain(chunk + at, device)
            try:
                same = int(a.handle) == int(b.handle)
            finally:
                a.release()
                b.release()
            if not same:
                return f"layer {record.layer}'s view does not map the shard buffer's chunk"
    return None


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes % MIB == 0 else f"{nbytes} bytes"
