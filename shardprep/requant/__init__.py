"""Block-FP8 to UE8M0 requantization, as a pure tensor transform, and detection of block-FP8 checkpoints.

Detection is pure Python; the transform needs torch, which is imported on first use so that
converting a checkpoint that needs no requantization never pays for it.
"""

from __future__ import annotations

from typing import Any

from .detect import BlockFP8Info, detect_block_fp8

RECIPES = ("sglang", "fp32")
_LAZY = {"ceil_pow2_exponent", "requant_ue8m0", "scale_to_e8m0", "scales_are_pow2"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import ue8m0

        return getattr(ue8m0, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "RECIPES", "BlockFP8Info", "ceil_pow2_exponent", "detect_block_fp8", "requant_ue8m0", "scale_to_e8m0",
    "scales_are_pow2",
]
