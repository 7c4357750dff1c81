"""Block-FP8 to UE8M0 requantization, as a pure tensor transform, and detection of block-FP8 checkpoints."""

from .detect import BlockFP8Info, detect_block_fp8
from .ue8m0 import RECIPES, ceil_pow2_exponent, requant_ue8m0, scale_to_e8m0, scales_are_pow2

__all__ = [
    "RECIPES", "BlockFP8Info", "ceil_pow2_exponent", "detect_block_fp8", "requant_ue8m0", "scale_to_e8m0",
    "scales_are_pow2",
]
