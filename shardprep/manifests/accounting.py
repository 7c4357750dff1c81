"""Memory and communication accounting for a manifest (pure arithmetic, used by `inspect`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .layout import alignment_padding_bytes, used_bytes
from .manifest import Manifest


@dataclass(frozen=True)
class MemoryAccount:
    """Per-rank bytes with and without sharding.

    `sharded_bytes` is R, the target bytes every rank would otherwise hold in full (padding included).
    """

    world_size: int
    num_slots: int
    sharded_bytes: int
    max_layer_bytes: int
    local_chunk_bytes: int
    slot_bytes: int
    resident_bytes: int
    saved_bytes: int
    gather_recv_bytes_per_forward: int
    non_target_bytes: int
    alignment_padding_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def account(manifest: Manifest, non_target_bytes: int = 0, num_slots: int = 2) -> MemoryAccount:
    """Per-rank memory and AllGather traffic of a sharded deployment.

    resident = R/N + num_slots·max|T|; received per forward = (N−1)/N·Σ|T|. `alignment_padding_bytes`
    is the padding in each rank's file and device buffer (docs/format.md, "Chunk alignment").

    >>> from shardprep.manifests import plan_layer, TensorSpec, LayerRecord, Manifest
    >>> lay = plan_layer(1, [TensorSpec("layers.1.w", "BF16", (64, 64))], world_size=4)
    >>> m = Manifest(4, tuple(f"shards/{i}.bin" for i in range(4)), (LayerRecord.from_layout(lay, 0),))
    >>> a = account(m)
    >>> a.sharded_bytes, a.local_chunk_bytes, a.gather_recv_bytes_per_forward
    (8192, 2048, 6144)
    """
    n = manifest.world_size
    total = sum(r.total_bytes for r in manifest.layers)
    local = sum(r.chunk_bytes for r in manifest.layers)
    max_t = manifest.max_total_bytes
    slots = min(num_slots, len(manifest.layers)) * max_t
    resident = local + slots
    return MemoryAccount(
        world_size=n,
        num_slots=num_slots,
        sharded_bytes=total,
        max_layer_bytes=max_t,
        local_chunk_bytes=local,
        slot_bytes=slots,
        resident_bytes=resident,
        saved_bytes=total - resident,
        gather_recv_bytes_per_forward=total - local,
        non_target_bytes=non_target_bytes,
        alignment_padding_bytes=alignment_padding_bytes(
            manifest.rank_file_bytes, manifest.rank_header_json_bytes,
            [used_bytes(r.entries) for r in manifest.layers], n),
    )
