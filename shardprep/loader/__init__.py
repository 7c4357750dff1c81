"""Startup loading: open one rank's file of an output directory into one device buffer (`open_rank`).

>>> from shardprep.loader import open_rank  # doctest: +SKIP
"""

from .rank_shards import RankShards, copy_through_staging, iter_replicated, load_replicated, open_rank

__all__ = ["RankShards", "copy_through_staging", "iter_replicated", "load_replicated", "open_rank"]
