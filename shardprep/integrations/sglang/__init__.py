"""SGLang integration: `--load-format shardprep` serves a `shardprep convert` output directory.

Installing shardprep next to SGLang registers it: the `sglang.srt.plugins` entry point (pyproject.toml) calls
`register()` in every SGLang process, before the server arguments are parsed. Importing this package does not
import SGLang.

    sgl.Engine(model_path="out/", load_format="shardprep")                          # full mode
    python -m sglang.launch_server --model-path out/ --load-format shardprep        # the same, served

See docs/serving/sglang.md.
"""

from __future__ import annotations


def register() -> None:
    """SGLang's plugin hook: register the load format "shardprep" (harmless when called again)."""
    from .adapter import register_load_format
    from .model_loader import ShardprepModelLoader

    register_load_format("shardprep", ShardprepModelLoader)
