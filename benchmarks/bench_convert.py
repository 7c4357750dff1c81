"""convert vs `cp -r` of the same checkpoint, side by side in one run, with convert's peak RSS.

    python3 benchmarks/bench_convert.py --size-gb 1.2 --runs 5 [--fp8] [--baseline /path/to/other/checkout]
    python3 benchmarks/bench_convert.py --many-tensors 4000,16000,44500,64000

What is timed, for every contender alike: from the start of the command (a fresh process: for convert,
the interpreter start and its imports included) until its output is on disk, that is the command
followed by `sync FILE...` of every file it wrote (coreutils' `sync` with file arguments fsyncs exactly
those files, so other processes' dirty pages are not billed to either). convert fsyncs its own files
before it returns, so its `sync` finds nothing left to write; cp's `sync` writes all of cp's output.
Both start from a warm page cache (the source is read once before the first run). The contenders
alternate, in a rotated order, within each of `--runs` rounds; the ratio is of the medians.

The checkpoint is synthetic but laid out like an HF DeepSeek export (model-0000x-of-0000y.safetensors
shards of about 500 MB plus an index). With --fp8 the weights are block-FP8 with non-power-of-two
scales, and convert requantizes every one of them to UE8M0.

--many-tensors N1,N2,... measures how convert's time grows with the tensor count: for each N, a
checkpoint of 61 DeepSeek-V3-named layers holding N block-FP8 weights of 128×128 (routed experts, as
DeepSeek-V3's ~44.5k), converted --runs times; it reports the median time per weight.

--baseline DIR adds "convert (baseline)": the same convert (copy mode) of another shardprep checkout
(main, say, from `git archive`), in the same rounds, so a before/after ratio comes from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20

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
                  "linked": len(s.linked_files), "torch_imported": "torch" in sys.modules}}))
"""

ATTENTION = {
    "self_attn.q_a_proj.weight": (768, 2048),
    "self_attn.q_b_proj.weight": (3072, 768),
    "self_attn.kv_a_proj_with_mqa.weight": (576, 2048),
    "self_attn.kv_b_proj.weight": (4096, 512),
    "self_attn.o_proj.weight": (2048, 2048),
}


def _layer_shapes() -> dict[str, tuple[int, int]]:
    hidden, inter = 2048, 5632
    return {
        **ATTENTION,
        "mlp.shared_experts.gate_proj.weight": (1408, hidden),
        "mlp.shared_experts.up_proj.weight": (1408, hidden),
        "mlp.shared_experts.down_proj.weight": (hidden, 1408),
        **{f"mlp.experts.{e}.{proj}.weight": (1408, hidden) if proj != "down_proj" else (hidden, 1408)
           for e in range(4) for proj in ("gate_proj", "up_proj", "down_proj")},
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }


def _fp8_config(layers: int) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": layers,
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                    "weight_block_size": [128, 128]}}


class _ShardedSaver:
    """Writes tensors into ~`shard_bytes` safetensors shards with HF names and an index."""

    def __init__(self, root: Path, shard_bytes: int):
        root.mkdir(parents=True)
        self.root, self.shard_bytes = root, shard_bytes
        self.shard: dict = {}
        self.nbytes = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, name: str, tensor) -> None:
        self.shard[name] = tensor
        n = tensor.numel() * tensor.element_size()
        self.nbytes += n
        self.total += n

    def maybe_flush(self) -> None:
        if self.nbytes > self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.shard:
            name = f"model-{len(self.files) + 1:05d}.safetensors"
            save_file(self.shard, self.root / name, metadata={"format": "pt"})
            self.files.append(name)
            self.weight_map.update({k: name for k in self.shard})
            self.shard, self.nbytes = {}, 0

    def finish(self, config: dict) -> int:
        self.flush()
        final = {}
        for idx, name in enumerate(self.files):  # the HF scheme, now that the count is known
            new = f"model-{idx + 1:05d}-of-{len(self.files):05d}.safetensors"
            os.rename(self.root / name, self.root / new)
            final[name] = new
        index = {"metadata": {"total_size": self.total},
                 "weight_map": {k: final[v] for k, v in self.weight_map.items()}}
        (self.root / "model.safetensors.index.json").write_text(json.dumps(index))
        (self.root / "config.json").write_text(json.dumps(config))
        return sum(p.stat().st_size for p in self.root.iterdir())


