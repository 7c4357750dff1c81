"""The scales of quantized targets, which stay replicated on disk and which a server's sharded mode gathers anyway.

A quantized target's module has tensors beside the weight the preset takes: block FP8's `weight_scale_inv`,
compressed-tensors' `weight_scale` and `weight_shape`. They stay in the replicated part (docs/format.md); vLLM's
sharded mode processes each quantized layer at load and gathers weight and scales together
(docs/serving/models.md, "Quantized targets"), so per layer it gathers |T| plus those scales. `quantized_scales`
finds them from the replicated files' headers (no tensor data is read).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import IntegrityError
from ..manifests.manifest import Manifest
from ..manifests.replicated import NOTICE_FILE, check_replicated_file, read_replicated_index
from ..manifests.safetensors_header import read_safetensors_header
from .selection import QUANTIZED_WEIGHTS

WEIGHT_NAMES = ("weight", *QUANTIZED_WEIGHTS)
"""What a preset takes of a quantized module."""
COMPANIONS = ("weight_scale_inv", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx", "input_scale")
"""The tensors a quantized module keeps beside its weight, as block-FP8 and compressed-tensors checkpoints name them."""


@dataclass(frozen=True)
class QuantizedScales:
    """The companions of the quantized targets: how many targets have some, and their bytes per layer."""

    targets: int
    bytes_by_layer: dict[int, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_layer.values())


def quantized_scales(directory: str | Path, manifest: Manifest) -> QuantizedScales:
    """The replicated scales of `manifest`'s quantized targets (a target `P.weight` whose module P has a
    `P.weight_scale_inv`, ...), from the headers of DIR's replicated files; no targets quantized: zero of them.

    >>> quantized_scales("out/", load_manifest("out/")).total_bytes  # doctest: +SKIP
    """
    modules: dict[str, int] = {}  # module name → its layer, for targets named like a quantized module's weight
    for record in manifest.layers:
        for entry in record.entries:
            module, _, last = entry.name.rpartition(".")
            if last in WEIGHT_NAMES:
                modules[module] = record.layer
    try:
        index, _ = read_replicated_index(directory, manifest, verify=False)
    except IntegrityError as exc:
        if exc.code == "missing_file":
            return QuantizedScales(0, {})
        raise
    by_layer: dict[int, int] = {}
    found: set[str] = set()
    for name in index.files():
        if name == NOTICE_FILE:
            continue
        header = read_safetensors_header(check_replicated_file(directory, manifest, name, verify=False))
        for tensor, info in header.tensors.items():
            module, _, last = tensor.rpartition(".")
            if last in COMPANIONS and module in modules:
                layer = modules[module]
                by_layer[layer] = by_layer.get(layer, 0) + info.nbytes
                found.add(module)
    return QuantizedScales(len(found), by_layer)
