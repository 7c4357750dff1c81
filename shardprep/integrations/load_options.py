"""The load format's options, read from the server's `model_loader_extra_config` (a JSON dict; vLLM and SGLang
spell it the same way, `--model-loader-extra-config` on their command lines)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ShardprepError


@dataclass(frozen=True)
class ShardprepLoadOptions:
    """What `--load-format shardprep` does with an output directory.

    - `verify`: check the checksum of everything read (default on).
    - `shard_weights`: sharded mode: each data-parallel rank keeps only its own rank file and gathers
      every sharded layer before it runs; off (full mode), every worker rebuilds the full weights.
    - `shard_group_size` (sharded mode): the DP ranks that gather together, N consecutive ones; it
      must be the manifest's N (given, it documents the deployment and is checked). None: the manifest's.
    - `allow_cross_node_groups` (sharded mode): accept a shard group whose DP ranks run on several nodes.
    """

    verify: bool = True
    shard_weights: bool = False
    shard_group_size: int | None = None
    allow_cross_node_groups: bool = False

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ShardprepLoadOptions:
        """Parse `model_loader_extra_config`; an unknown key or a value of the wrong type is refused.

        >>> ShardprepLoadOptions.from_extra_config({"shard_weights": True, "shard_group_size": 8})
        ShardprepLoadOptions(verify=True, shard_weights=True, shard_group_size=8, allow_cross_node_groups=False)
        """
        known = {f.name for f in fields(cls)}
        extra = dict(extra or {})
        for key, value in extra.items():
            if key not in known:
                raise ShardprepError(f"model_loader_extra_config: unknown key {key!r} for load format shardprep; "
                                     f"expected {sorted(known)}")
            if key == "shard_group_size":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ShardprepError(f"model_loader_extra_config: 'shard_group_size' must be a whole number "
                                         f">= 1 (the manifest's N), got {value!r}")
            elif not isinstance(value, bool):
                raise ShardprepError(f"model_loader_extra_config: {key!r} must be true or false, got {value!r}")
        return cls(**extra)
