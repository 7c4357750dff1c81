"""Full mode, for every server: the source checkpoint's tensors, rebuilt from a convert output, fed to the server's
own `model.load_weights`, and the check that the model got all of them. Nothing here imports or names a server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..loader.full_targets import iter_full_targets
from ..loader.rank_shards import load_replicated
from ..manifests.manifest import load_manifest
from ..manifests.swap_lock import reads_output
from .load_check import check_all_loaded, tracked_loading
from .server import ServerAdapter


@reads_output  # the replicated part and the targets of one output, while --overwrite replaces it
def output_weights(directory: str | Path, verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the source checkpoint, read from a convert output.

    The non-targets come from the output's safetensors files, the targets are rebuilt layer by layer
    from all rank files (with `verify`, every file's and chunk's checksum is checked before it is used).

    >>> model.load_weights(output_weights("out/"))  # doctest: +SKIP
    """
    manifest = load_manifest(directory)
    yield from load_replicated(directory, manifest, "cpu", verify).items()
    yield from iter_full_targets(directory, verify=verify, manifest=manifest)


def load_full(model: nn.Module, directory: str | Path, verify: bool, adapter: ServerAdapter) -> None:
    """Full mode: the server's own `model.load_weights` fed every tensor of the source checkpoint, rebuilt from DIR,
    under its checkpoint name, so tensor parallelism, fused parameters and quantization are the server's as usual;
    then every parameter must have been loaded or defaulted by the server (load_check.py).

    >>> load_full(model, "out/", True, VllmAdapter())  # doctest: +SKIP
    """
    with tracked_loading(model, adapter.default_weight_loader()) as seen:
        loaded = model.load_weights(output_weights(directory, verify))  # type: ignore[operator]
    check_all_loaded(model, loaded, directory, also=adapter.defaulted_parameters(model), seen=seen)