def make_checkpoint(root: Path, size_gb: float, fp8: bool) -> tuple[int, str]:
    """DeepSeek-style layer names (MLA attention + shared experts + dense MLP) at a chosen total size."""
    import torch

    torch.manual_seed(0)
    shapes = _layer_shapes()
    elt = 1 if fp8 else 2
    per_layer = sum(elt * torch.Size(s).numel() for s in shapes.values())
    layers = max(2, round(size_gb * (1 << 30) / per_layer))
    saver = _ShardedSaver(root, 500 << 20)
    for i in range(layers):
        for suffix, shape in shapes.items():
            w = torch.randn(shape, dtype=torch.bfloat16) * 0.02
            name = f"model.layers.{i}.{suffix}"
            if fp8:
                n, k = shape
                s = torch.rand(-(-n // 128), -(-k // 128)) * 1e-3 + 1e-4  # non-power-of-two scales
                saver.add(name, (w.float() * 10).clamp(-448, 448).to(torch.float8_e4m3fn))
                saver.add(name + "_scale_inv", s)
            else:
                saver.add(name, w)
        saver.maybe_flush()
    config = _fp8_config(layers) if fp8 else {"architectures": ["DeepseekV3ForCausalLM"],
                                              "model_type": "deepseek_v3", "num_hidden_layers": layers}
    return saver.finish(config), f"{layers} layers"


def make_many_tensor_checkpoint(root: Path, weights: int, layers: int = 61) -> tuple[int, str]:
    """`weights` block-FP8 weights of 128×128 over `layers` DeepSeek-V3 layers: per layer 5 MLA projections,
    3 shared experts and 3·E routed experts, E chosen so that the total is about `weights`."""
    import torch

    torch.manual_seed(0)
    experts = max(1, round((weights / layers - 8) / 3))
    per_layer = [*ATTENTION, *(f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")),
                 *(f"mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up", "down"))]
    base = (torch.randn(1 << 20) * 20).clamp(-448, 448).to(torch.float8_e4m3fn)
    saver = _ShardedSaver(root, 200 << 20)
    count = 0
    for i in range(layers):
        saver.add(f"model.layers.{i}.input_layernorm.weight", torch.ones(128, dtype=torch.bfloat16))
        for suffix in per_layer:
            at = (count * 16384) % ((1 << 20) - 16384)
            name = f"model.layers.{i}.{suffix}"
            saver.add(name, base[at:at + 16384].reshape(128, 128).clone())
            saver.add(name + "_scale_inv", torch.rand(1, 1) * 1e-3 + 1e-4)
            count += 1
        saver.maybe_flush()
    return saver.finish(_fp8_config(layers)), f"{count} block-FP8 weights in {layers} layers, {experts} experts"


def output_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file()]


def timed(cmd: list[str], dest: Path) -> dict:
    """Run `cmd`, then fsync every file it wrote under `dest`; the two durations and the CPU time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    t1 = time.perf_counter()
    subprocess.run(["sync", *output_files(dest)], check=True)
    t2 = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": t2 - t0, "command": t1 - t0, "sync": t2 - t1, "cpu": cpu, "stdout": proc.stdout}


def convert_cmd(src: Path, dest: Path, args: argparse.Namespace, copy_mode: str, repo: Path = REPO) -> list[str]:
    code = CONVERT.format(repo=str(repo), src=str(src), out=str(dest), ranks=args.ranks, preset="deepseek-v3",
                          copy_mode=copy_mode, workers=args.workers)
    return [sys.executable, "-c", code]


def compare_with_cp(args: argparse.Namespace, scratch: Path) -> dict:
    src = scratch / "src"
    size, desc = make_checkpoint(src, args.size_gb, args.fp8)
    subprocess.run(["sync"], check=True)  # the generator's dirty pages must not be billed to the first run
    subprocess.run(["cat", *output_files(src)], stdout=subprocess.DEVNULL, check=True)  # warm the cache
    contenders = {
        "cp -r": lambda dest: ["cp", "-r", str(src), str(dest)],
        "convert (copy)": lambda dest: convert_cmd(src, dest, args, "copy"),
        "convert (link)": lambda dest: convert_cmd(src, dest, args, "auto"),
    }
    if args.baseline:
        contenders["convert (baseline)"] = lambda dest: convert_cmd(src, dest, args, "copy", args.baseline.resolve())
    if args.fp8:
        # The first convert on a machine compiles the lookup kernels into numba's cache: not a per-run cost.
        warm = scratch / "warm-up"
        subprocess.run(convert_cmd(src, warm, args, "auto"), check=True, capture_output=True)
        shutil.rmtree(warm)
    runs: dict[str, list[dict]] = {k: [] for k in contenders}
    info: dict = {}
    largest = 0
    labels = list(contenders)
    for i in range(args.runs):
        for label in labels[i % len(labels):] + labels[:i % len(labels)]:  # rotate who goes first
            dest = scratch / f"out-{i}-{labels.index(label)}"
            r = timed(contenders[label](dest), dest)
            if label != "cp -r":
                info = json.loads(r["stdout"].strip().splitlines()[-1])
                r["maxrss"] = info["maxrss"]
            runs[label].append(r)
            if label == "convert (copy)" and i == 0:
                manifest = json.loads((dest / "shard_manifest.json").read_text())
                largest = max(lay["total_bytes"] for lay in manifest["layers"])
            shutil.rmtree(dest)
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("seconds", "command", "sync", "cpu")}
           for k, v in runs.items()}
    cp = med["cp -r"]["seconds"]
    peak = max(r["maxrss"] for k, v in runs.items() if k != "cp -r" for r in v)
    bound = 2 * largest + 300 * MB
    result = {
        "checkpoint_bytes": size, "checkpoint": desc, "fp8": args.fp8, "ranks": args.ranks, "runs": args.runs,
        "median": med, "speed_vs_cp": {k: cp / v["seconds"] for k, v in med.items()},
        "all_seconds": {k: [round(r["seconds"], 3) for r in v] for k, v in runs.items()},
        "convert_peak_rss_bytes": peak, "largest_layer_bytes": largest, "rss_bound_bytes": bound,
        "target_bytes": info.get("target_bytes"), "requantized_tensors": info.get("requantized"),
        "torch_imported": info.get("torch_imported"), "cpus": os.cpu_count(),
    }
    print(f"checkpoint: {size / 2**30:.2f} GiB ({desc}, {'block-FP8' if args.fp8 else 'bf16'}), N = {args.ranks}, "
          f"median of {args.runs}; timed: command + fsync of its output files; warm source cache")
    print("| contender | median s | of which: command | sync | CPU s | speed vs cp -r |")
    print("|---|---|---|---|---|---|")
    for k, m in med.items():
        print(f"| {k} | {m['seconds']:.2f} | {m['command']:.2f} | {m['sync']:.2f} | {m['cpu']:.2f} | "
              f"{result['speed_vs_cp'][k]:.2f}x |")
    print(f"all runs (s): {result['all_seconds']}")
    print(f"convert peak RSS {peak / MB:.0f} MiB; bound 2 x largest layer ({largest / MB:.1f} MiB) + 300 MiB = "
          f"{bound / MB:.0f} MiB: {'met' if peak <= bound else 'EXCEEDED'}; requantized tensors: "
          f"{info.get('requantized')}; torch imported: {info.get('torch_imported')}")
    return result


def many_tensors(args: argparse.Namespace, scratch: Path) -> dict:
    rows = []
    print(f"convert, N = {args.ranks}, median of {args.runs}; seconds in convert() (interpreter start excluded) and "
          "whole command + sync")
    print("| block-FP8 weights | tensors | checkpoint MiB | convert() s | per weight µs | command + sync s |")
    print("|---|---|---|---|---|---|")
    for count in args.many_tensors:
        src = scratch / f"many-{count}"
        size, desc = make_many_tensor_checkpoint(src, count)
        subprocess.run(["sync"], check=True)
        subprocess.run(["cat", *output_files(src)], stdout=subprocess.DEVNULL, check=True)
        inner, outer, info = [], [], {}
        for i in range(args.runs):
            dest = scratch / f"many-out-{i}"
            r = timed(convert_cmd(src, dest, args, "copy"), dest)
            info = json.loads(r["stdout"].strip().splitlines()[-1])
            inner.append(info["seconds"])
            outer.append(r["seconds"])
            shutil.rmtree(dest)
        names = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        weights = sum(1 for name in names if name.endswith("_scale_inv"))
        shutil.rmtree(src)
        row = {"weights": weights, "tensors": len(names), "bytes": size, "desc": desc,
               "requantized_tensors": info["requantized"],
               "convert_seconds": statistics.median(inner), "command_seconds": statistics.median(outer),
               "all_convert_seconds": [round(x, 3) for x in inner], "maxrss": info["maxrss"]}
        row["per_weight_us"] = row["convert_seconds"] / row["weights"] * 1e6
        rows.append(row)
        print(f"| {row['weights']} | {row['tensors']} | {size / MB:.0f} | {row['convert_seconds']:.2f} | "
              f"{row['per_weight_us']:.0f} | {row['command_seconds']:.2f} |", flush=True)
    return {"many_tensors": rows, "ranks": args.ranks, "runs": args.runs, "cpus": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.2)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--runs", "--repeat", type=int, default=5, help="rounds; medians are reported")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 checkpoint; convert requantizes it to UE8M0")
    ap.add_argument("--many-tensors", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    metavar="N1,N2,...", help="time per tensor at these block-FP8 weight counts")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--baseline", type=Path, default=None, help="another shardprep checkout to convert with too")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir under /tmp)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.dir))
    try:
        result = many_tensors(args, scratch) if args.many_tensors else compare_with_cp(args, scratch)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
