"""File I/O in both directions: reading sources, writing rank files, opening one rank's file at startup."""

from __future__ import annotations

from typing import Any

# open_rank needs torch; it is imported on first use so that `shardprep --help` stays fast.
_LAZY = {"open_rank": "rank_shards", "RankShards": "rank_shards"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RankShards", "open_rank"]
