"""Where a server's worker sits in its parallel configuration: what sharded mode needs to know, server-agnostic.

Each server's `compat.current_layout` fills one from its own config (vLLM's parallel config; SGLang's server
args), with the server's own spelling of its options, so that `sharded_mode.check_layout`'s refusals name what
the user can change in that server.

>>> ParallelLayout(dp_rank=0, dp_size=2, dp_world_ranks=(0, 1), tp_size=1, pp_size=1, lockstep_dp=True,
...                eager=True, device=torch.device("cpu"), platform="cpu").server
'vLLM'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelLayout:
    """Where this worker sits: what the loader needs to know of the server's parallel configuration."""

    dp_rank: int
    dp_size: int
    dp_world_ranks: tuple[int, ...]
    tp_size: int
    pp_size: int
    lockstep_dp: bool
    """The server runs the DP ranks in lockstep (idle ones take dummy forwards): vLLM does for MoE models only."""
    eager: bool
    device: torch.device
    platform: str
    server: str = "vLLM"
    """The server, and below how its options are spelled: refusals name what the user can change."""
    tp_option: str = "tensor_parallel_size"
    pp_option: str = "pipeline_parallel_size"
    dp_option: str = "data_parallel_size"
    dp_advice: str = "data_parallel_size={n} (or a multiple)"
    """What to launch instead of attention TP > 1 for a directory converted for `n` ranks."""
    without_lockstep: str = ("shard_weights needs a MoE model: vLLM runs the data-parallel ranks of a dense model "
                             "independently (no dummy forwards on idle ranks)")
    """The refusal's start when `lockstep_dp` is False: what sharded mode needs, and why the ranks do not step
    together."""
