"""shardprep: pre-shard the weights every GPU would otherwise replicate, and gather them back layer by layer.

Offline: `convert` a HF safetensors checkpoint into per-rank flat chunks plus a manifest, `validate`
and `inspect` the result. Online: `loader.open_rank` maps one rank's file, `runtime.LayerGatherer`
rebuilds each layer's weights with one AllGather, one layer ahead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ShardprepError

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .loader.convert import ConvertSummary, convert
    from .loader.inspect_dir import inspect
    from .loader.validate import ValidationReport, validate

_LAZY = {
    "convert": ("shardprep.loader.convert", "convert"),
    "ConvertSummary": ("shardprep.loader.convert", "ConvertSummary"),
    "validate": ("shardprep.loader.validate", "validate"),
    "ValidationReport": ("shardprep.loader.validate", "ValidationReport"),
    "inspect": ("shardprep.loader.inspect_dir", "inspect"),
}


def __getattr__(name: str) -> Any:
    # torch is imported only when a function that needs it is first used, so `shardprep --help` is fast.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'shardprep' has no attribute {name!r}")


__all__ = ["ConvertSummary", "ShardprepError", "ValidationReport", "__version__", "convert", "inspect", "validate"]
