"""What sharding buys one rank: KV-cache tokens, concurrent requests, and what its startup peaks at.

Pure arithmetic over a `MemoryAccount` (the targets' bytes) and a `KvCacheShape` (bytes per token).
The replicated part is everything a rank holds whole either way: the non-target tensors plus the
targets of layers left unsharded. Activations and the server's workspace are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .accounting import MemoryAccount
from .kv_cache import KvCacheShape

STAGING_BYTES = 64 << 20
"""Host memory `open_rank` stages each rank's file through on its way to the GPU (pinned, two halves)."""


@dataclass(frozen=True)
class Capacity:
    """Per rank: the KV tokens and requests the saved memory holds, the startup peak, and (given the HBM
    size) the room left for the KV cache with and without sharding. `replicated_part_bytes` is what every
    GPU holds whole; `expert_shard_bytes` the routed experts it holds under expert parallelism."""

    saved_bytes: int
    kv_bytes_per_token: int | None
    kv_tokens: int | None
    context_len: int | None
    extra_requests: int | None
    replicated_part_bytes: int
    expert_shard_bytes: int
    startup_peak_bytes: int
    staging_bytes: int
    hbm_bytes: int | None
    kv_room_replicated_bytes: int | None
    kv_room_sharded_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def capacity(memory: MemoryAccount, kv: KvCacheShape | None, *, replicated_part_bytes: int,
             context_len: int | None = None, hbm_bytes: int | None = None,
             rank_file_bytes: int | None = None, expert_shard_bytes: int = 0) -> Capacity:
    """Per-rank figures of a sharded layer set (see the module docstring).

    startup peak (device) = R/N + slots + replicated part + expert shard: the loader reads the rank file straight into
    the memory it is gathered from, so R/N is never held twice; the host stages through STAGING_BYTES
    (pinned). `rank_file_bytes`, when known (a converted directory), replaces R/N: the device buffer
    holds the whole file, its header and the gaps between chunks included.
    KV room = HBM − what the weights take (replicated: R + replicated part + expert shard), floored at 0.
    `expert_shard_bytes` is the routed experts one GPU holds under expert parallelism (expert_parallel.py),
    kept out of the replicated part; 0 where they are counted in it (no expert parallelism).

    >>> from shardprep.planning.accounting import account_layers
    >>> kv = KvCacheShape("mha", layers=2, values_per_layer=64, dtype="bf16", dtype_bytes=2)
    >>> c = capacity(account_layers([1 << 20] * 8, 2), kv, replicated_part_bytes=0, context_len=1024)
    >>> c.saved_bytes, c.kv_tokens, c.extra_requests
    (2097152, 8192, 8)
    """
    kv_tokens = kv.tokens(memory.saved_bytes) if kv else None
    shards = memory.local_chunk_bytes if rank_file_bytes is None else rank_file_bytes
    peak = shards + memory.slot_bytes + replicated_part_bytes + expert_shard_bytes
    replicated = memory.sharded_bytes + replicated_part_bytes + expert_shard_bytes
    return Capacity(
        saved_bytes=memory.saved_bytes,
        kv_bytes_per_token=kv.bytes_per_token if kv else None,
        kv_tokens=kv_tokens,
        context_len=context_len,
        extra_requests=kv_tokens // context_len if kv_tokens is not None and context_len else None,
        replicated_part_bytes=replicated_part_bytes,
        expert_shard_bytes=expert_shard_bytes,
        startup_peak_bytes=peak,
        staging_bytes=STAGING_BYTES,
        hbm_bytes=hbm_bytes,
        kv_room_replicated_bytes=None if hbm_bytes is None else max(0, hbm_bytes - replicated),
        kv_room_sharded_bytes=None if hbm_bytes is None else max(0, hbm_bytes - peak),
    )
