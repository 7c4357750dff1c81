"""CPU cost of the block-FP8 -> UE8M0 requant: the compiled code (AVX2 and scalar lookups) against numpy.

    python3 benchmarks/bench_requant.py [--rows 4096 --cols 7168] [--repeat 7]

CPU time (`time.process_time`, one thread, best of --repeat) per byte of fp8 codes, for one weight of
--rows x --cols with random codes and non-power-of-two scales, recipe "sglang"; and per weight for
a run of 128x128 weights (the per-tensor cost --many-tensors in bench_convert.py exercises). Every
path is checked to give the same bytes before it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardprep.requant import lookup  # noqa: E402


def best_cpu(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--small", type=int, default=2000, help="128x128 weights for the per-weight figure")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (args.rows, args.cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    scale = (rng.random((-(-args.rows // 128), -(-args.cols // 128)), dtype=np.float32) * 1e-3 + 1e-4)
    rows, cols = codes.shape
    compiled = lookup.compiled
    paths = {"numpy": lambda: lookup.requant_codes(codes, scale, "sglang", use_compiled=False)}
    if compiled is not None:
        def run(avx2: bool):
            q, sf = np.empty_like(codes), np.empty_like(scale)
            assert compiled.requant_matrix(codes, rows, cols, scale, True, q, sf, avx2)
            return q, sf
        paths["compiled (AVX2 where the CPU has it)"] = lambda: run(True)
        paths["compiled, scalar lookups"] = lambda: run(False)
    reference = paths["numpy"]()
    assert reference is not None
    for name, fn in paths.items():
        q, sf = fn()
        assert np.array_equal(q, reference[0]) and np.array_equal(sf, reference[1]), name
    result: dict = {"rows": rows, "cols": cols, "compiled_built": compiled is not None, "ns_per_byte": {},
                    "us_per_128x128_weight": {}}
    print(f"one {rows}x{cols} weight, CPU ns per byte of codes (best of {args.repeat}):")
    for name, fn in paths.items():
        ns = best_cpu(fn, args.repeat) / codes.size * 1e9
        result["ns_per_byte"][name] = ns
        print(f"  {name:40s} {ns:6.2f} ns/B  ({1 / ns:.2f} GB/s)")
    small = [rng.integers(0, 0x7E, (128, 128), dtype=np.uint8) for _ in range(args.small)]
    small_scale = np.full((1, 1), 3e-4, np.float32)
    print(f"{args.small} weights of 128x128, CPU us per weight (lookup.requant_codes, best of {args.repeat}):")
    for name, use in (("numpy", False), ("compiled", True)):
        if use and compiled is None:
            continue
        def run_small(use: bool = use) -> None:
            for c in small:
                lookup.requant_codes(c, small_scale, "sglang", use_compiled=use)
        seconds = best_cpu(run_small, args.repeat)
        result["us_per_128x128_weight"][name] = seconds / args.small * 1e6
        print(f"  {name:40s} {seconds / args.small * 1e6:6.1f} us")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
