"""Check that requant_ue8m0 gives the same bytes on CUDA as on the CPU.

Run from the repository root on a machine with a GPU:

    python3 benchmarks/check_requant_gpu.py

Requantizes random block-FP8 tensors (2-D and 3-D, with tails, all-zero blocks, non-power-of-two scales,
extreme scales, amax exactly at and just above 448 * 2^k) with both recipes on both devices and compares the
outputs byte for byte. Prints one line per case and two informational lines on the float32 operations
that differ between devices. Exits 1 on any mismatch, 0 otherwise; without CUDA it says so and exits 0.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardprep.requant import ceil_pow2_exponent, requant_ue8m0  # noqa: E402

FP8 = torch.float8_e4m3fn


def random_case(shape: tuple[int, ...], seed: int, log_scale_range=(-14.0, -2.0)):
    gen = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    weight = (torch.randn(shape, generator=gen) * 120).clamp(-448, 448).to(FP8)
    scale_shape = (*lead, math.ceil(n / 128), math.ceil(k / 128))
    scale = torch.empty(scale_shape).uniform_(*log_scale_range, generator=gen).exp()
    return weight, scale


def zero_blocks_case():
    weight, scale = random_case((384, 300), seed=3)
    weight[:128, :128] = 0  # all-zero block: scale 2^-22
    scale[1, 1] = 1e-12  # amax under the 1e-4 floor
    return weight, scale


def pow2_edges_case():
    """Blocks whose maximum is exactly 448 * 2^k, and a few float32 ulps above it (the fp32 recipe's only
    window where torch.log2 would disagree with exponent bits)."""
    weight = torch.zeros(128 * 4, 128 * 8)
    weight[::128, ::128] = 448.0
    k = torch.arange(-24, 8, dtype=torch.float32).view(4, 8)
    bits = torch.pow(2.0, k).view(torch.int32) + torch.arange(32, dtype=torch.int32).view(4, 8) % 4
    return weight.to(FP8), bits.view(torch.float32)


def bf16_scales_case():
    weight, scale = random_case((300, 300), seed=6)
    return weight, scale.to(torch.bfloat16)


CASES = {
    "2d-aligned": lambda: random_case((512, 384), seed=1),
    "2d-tails": lambda: random_case((300, 200), seed=2),
    "3d-experts-tails": lambda: random_case((8, 200, 136), seed=4),
    "zero-blocks": zero_blocks_case,
    # Down to e^-90: products of small codes and small scales are float32 subnormals.
    "extreme-scales": lambda: random_case((640, 640), seed=5, log_scale_range=(-90.0, 75.0)),
    "pow2-edges": pow2_edges_case,
    "bf16-scales": lambda: bf16_scales_case(),
    "2d-large-multipass": lambda: random_case((4096, 7168), seed=7),
}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many bytes differ (0 when identical)."""
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def device_differences() -> tuple[str, str]:
    """What the requantization avoids: float32 ops whose last bit or rounding depends on the device."""
    amax = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)  # every float of [1, 2)
    cpu_q, cuda_q = amax / 448.0, (amax.cuda() / 448.0).cpu()
    division = (f"info: amax / 448.0 differs between cpu and cuda in {int((cpu_q != cuda_q).sum())} of "
                f"{amax.numel()} quotients; ceil power of two differs in "
                f"{int((ceil_pow2_exponent(cpu_q) != ceil_pow2_exponent(cuda_q)).sum())}")
    window = torch.cat([(torch.tensor(448.0 * 2.0**k).view(torch.int32) + torch.arange(64, dtype=torch.int32))
                        for k in range(-22, 4)]).view(torch.float32) / 448.0
    log2_cpu = torch.ceil(torch.log2(window))
    log2_cuda = torch.ceil(torch.log2(window.cuda())).cpu()
    bits = ceil_pow2_exponent(window).float()
    log2 = (f"info: near 448 * 2^k, ceil(torch.log2) disagrees with exponent bits in "
            f"{int((log2_cpu != bits).sum())} (cpu) and {int((log2_cuda != bits).sum())} (cuda) of "
            f"{window.numel()}; cpu and cuda log2 disagree with each other in {int((log2_cpu != log2_cuda).sum())}")
    return division, log2


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device; nothing to compare (run this on a GPU machine)")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    failures = 0
    for case, make in CASES.items():
        weight, scale = make()
        for recipe in ("sglang", "fp32"):
            started = time.perf_counter()
            cpu_q, cpu_s = requant_ue8m0(weight, scale, recipe=recipe, name=case)
            cpu_time = time.perf_counter() - started
            started = time.perf_counter()
            cuda_q, cuda_s = requant_ue8m0(weight, scale, recipe=recipe, name=case, device="cuda")
            cuda_time = time.perf_counter() - started
            bad = same_bytes(cpu_q, cuda_q) + same_bytes(cpu_s, cuda_s)
            failures += bad != 0
            print(f"{'OK      ' if bad == 0 else 'MISMATCH'} {case:20s} {recipe:6s} {str(tuple(weight.shape)):16s} "
                  f"{bad} bytes differ; cpu {cpu_time * 1e3:7.1f} ms, cuda {cuda_time * 1e3:7.1f} ms")
    for line in device_differences():
        print(line)
    print(f"{failures} mismatching case(s)" if failures else "all cases byte-identical on cpu and cuda")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
