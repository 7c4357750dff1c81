"""Per-rank memory and gather traffic of a sharded deployment (pure arithmetic, used by `inspect` and `plan`).

Two slot formulas exist, and which one applies depends on the runtime, not on the files:

- copy: a slot holds all of T, the rank's own chunk copied in on every gather;
  resident = R/N + S·max|T|.
- aliased own chunk (CUDA virtual memory): a layer's view maps the rank's own chunk straight
  from the shard buffer and only the N−1 peer chunks land in the slot; resident = R/N + S·(N−1)/N·max|T|.
  Mapping works in pages of the CUDA granularity, so every chunk is padded to a `chunk_alignment` of at
  least `ZERO_COPY_MIN_ALIGNMENT` and that padding is counted.

R = Σ|T| over the sharded layers, S = the number of slots (2: ping-pong), N = ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ShardprepError
from ..manifests.layout import ENTRY_ALIGNMENT, Entry, align_up, used_bytes
from ..manifests.manifest import Manifest

ZERO_COPY_MIN_ALIGNMENT = 2 << 20
"""CUDA's virtual-memory mapping granularity (2 MiB on H100/H200): the least chunk alignment that lets a
rank's own chunk be mapped into its layer's view instead of copied."""


@dataclass(frozen=True)
class MemoryAccount:
    """Per-rank bytes with and without sharding.

    `sharded_bytes` is R, the target bytes every rank would otherwise hold in full (padding included).
    `padding_bytes` is what chunk alignment adds to the shards and slots (0 without an alignment).
    """

    world_size: int
    num_slots: int
    num_layers: int
    aliased_own_chunk: bool
    chunk_alignment: int
    sharded_bytes: int
    max_layer_bytes: int
    local_chunk_bytes: int
    slot_bytes: int
    resident_bytes: int
    saved_bytes: int
    padding_bytes: int
    gather_recv_bytes_per_forward: int
    non_target_bytes: int

    @property
    def slot_formula(self) -> str:
        """The slot term of the resident formula that applies, e.g. `2·max|T|` or `2·(N−1)/N·max|T|`."""
        return f"{self.num_slots}·(N−1)/N·max|T|" if self.aliased_own_chunk else f"{self.num_slots}·max|T|"

    @property
    def freed_bytes(self) -> int:
        """What sharding takes off each rank before the slots are paid for: R − R/N."""
        return self.sharded_bytes - self.local_chunk_bytes

    def shortfall_reason(self) -> str | None:
        """Why sharding saves nothing here, in one line; None when it saves memory.

        >>> reason = account_layers([1 << 20] * 2, world_size=2).shortfall_reason()
        >>> reason.split(": ")[0]
        'the gather slots (2·max|T| = 2.00 MiB) exceed what sharding frees (R − R/N = 1.00 MiB)'
        >>> reason.split(": ")[1]
        'with 2 ranks and layers of equal size it pays from 5 sharded layers; 2 are sharded'
        """
        if self.saved_bytes > 0:
            return None
        need = break_even_layers(self.world_size, self.num_slots, self.aliased_own_chunk)
        when = ("it never pays with 1 rank" if math.isinf(need)
                else f"with {self.world_size} ranks and layers of equal size it pays from {math.floor(need) + 1} "
                     f"sharded layers; {self.num_layers} are sharded")
        return (f"the gather slots ({self.slot_formula} = {human_bytes(self.slot_bytes)}) exceed what sharding frees "
                f"(R − R/N = {human_bytes(self.freed_bytes)}): {when}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "slot_formula": self.slot_formula, "freed_bytes": self.freed_bytes,
                "shortfall_reason": self.shortfall_reason()}


def account_layers(
    layer_bytes: Sequence[int],
    world_size: int,
    *,
    num_slots: int = 2,
    chunk_alignment: int | Sequence[int] = ENTRY_ALIGNMENT,
    aliased_own_chunk: bool = False,
    non_target_bytes: int = 0,
) -> MemoryAccount:
    """Per-rank memory of sharding layers of these |T| (as laid out: a multiple of 16·N) across N ranks.

    Each chunk C = |T|/N is padded to `chunk_alignment` (one for every layer, or one per layer: a target's and its
    draft's layers, converted apart, gathered by one runtime). Copy path: a slot is N·max C; aliased own
    chunk: (N−1)·max C. Received per forward: (N−1)·Σ C. `MemoryAccount.chunk_alignment` is the largest.

    >>> a = account_layers([8192, 8192], world_size=4)
    >>> a.local_chunk_bytes, a.slot_bytes, a.saved_bytes
    (4096, 16384, -4096)
    >>> account_layers([8192, 8192], world_size=4, aliased_own_chunk=True).slot_bytes
    12288
    >>> account_layers([8192] * 2, world_size=4, chunk_alignment=4096, aliased_own_chunk=True).padding_bytes
    16384
    """
    alignments = ([chunk_alignment] * len(layer_bytes) if isinstance(chunk_alignment, int)
                  else list(chunk_alignment))
    if world_size < 1 or num_slots < 1 or min(alignments, default=1) < 1 or len(alignments) != len(layer_bytes):
        raise ValueError(f"world_size, num_slots and chunk_alignment must be >= 1 (one alignment, or one per layer), "
                         f"got {world_size}, {num_slots}, {chunk_alignment}")
    n = world_size
    chunks = [t // n for t in layer_bytes]
    padded = [align_up(c, a) for c, a in zip(chunks, alignments)]
    max_c = max(padded, default=0)
    lanes = n - 1 if aliased_own_chunk else n
    slots = min(num_slots, len(chunks)) * lanes * max_c
    local = sum(padded)
    total = sum(layer_bytes)
    unpadded = sum(chunks) + min(num_slots, len(chunks)) * lanes * max(chunks, default=0)
    return MemoryAccount(
        world_size=n,
        num_slots=num_slots,
        num_layers=len(chunks),
        aliased_own_chunk=aliased_own_chunk,
        chunk_alignment=max(alignments, default=ENTRY_ALIGNMENT),
        sharded_bytes=total,
        max_layer_bytes=max(layer_bytes, default=0),
        local_chunk_bytes=local,
        slot_bytes=slots,
        resident_bytes=local + slots,
        saved_bytes=total - local - slots,
        padding_bytes=local + slots - unpadded,
        gather_recv_bytes_per_forward=(n - 1) * local,
        non_target_bytes=non_target_bytes,
    )


def account(manifest: Manifest, non_target_bytes: int = 0, num_slots: int = 2, *,
            aliased_own_chunk: bool = False) -> MemoryAccount:
    """Per-rank memory and gather traffic of a converted directory's manifest (see `account_layers`).

    resident = R/N + num_slots·max|T| (copy) or R/N + num_slots·(N−1)/N·max|T| (aliased own chunk).

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord, Manifest
    >>> lay = plan_layer(1, [TensorSpec("layers.1.w", "BF16", (64, 64))], world_size=4)
    >>> m = Manifest(4, tuple(f"shards/{i}.bin" for i in range(4)), (LayerRecord.from_layout(lay, 0),))
    >>> a = account(m)
    >>> a.sharded_bytes, a.local_chunk_bytes, a.gather_recv_bytes_per_forward
    (8192, 2048, 6144)
    """
    n = manifest.world_size
    return account_layers([unaligned_total_bytes(r.entries, n) for r in manifest.layers], n, num_slots=num_slots,
                          chunk_alignment=manifest.chunk_alignment, aliased_own_chunk=aliased_own_chunk,
                          non_target_bytes=non_target_bytes)


def draft_account(manifest: Manifest, num_slots: int = 2, *, aliased_own_chunk: bool = False,
                  target: Manifest | None = None) -> dict[str, Any] | None:
    """What sharding the draft's layers adds to sharding the target's, per rank; None without a draft.

    The draft's layers gather into the target's slots, so they add their chunks and, only where a draft layer is
    larger than every target layer, slot bytes: `saved_bytes` is the draft's R − R/N less that; `target_saved_bytes`
    what the target's layers save alone. An MTP draft's target is the rest of its manifest. A draft model from its
    own checkpoint (DFlash, EAGLE-3: every layer of `manifest`) is counted beside `target`, its target's manifest,
    when given; without it its target is not known: the figures assume the target's slots hold the draft's largest
    layer (`max_layer_bytes`; it adds its chunks alone), `target_saved_bytes` is None, and `own_slots_saved_bytes`
    is what it would save gathered into slots of its own.

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord, Manifest
    >>> from shardprep.manifests.draft_layers import DraftLayers
    >>> lays = [plan_layer(i, [TensorSpec(f"layers.{i}.w", "BF16", (64, 64))], world_size=4) for i in (1, 2, 3)]
    >>> m = Manifest(4, tuple(f"shards/{i}.bin" for i in range(4)), tuple(LayerRecord.from_layout(x, 0) for x in lays),
    ...              draft=DraftLayers("mtp", (3,)))
    >>> d = draft_account(m)
    >>> d["sharded_bytes"], d["resident_bytes"], d["saved_bytes"]
    (8192, 2048, 6144)
    """
    draft = manifest.draft
    if draft is None:
        return None
    if draft.is_model:
        return _draft_model_account(manifest, num_slots, aliased_own_chunk, target)
    whole = account(manifest, num_slots=num_slots, aliased_own_chunk=aliased_own_chunk)
    alone = account(manifest.without_draft(), num_slots=num_slots, aliased_own_chunk=aliased_own_chunk)
    return {"kind": draft.kind, "layers": list(draft.layers),
            "sharded_bytes": whole.sharded_bytes - alone.sharded_bytes,
            "resident_bytes": whole.resident_bytes - alone.resident_bytes,
            "saved_bytes": whole.saved_bytes - alone.saved_bytes,
            "target_saved_bytes": alone.saved_bytes}


def _draft_model_account(manifest: Manifest, num_slots: int, aliased_own_chunk: bool,
                         target: Manifest | None) -> dict[str, Any]:
    draft = manifest.draft
    assert draft is not None and draft.target is not None
    own = account(manifest, num_slots=num_slots, aliased_own_chunk=aliased_own_chunk)
    facts = {"kind": draft.kind, "layers": list(draft.layers), "target": draft.target.record(),
             "max_layer_bytes": own.max_layer_bytes, "own_slots_saved_bytes": own.saved_bytes}
    if target is None:
        return {**facts, "sharded_bytes": own.sharded_bytes, "resident_bytes": own.local_chunk_bytes,
                "saved_bytes": own.sharded_bytes - own.local_chunk_bytes, "target_saved_bytes": None}
    n = manifest.world_size
    if target.world_size != n:
        raise ShardprepError(f"the draft was converted for {n} ranks and its target for {target.world_size}: a draft "
                             "gathers with its target, so convert both for the same N (or `shardprep reshard` one)")
    target_bytes = [unaligned_total_bytes(r.entries, n) for r in target.layers]
    draft_bytes = [unaligned_total_bytes(r.entries, n) for r in manifest.layers]
    return {**facts, **draft_saving(target_bytes, target.chunk_alignment, draft_bytes, manifest.chunk_alignment, n,
                                    num_slots=num_slots, aliased_own_chunk=aliased_own_chunk)}


def draft_saving(target_bytes: Sequence[int], target_alignment: int, draft_bytes: Sequence[int], draft_alignment: int,
                 world_size: int, *, num_slots: int = 2, aliased_own_chunk: bool = False) -> dict[str, int]:
    """What a draft model's layers of these |T| add per rank, gathered in the slots of a target's layers of these
    |T| (each converted with its own chunk alignment): `sharded_bytes`, `resident_bytes` (its chunks, and slot bytes
    only where its largest layer is larger than the target's), `saved_bytes`, and `target_saved_bytes`.

    >>> d = draft_saving([8192] * 3, 16, [4096], 16, 4)
    >>> d["resident_bytes"], d["saved_bytes"], d["target_saved_bytes"]
    (1024, 3072, 2048)
    >>> draft_saving([4096] * 3, 16, [8192], 16, 4)["resident_bytes"]  # its layer is larger: the slots grow
    10240
    """
    sizes = [*target_bytes, *draft_bytes]
    alignments = [target_alignment] * len(target_bytes) + [draft_alignment] * len(draft_bytes)
    both = account_layers(sizes, world_size, num_slots=num_slots, chunk_alignment=alignments,
                          aliased_own_chunk=aliased_own_chunk)
    alone = account_layers(target_bytes, world_size, num_slots=num_slots, chunk_alignment=target_alignment,
                           aliased_own_chunk=aliased_own_chunk)
    return {"sharded_bytes": both.sharded_bytes - alone.sharded_bytes,
            "resident_bytes": both.resident_bytes - alone.resident_bytes,
            "saved_bytes": both.saved_bytes - alone.saved_bytes, "target_saved_bytes": alone.saved_bytes}


def unaligned_total_bytes(entries: Sequence[Entry], world_size: int) -> int:
    """|T| of a layer's entries at `world_size` as the 16-byte rule lays it out, before any chunk alignment.

    What `account_layers` takes: it pads C to the chunk alignment itself, so that the padding an alignment
    adds is counted as padding, not as sharded weights. The entries' offsets do not depend on N.

    >>> from shardprep.manifests import plan_layer, TensorSpec
    >>> lay = plan_layer(1, [TensorSpec("layers.1.w", "BF16", (40,))], world_size=4, chunk_alignment=4096)
    >>> lay.total_bytes, unaligned_total_bytes(lay.entries, 4)
    (16384, 128)
    """
    return world_size * align_up(-(-used_bytes(entries) // world_size), ENTRY_ALIGNMENT)


def zero_copy_applies(chunk_alignment: int, device_type: str = "cuda") -> bool:
    """Whether a rank's own chunk can be mapped into its layer view (CUDA, chunks aligned to 2 MiB or more).

    >>> zero_copy_applies(2 << 20), zero_copy_applies(4096), zero_copy_applies(2 << 20, "cpu")
    (True, False, False)
    """
    return device_type == "cuda" and chunk_alignment >= ZERO_COPY_MIN_ALIGNMENT


def break_even_layers(world_size: int, num_slots: int = 2, aliased_own_chunk: bool = False) -> float:
    """Sharded layers of equal size at which the saving is exactly zero; more layers save memory.

    L·|T|·(N−1)/N = S·|T| (copy) or S·(N−1)/N·|T| (aliased): L = S·N/(N−1), or S.

    >>> break_even_layers(2), break_even_layers(8), break_even_layers(2, aliased_own_chunk=True)
    (4.0, 2.2857142857142856, 2.0)
    """
    if world_size < 2:
        return math.inf
    return float(num_slots) if aliased_own_chunk else num_slots * world_size / (world_size - 1)


def human_bytes(n: float) -> str:
    """A byte count in binary units, as every shardprep report prints it.

    >>> human_bytes(1536), human_bytes(-49152), human_bytes(512)
    ('1.50 KiB', '-48.00 KiB', '512 B')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
