"""convert vs `cp -r` of the same checkpoint, side by side in one run, with convert's peak RSS.

    python3 benchmarks/bench_convert.py --size-gb 1.2 --ranks 8 --repeat 3 [--fp8]

The checkpoint is synthetic but laid out like an HF Llama / DeepSeek export (model-0000x-of-0000y.safetensors
shards of about 500 MB plus an index). Both contenders start from a warm page cache and both end with `sync`,
so the ratio compares the work each does, not cache luck. With --fp8 the weights are block-FP8 with
non-power-of-two scales, and convert requantizes every one of them to UE8M0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONVERT = """
import json, sys, time
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so it would report the parent's size.
def vm_hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
sys.path.insert(0, {repo!r})
from shardprep.prep.convert import convert
from shardprep.prep.requant_jobs import RequantOptions
t = time.perf_counter()
s = convert({src!r}, {out!r}, {ranks}, preset={preset!r}, copy_mode={copy_mode!r},
            requant=RequantOptions(workers={workers}))
print(json.dumps({{"seconds": time.perf_counter() - t, "maxrss": vm_hwm(),
                  "target_bytes": s.target_bytes, "requantized": s.requantized_tensors,
                  "linked": len(s.linked_files)}}))
"""


def make_checkpoint(root: Path, size_gb: float, fp8: bool) -> tuple[int, str]:
    """DeepSeek-style layer names (MLA attention + shared experts + dense MLP) at a chosen total size."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    root.mkdir(parents=True)
    hidden, inter = 2048, 5632
    shapes = {
        "self_attn.q_a_proj.weight": (768, hidden),
        "self_attn.q_b_proj.weight": (3072, 768),
        "self_attn.kv_a_proj_with_mqa.weight": (576, hidden),
        "self_attn.kv_b_proj.weight": (4096, 512),
        "self_attn.o_proj.weight": (hidden, 2048),
        "mlp.shared_experts.gate_proj.weight": (1408, hidden),
        "mlp.shared_experts.up_proj.weight": (1408, hidden),
        "mlp.shared_experts.down_proj.weight": (hidden, 1408),
        **{f"mlp.experts.{e}.{proj}.weight": (1408, hidden) if proj != "down_proj" else (hidden, 1408)
           for e in range(4) for proj in ("gate_proj", "up_proj", "down_proj")},
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    elt = 1 if fp8 else 2
    per_layer = sum(elt * torch.Size(s).numel() for s in shapes.values())
    layers = max(2, round(size_gb * (1 << 30) / per_layer))
    weight_map, shard, shard_bytes, files, total = {}, {}, 0, [], 0

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, root / name, metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, shard_bytes = {}, 0

    for i in range(layers):
        for suffix, shape in shapes.items():
            w = torch.randn(shape, dtype=torch.bfloat16) * 0.02
            name = f"model.layers.{i}.{suffix}"
            if fp8:
                *lead, n, k = shape
                s = torch.rand(*lead, -(-n // 128), -(-k // 128)) * 1e-3 + 1e-4  # non-power-of-two scales
                shard[name] = (w.float() * 10).clamp(-448, 448).to(torch.float8_e4m3fn)
                shard[name + "_scale_inv"] = s
            else:
                shard[name] = w
            shard_bytes += w.numel() * elt
            total += w.numel() * elt
        if shard_bytes > 500 << 20:
            flush()
    flush()
    # rename to the HF scheme now that the count is known
    final = {}
    for idx, name in enumerate(files):
        new = f"model-{idx + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(root / name, root / new)
        final[name] = new
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": layers}
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": [128, 128]}
    (root / "config.json").write_text(json.dumps(config))
    size = sum(p.stat().st_size for p in root.iterdir())
    return size, f"{layers} layers"


def timed(cmd: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.2)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fp8", action="store_true", help="block-FP8 checkpoint; convert requantizes it to UE8M0")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir under /tmp)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.dir))
    try:
        src = scratch / "src"
        size, desc = make_checkpoint(src, args.size_gb, args.fp8)
        subprocess.run(["sync"], check=True)  # the generator's dirty pages must not be billed to the first run
        subprocess.run(["cat", *map(str, src.iterdir())], stdout=subprocess.DEVNULL, check=True)  # warm the cache
        rows: dict[str, list[float]] = {"cp -r": [], "convert (copy)": [], "convert (link)": []}
        rss: list[int] = []
        extra = {}
        for i in range(args.repeat):
            for label in rows:
                dest = scratch / f"out-{i}-{label.split()[0]}-{len(rows[label])}"
                if label == "cp -r":
                    seconds, _ = timed(["cp", "-r", str(src), str(dest)])
                else:
                    mode = "copy" if "copy" in label else "auto"
                    code = CONVERT.format(repo=str(REPO), src=str(src), out=str(dest), ranks=args.ranks,
                                          preset="deepseek-v3", copy_mode=mode, workers=args.workers)
                    seconds, out = timed([sys.executable, "-c", code])
                    info = json.loads(out.strip().splitlines()[-1])
                    rss.append(info["maxrss"])
                    extra = info
                rows[label].append(seconds)
                shutil.rmtree(dest)
        cp = statistics.median(rows["cp -r"])
        result = {
            "checkpoint_bytes": size, "checkpoint": desc, "fp8": args.fp8, "ranks": args.ranks, "repeat": args.repeat,
            "median_seconds": {k: statistics.median(v) for k, v in rows.items()},
            "speed_vs_cp": {k: cp / statistics.median(v) for k, v in rows.items()},
            "convert_peak_rss_bytes": max(rss), "target_bytes": extra.get("target_bytes"),
            "requantized_tensors": extra.get("requantized"), "cpus": os.cpu_count(),
        }
        print(f"checkpoint: {size / 2**30:.2f} GiB ({desc}, {'block-FP8' if args.fp8 else 'bf16'}), N = {args.ranks}, "
              f"median of {args.repeat}, warm cache, each run ends with sync")
        print("| contender | median s | speed vs cp -r |")
        print("|---|---|---|")
        for k in rows:
            print(f"| {k} | {result['median_seconds'][k]:.2f} | {result['speed_vs_cp'][k]:.2f}x |")
        print(f"convert peak RSS: {max(rss) / 2**20:.0f} MiB; requantized tensors: {extra.get('requantized')}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
