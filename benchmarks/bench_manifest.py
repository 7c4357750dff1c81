"""Reading a large manifest: `load_manifest` in a fresh process and after, and `validate --manifest-only`.

    python3 benchmarks/bench_manifest.py [--layers 100 --targets 100 --runs 5] [--baseline /path/to/other/checkout]

Two synthetic manifests of `--layers` × `--targets` entries (default 100 × 100 = 10,000) are written
through shardprep's own code (`plan_layer`, `plan_rank_file`, `Manifest`, the writer's `write_manifest`,
which seals them): MoE-shaped layers of bf16 attention projections (q/k/v fused as qkv_proj) and routed
experts selected by glob (`--target '*.experts.*'`: no preset fuses them; `--fused-experts` fuses each
expert's gate/up as well, 33 views per layer instead of 1), a source of 163 files, and per-chunk
XXH3-128 digests of synthetic bytes, so that the checksums look like real ones. A is for 8 ranks, B for
16 ranks with other sizes and names.

Each run starts a fresh Python process per checkout and times (wall, and the process's CPU time, which a
shared machine's other load disturbs less), from inside it:
- import: `from shardprep.manifests import load_manifest`;
- first: the first `load_manifest(A)` of the process (jsonschema's import included, the file warm);
- later: `load_manifest(A)` again, `--repeat` times, and `load_manifest` of `--repeat` copies of B
  (another manifest of that size), each at a path the process has not read (load_manifest keeps the
  manifests it read, by path and bytes); the medians are reported.
Then, timed from outside (interpreter start and every import included): `python3 -m shardprep validate
--manifest-only A`, for the checkout under test only (the baseline may not have the flag).

With `--baseline DIR` (another shardprep checkout, such as main), the same in-process phases run for it
too, alternating with this checkout's in every run; ratios are of the medians over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WRITE = r"""
import sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from shardprep.manifests.checksums import digest
from shardprep.manifests.layout import FusedGroup, TensorSpec, plan_layer
from shardprep.manifests.manifest import REPLICATED_INDEX, FileRecord, LayerRecord, Manifest
from shardprep.manifests.rank_file import plan_rank_file, rank_file_name
from shardprep.prep.output.writer import write_manifest

