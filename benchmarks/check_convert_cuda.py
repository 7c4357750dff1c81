"""`shardprep convert --device cuda` writes the same bytes as `--device cpu` (run on a GPU machine).

    python3 benchmarks/check_convert_cuda.py [--work DIR]

Builds a tiny DeepSeek-V3 checkpoint with transformers, block-FP8-quantizes it with the test fixture
(hidden 160: every weight has tail blocks), converts it twice for 4 ranks, once requantizing on the CPU
and once on CUDA, and compares every output file byte for byte. Exits 1 on any difference, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 2
    from checkpoints import make_checkpoint
    from fp8_fixture import quantize_checkpoint_fp8

    from shardprep.prep.convert import convert

    work = args.work or Path(tempfile.mkdtemp(prefix="check-convert-cuda-"))
    bf16 = make_checkpoint(work / "bf16", "deepseek-v3", hidden=160, sharded=True, tokenizer=False)
    fp8 = work / "fp8"
    quantize_checkpoint_fp8(bf16, fp8)
    outs = {}
    for device in ("cpu", "cuda"):
        outs[device] = work / f"out-{device}"
        s = convert(fp8, outs[device], 4, preset="deepseek-v3", device=device)
        print(f"convert --device {device}: {s.requantized_tensors} tensors requantized, {s.seconds:.2f} s")
    files = sorted(p.relative_to(outs["cpu"]) for p in outs["cpu"].rglob("*") if p.is_file())
    other = sorted(p.relative_to(outs["cuda"]) for p in outs["cuda"].rglob("*") if p.is_file())
    differ = [str(f) for f in files if not filecmp.cmp(outs["cpu"] / f, outs["cuda"] / f, shallow=False)]
    if files != other or differ:
        print(f"MISMATCH: files only on one side {sorted(set(map(str, files)) ^ set(map(str, other)))}, "
              f"differing {differ}")
        return 1
    print(f"OK: all {len(files)} files byte-identical ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
