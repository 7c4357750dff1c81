"""The plugin's options, read from vLLM's `model_loader_extra_config` (a JSON dict)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...errors import ShardprepError


@dataclass(frozen=True)
class ShardprepLoadOptions:
    """What `--load-format shardprep` does with an output directory.

    - `verify`: check the checksum of everything read (default on).
    - `shard_weights`: sharded mode: each data-parallel rank keeps only its own rank file and gathers
      every sharded layer before it runs; off (full mode), every worker rebuilds the full weights.
    """

    verify: bool = True
    shard_weights: bool = False

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ShardprepLoadOptions:
        """Parse `model_loader_extra_config`; an unknown key or a non-boolean value is refused.

        >>> ShardprepLoadOptions.from_extra_config({"shard_weights": True})
        ShardprepLoadOptions(verify=True, shard_weights=True)
        """
        known = {f.name for f in fields(cls)}
        extra = dict(extra or {})
        for key, value in extra.items():
            if key not in known:
                raise ShardprepError(f"model_loader_extra_config: unknown key {key!r} for load format shardprep; "
                                     f"expected {sorted(known)}")
            if not isinstance(value, bool):
                raise ShardprepError(f"model_loader_extra_config: {key!r} must be true or false, got {value!r}")
        return cls(**extra)