def write(out, layers, targets, ranks, hidden, inter, prefix):
    experts = (targets - 4) // 3
    layouts = []
    for layer in range(1, layers + 1):
        p = f"{{prefix}}.layers.{{layer}}"
        attn = [TensorSpec(f"{{p}}.self_attn.{{n}}_proj.weight", "BF16", (hidden // (8 if n in "kv" else 1), hidden))
                for n in "qkvo"]
        mlp = [TensorSpec(f"{{p}}.mlp.experts.{{e}}.{{n}}_proj.weight", "BF16",
                          (hidden, inter) if n == "down" else (inter, hidden))
               for e in range(experts) for n in ("gate", "up", "down")]
        qkv = tuple(f"{{p}}.self_attn.{{n}}_proj.weight" for n in "qkv")
        groups = [FusedGroup(f"{{p}}.self_attn.qkv_proj.weight", qkv)]
        groups += [FusedGroup(f"{{p}}.mlp.experts.{{e}}.gate_up_proj.weight",
                              (f"{{p}}.mlp.experts.{{e}}.gate_proj.weight", f"{{p}}.mlp.experts.{{e}}.up_proj.weight"))
                   for e in range(experts) if {fused_experts}]
        layouts.append(plan_layer(layer, attn + mlp, ranks, groups))
    offsets, _ = plan_rank_file([(lay.layer, lay.chunk_bytes) for lay in layouts], ranks, 4096)
    records = tuple(LayerRecord.from_layout(lay, off, tuple(digest(f"{{prefix}} {{lay.layer}} {{r}}".encode())
                                                            for r in range(ranks)))
                    for lay, off in zip(layouts, offsets))
    manifest = Manifest(ranks, tuple(rank_file_name(r, ranks) for r in range(ranks)), records,
                        source={{"path": "/models/" + prefix, "repo_id": None, "revision": None, "commit": None,
                                "files": [{{"name": f"model-{{i:05d}}-of-00163.safetensors", "size": 4 << 30}}
                                          for i in range(1, 164)]}},
                        replicated_files=(FileRecord(REPLICATED_INDEX, 10_000, digest(b"index")),),
                        selection={{"preset": None, "preset_targets": [], "targets": ["*.self_attn.*", "*.experts.*"],
                                   "layers": "1-", "layer_pattern": r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\."}},
                        requant_options={{"mode": "auto", "scope": "all", "recipe": "sglang", "scale_format": "f32",
                                         "allow_nonfinite": False}})
    Path(out).mkdir(parents=True)
    write_manifest(Path(out), manifest)
    return sum(len(r.entries) for r in records)

a = write({a!r}, {layers}, {targets}, 8, 4096, 1408, "model")
b = write({b!r}, {layers}, {targets}, 16, 5120, 1536, "language_model.model")
print(a, b)
"""

PHASES = r"""
import json, statistics, sys, time
sys.path.insert(0, {repo!r})

def timed(call):
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu

imported = timed(lambda: __import__("shardprep.manifests"))
from shardprep.manifests import load_manifest
first = timed(lambda: load_manifest({a!r}))

def later(paths):
    times = [timed(lambda: load_manifest(path)) for path in paths]
    return statistics.median(w for w, _ in times), statistics.median(c for _, c in times)

# "another": copies of B at paths not read before in this process, each read once (load_manifest keeps
# the manifests it read, so B read again would be "same").
same, other = later([{a!r}] * {repeat}), later([f"{b}-{{i}}" for i in range({repeat})])
print(json.dumps({{"import": imported[0], "first": first[0], "later_same": same[0], "later_other": other[0],
                  "import_cpu": imported[1], "first_cpu": first[1], "later_same_cpu": same[1],
                  "later_other_cpu": other[1]}}))
"""


def run_phases(repo: Path, a: Path, b: Path, repeat: int) -> dict[str, float]:
    code = PHASES.format(repo=str(repo), a=str(a), b=str(b), repeat=repeat)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run_cli(repo: Path, manifest: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + system, of the child) of `shardprep validate --manifest-only MANIFEST`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "shardprep", "validate", "--manifest-only", str(manifest)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo)
    seconds = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"validate --manifest-only failed ({proc.returncode}): {proc.stderr.strip()}")
    return seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--targets", type=int, default=100, help="entries per layer (4 attention + experts × 3)")
    ap.add_argument("--fused-experts", action="store_true", help="fuse each expert's gate/up (a view each)")
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per checkout; medians are reported")
    ap.add_argument("--repeat", type=int, default=9, help="later calls per manifest in each process")
    ap.add_argument("--baseline", type=Path, default=None, help="another shardprep checkout to compare with")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if (args.targets - 4) % 3:
        raise SystemExit("--targets must be 4 + 3 × experts (for example 100 = 4 + 3 × 32)")

    with tempfile.TemporaryDirectory(prefix="bench-manifest-") as scratch:
        a, b = Path(scratch) / "a", Path(scratch) / "b"
        code = WRITE.format(repo=str(REPO), a=str(a), b=str(b), layers=args.layers, targets=args.targets,
                            fused_experts=args.fused_experts)
        entries = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}).stdout.split()
        sizes = [(p / "shard_manifest.json").stat().st_size for p in (a, b)]
        for i in range(args.repeat):
            shutil.copytree(b, f"{b}-{i}")
        checkouts = {"this": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
        cli: list[tuple[float, float]] = []
        for i in range(args.runs):
            order = list(checkouts.items())
            for name, repo in order[i % len(order):] + order[:i % len(order)]:  # rotated: neither always goes first
                runs[name].append(run_phases(repo, a, b, args.repeat))
            cli.append(run_cli(REPO, a / "shard_manifest.json"))

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_average_at_end": os.getloadavg(),
        "entries": [int(n) for n in entries],
        "manifest_bytes": sizes,
        "runs": runs,
        "cli_manifest_only": [{"wall": w, "cpu": c} for w, c in cli],
    }
    views = 1 + ((args.targets - 4) // 3 if args.fused_experts else 0)
    result["fused_views_per_layer"] = views
    print(f"manifests: {entries[0]} and {entries[1]} entries ({views} fused views per layer), {sizes[0] / 1e6:.1f} "
          f"and {sizes[1] / 1e6:.1f} MB; "
          f"{args.runs} fresh processes per checkout, {args.repeat} later calls each; medians, wall s (CPU s)")
    print("| checkout | import | first call | later, same manifest | later, another manifest |")
    print("|---|---|---|---|---|")
    for name in checkouts:
        print(f"| {name} | " + " | ".join(f"{median(name, key):.3f} ({median(name, key + '_cpu'):.3f})"
                                         for key in ("import", "first", "later_same", "later_other")) + " |")
    if args.baseline:
        keys = [key + kind for kind in ("", "_cpu") for key in ("first", "later_same", "later_other")]
        ratios = {key: median("baseline", key) / median("this", key) for key in keys}
        result["speedup_vs_baseline"] = ratios
        for kind, label in (("", "wall"), ("_cpu", "CPU")):
            print(f"speed-up over the baseline ({label}): " + ", ".join(
                f"{key} {ratios[key + kind]:.1f}×" for key in ("first", "later_same", "later_other")))
    wall, cpu = statistics.median(w for w, _ in cli), statistics.median(c for _, c in cli)
    print(f"`validate --manifest-only` (fresh interpreter, all imports): median {wall:.3f} s wall ({cpu:.3f} s "
          "CPU); runs " + ", ".join(f"{w:.3f} ({c:.3f})" for w, c in cli))
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
