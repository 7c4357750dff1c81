"""What every server's full mode reads: the source checkpoint's tensors, rebuilt from a convert output, and the
check that the model got all of them. Server-agnostic (no server is imported); each server's loader feeds these
to its own `model.load_weights`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from ..errors import ShardprepError
from ..loader.full_targets import iter_full_targets
from ..loader.rank_shards import load_replicated
from ..manifests.manifest import load_manifest
from ..manifests.swap_lock import reads_output


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


def check_all_loaded(model: nn.Module, loaded: Iterable[str] | None, directory: str | Path,
                     also: Collection[str] = ()) -> None:
    """Refuse a model with a parameter that is neither in `loaded` (what load_weights reported) nor in `also`.

    A model whose load_weights reports nothing (None) cannot be checked and passes.

    >>> check_all_loaded(model, model.load_weights(weights), "out/")  # doctest: +SKIP
    """
    if loaded is None:
        return
    missing = sorted({name for name, _ in model.named_parameters()} - set(loaded) - set(also))
    if missing:
        more = f" (and {len(missing) - 1} more)" if missing[1:] else ""
        raise ShardprepError(f"{directory}: the model's parameter {missing[0]!r}{more} is in no tensor of the "
                             "output; was it converted from this model?")

