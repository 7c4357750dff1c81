"""shardprep: pre-shard the weights every GPU would otherwise replicate, and gather them back layer by layer.

Offline (`shardprep.prep`, no torch needed): `convert` a HF safetensors checkpoint into per-rank flat
chunks plus a manifest, `validate` and `inspect` the result, `reshard` it for another number of ranks,
`export` it as a plain HF checkpoint.
Startup (`shardprep.loader`): `open_rank` maps one rank's file into one device buffer. Runtime
(`shardprep.runtime`): `LayerGatherer` rebuilds each layer's weights with one AllGather, one layer
ahead; `bind` points a model at them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import ShardprepError

if TYPE_CHECKING:
    from .prep.convert import ConvertSummary, convert
    from .prep.export import ExportSummary, export
    from .prep.inspect import inspect
    from .prep.requant_jobs import RequantOptions
    from .prep.reshard import ReshardSummary, reshard
    from .prep.validate import ValidationReport, validate

_LAZY = {
    "convert": ("shardprep.prep.convert", "convert"),
    "ConvertSummary": ("shardprep.prep.convert", "ConvertSummary"),
    "validate": ("shardprep.prep.validate", "validate"),
    "ValidationReport": ("shardprep.prep.validate", "ValidationReport"),
    "inspect": ("shardprep.prep.inspect", "inspect"),
    "RequantOptions": ("shardprep.prep.requant_jobs", "RequantOptions"),
    "reshard": ("shardprep.prep.reshard", "reshard"),
    "ReshardSummary": ("shardprep.prep.reshard", "ReshardSummary"),
    "export": ("shardprep.prep.export", "export"),
    "ExportSummary": ("shardprep.prep.export", "ExportSummary"),
}


def __getattr__(name: str) -> Any:
    # torch is imported only when a function that needs it is first used, so `shardprep --help` is fast.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'shardprep' has no attribute {name!r}")


__all__ = ["ConvertSummary", "ExportSummary", "RequantOptions", "ReshardSummary", "ShardprepError", "ValidationReport",
           "__version__", "convert", "export", "inspect", "reshard", "validate"]
