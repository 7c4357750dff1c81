"""Whether a checkpoint is block FP8, from its config.json and its tensor names. Pure: no tensors are read."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import RequantError

SUPPORTED_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"


@dataclass
class BlockFP8Info:
    """A block-FP8 checkpoint: its block shape, its declared scale format, and its quantized weights.

    `scale_fmt` is config's `quantization_config.scale_fmt` ("ue8m0" where the checkpoint says its scales
    are already powers of two), or None. `weight_names` lists every "X.weight" that has an
    "X.weight_scale_inv", in the order the names were given.
    """

    block: tuple[int, int]
    scale_fmt: str | None
    weight_names: list[str] = field(default_factory=list)


def detect_block_fp8(config: dict, tensor_names: Iterable[str]) -> BlockFP8Info | None:
    """Block-FP8 information for a checkpoint, or None when its config declares no block-FP8 quantization.

    Block FP8 means `quantization_config` with `quant_method == "fp8"` and a `weight_block_size`; only
    [128, 128] is supported. Raises RequantError for another block size or format, for a scale with no
    weight, or for a config that declares block FP8 over a checkpoint that has no `*.weight_scale_inv`.

    >>> config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    >>> detect_block_fp8(config, ["a.weight", "a.weight_scale_inv", "norm.weight"]).weight_names
    ['a.weight']
    >>> detect_block_fp8({}, ["a.weight"]) is None
    True
    """
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise RequantError(f"config.json: quantization_config is a {type(quant).__name__}, not an object")
    if not quant or quant.get("quant_method") != "fp8" or quant.get("weight_block_size") is None:
        # Not block FP8 (unquantized, another method, or per-tensor FP8): nothing to requantize.
        return None
    block = quant["weight_block_size"]
    block = tuple(block) if isinstance(block, (list, tuple)) else (block,)
    if block != SUPPORTED_BLOCK:
        raise RequantError(
            f"config.json: quantization_config.weight_block_size is {list(block)}; only "
            f"{list(SUPPORTED_BLOCK)} blocks can be requantized to UE8M0 (DeepGEMM's block shape)")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise RequantError(f"config.json: quantization_config.fmt is {fmt!r}; only 'e4m3' block FP8 is supported")

    names = list(dict.fromkeys(tensor_names))
    present = set(names)
    orphans = [n for n in names if n.endswith(".weight" + SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] not in present]
    if orphans:
        raise RequantError(f"tensor {orphans[0]!r} has no weight {orphans[0][: -len(SCALE_SUFFIX)]!r} next to it; "
                           f"the checkpoint is incomplete")
    weight_names = [n for n in names if n.endswith(".weight") and n + SCALE_SUFFIX in present]
    if not weight_names:
        raise RequantError("config.json declares block FP8 (quantization_config) but no tensor has a "
                           "'*.weight_scale_inv'; if the weights were dequantized, remove quantization_config")
    return BlockFP8Info(block=SUPPORTED_BLOCK, scale_fmt=quant.get("scale_fmt"), weight_names=weight_names)
