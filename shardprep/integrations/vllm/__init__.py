"""vLLM integration: `--load-format shardprep` serves a `shardprep convert` output directory.

Installing shardprep next to vLLM registers it: the `vllm.general_plugins` entry point (pyproject.toml)
calls `register()` in every vLLM process. Importing this package does not import vLLM.

    LLM(model="out/", load_format="shardprep")                                   # full mode
    LLM(model="out/", load_format="shardprep", enforce_eager=True,
        model_loader_extra_config={"shard_weights": True})                       # sharded mode, DP = N

See docs/serving/vllm.md.
"""

from __future__ import annotations


def register() -> None:
    """vLLM's plugin hook: register the load format "shardprep" (harmless when called again)."""
    from .adapter import register_load_format
    from .cpu_workarounds import request_amx_tile_state
    from .model_loader import ShardprepModelLoader

    request_amx_tile_state()
    register_load_format(ShardprepModelLoader)
