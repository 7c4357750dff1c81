"""reshard vs `cp -r` of the same output directory, side by side in one run, with reshard's peak RSS.

    python3 benchmarks/bench_reshard.py --size-gb 1.2 --runs 5 [--ranks 8 --to 4]

The methodology of bench_convert.py: every contender is timed from the start of its command (a fresh
process: for shardprep, the interpreter start and its imports included) until its output is on disk,
that is the command followed by `sync FILE...` of every file it wrote; the contenders alternate in a
rotated order within each of `--runs` rounds, from a warm page cache; ratios are of the medians.

The input is bench_convert.py's synthetic bf16 DeepSeek-style checkpoint, converted once with
`--preset deepseek-v3` for `--ranks` N (OUT). Contenders:

- `cp -r OUT` and `reshard OUT --ranks M` (hard-linking the replicated part, the default), the
  comparison the issue asks for; `reshard` with copy_mode="copy" writes every byte as cp does;
- `cp -r SRC` and `convert SRC --ranks M` (link mode), so that convert's bf16 ratio is measured in the
  same run as reshard's.

Peak RSS is `VmHWM` of the resharding process, against 2 × the largest |T| (of N's and M's layouts) + 300 MiB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import MB, REPO, make_checkpoint, output_files, timed  # noqa: E402

RESHARD = """
import json, sys, time
def vm_hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
sys.path.insert(0, {repo!r})
from shardprep.prep.reshard import reshard
t = time.perf_counter()
s = reshard({out!r}, {new!r}, {ranks}, copy_mode={copy_mode!r})
print(json.dumps({{"seconds": time.perf_counter() - t, "maxrss": vm_hwm(), "linked": len(s.linked_files),
                  "copied": len(s.copied_files), "torch_imported": "torch" in sys.modules}}))
"""

CONVERT = """
import json, sys
sys.path.insert(0, {repo!r})
from shardprep.prep.convert import convert
convert({src!r}, {out!r}, {ranks}, preset="deepseek-v3", copy_mode="auto")
"""


def largest_layer(directory: Path) -> int:
    manifest = json.loads((directory / "shard_manifest.json").read_text())
    return max(lay["total_bytes"] for lay in manifest["layers"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.2)
    ap.add_argument("--ranks", type=int, default=8, help="N, the ranks of the input OUT")
    ap.add_argument("--to", type=int, default=4, help="M, the ranks reshard writes")
    ap.add_argument("--runs", type=int, default=5, help="rounds; medians are reported")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir under /tmp)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-reshard-", dir=args.dir))
    try:
        src, out = scratch / "src", scratch / "out"
        size, desc = make_checkpoint(src, args.size_gb, fp8=False)
        subprocess.run([sys.executable, "-c", CONVERT.format(repo=str(REPO), src=str(src), out=str(out),
                                                             ranks=args.ranks)], check=True)
        out_size = sum(Path(p).stat().st_size for p in output_files(out))
        subprocess.run(["sync"], check=True)  # the setup's dirty pages must not be billed to the first run
        subprocess.run(["cat", *output_files(src), *output_files(out)], stdout=subprocess.DEVNULL, check=True)

        def reshard_cmd(mode: str):
            return lambda dest: [sys.executable, "-c", RESHARD.format(repo=str(REPO), out=str(out), new=str(dest),
                                                                      ranks=args.to, copy_mode=mode)]

        contenders = {
            "cp -r OUT": lambda dest: ["cp", "-r", str(out), str(dest)],
            "reshard (link)": reshard_cmd("auto"),
            "reshard (copy)": reshard_cmd("copy"),
            "cp -r SRC": lambda dest: ["cp", "-r", str(src), str(dest)],
            "convert (link)": lambda dest: [sys.executable, "-c", CONVERT.format(repo=str(REPO), src=str(src),
                                                                                 out=str(dest), ranks=args.to)],
        }
        runs: dict[str, list[dict]] = {k: [] for k in contenders}
        labels = list(contenders)
        largest = largest_layer(out)
        info: dict = {}
        for i in range(args.runs):
            for label in labels[i % len(labels):] + labels[:i % len(labels)]:  # rotate who goes first
                dest = scratch / f"run-{i}-{labels.index(label)}"
                r = timed(contenders[label](dest), dest)
                if label.startswith("reshard"):
                    info = json.loads(r["stdout"].strip().splitlines()[-1])
                    r["maxrss"] = info["maxrss"]
                    largest = max(largest, largest_layer(dest))
                runs[label].append(r)
                shutil.rmtree(dest)
        med = {k: {f: statistics.median(r[f] for r in v) for f in ("seconds", "command", "sync", "cpu")}
               for k, v in runs.items()}
        ratio = {
            "reshard (link)": med["cp -r OUT"]["seconds"] / med["reshard (link)"]["seconds"],
            "reshard (copy)": med["cp -r OUT"]["seconds"] / med["reshard (copy)"]["seconds"],
            "convert (link)": med["cp -r SRC"]["seconds"] / med["convert (link)"]["seconds"],
        }
        peak = max(r["maxrss"] for k, v in runs.items() if k.startswith("reshard") for r in v)
        bound = 2 * largest + 300 * MB
        result = {"checkpoint_bytes": size, "checkpoint": desc, "out_bytes": out_size, "from_ranks": args.ranks,
                  "to_ranks": args.to, "runs": args.runs, "median": med, "speed_vs_cp": ratio,
                  "all_seconds": {k: [round(r["seconds"], 3) for r in v] for k, v in runs.items()},
                  "reshard_peak_rss_bytes": peak, "largest_layer_bytes": largest, "rss_bound_bytes": bound,
                  "torch_imported": info.get("torch_imported")}
        print(f"checkpoint {size / 2**30:.2f} GiB ({desc}, bf16), OUT {out_size / 2**30:.2f} GiB for N = {args.ranks}, "
              f"resharded to M = {args.to}; median of {args.runs}; timed: command + fsync of its output files; "
              "warm cache")
        print("| contender | median s | of which: command | sync | CPU s | speed vs cp -r |")
        print("|---|---|---|---|---|---|")
        for k, m in med.items():
            speed = f"{ratio[k]:.2f}x" if k in ratio else ""
            print(f"| {k} | {m['seconds']:.2f} | {m['command']:.2f} | {m['sync']:.2f} | {m['cpu']:.2f} | {speed} |")
        print(f"all runs (s): {result['all_seconds']}")
        print(f"reshard peak RSS {peak / MB:.0f} MiB; bound 2 x largest layer ({largest / MB:.1f} MiB) + 300 MiB = "
              f"{bound / MB:.0f} MiB: {'met' if peak <= bound else 'EXCEEDED'}; torch imported: "
              f"{info.get('torch_imported')}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
