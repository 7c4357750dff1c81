"""Check `shardprep run --device cuda` against transformers on the same GPU, bit for bit.

Run from the repository root on a machine with at least --nproc GPUs:

    python3 benchmarks/check_run_gpu.py --nproc 2 [--backends auto,nccl,ce] [--work DIR]

(`--device cpu --backends auto` dry-runs the same comparison on the CPU with gloo.)

For tiny random Llama, Qwen3-MoE (sharded checkpoint) and BERT models (tests/checkpoints.py), it
converts each with N ranks, runs `python3 -m shardprep run DIR --nproc N --device cuda` with every
gather backend asked for, and compares with transformers on the source checkpoint on cuda:0: the
greedy tokens of every prompt, and the saved prompt outputs (logits, last_hidden_state) with
torch.equal. There are more prompts than ranks, so some ranks take idle steps. Prints one line per
comparison and the per-rank bytes; exits 1 on any mismatch or failed run, 2 without enough GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from checkpoints import make_checkpoint  # noqa: E402
from test_run import transformers_outputs  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

K = 8
PROMPTS = ["hello world", "the model", "shard the weights gpu rank layer fast"]  # rank 1 of 2 idles once
CASES = [
    ("llama", False, {"preset": "llama"}),
    ("qwen3-moe", True, {"preset": "qwen3-moe"}),
    ("bert", False, {"targets": ["*.attention.self.*.weight", "*.intermediate.dense.weight"], "layers": "all"}),
]


def shardprep_run(out: Path, nproc: int, device: str, backend: str, saved: Path) -> tuple[dict | None, str, float]:
    cmd = [sys.executable, "-m", "shardprep", "run", str(out), "--nproc", str(nproc), "--device", device,
           "--backend", backend, "--json", "--max-new-tokens", str(K), "--save-outputs", str(saved)]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        return None, proc.stdout[-2000:] + proc.stderr[-4000:], seconds
    return json.loads(proc.stdout.strip().splitlines()[-1]), "", seconds


def compare(name: str, summary: dict, saved: Path, want: list, causal: bool) -> bool:
    outputs = torch.load(saved)
    outputs = outputs if isinstance(outputs, list) else [outputs]
    ok = True
    for r, got, (tokens, ref) in zip(summary["prompts"], outputs, want):
        same_tokens = not causal or r["token_ids"] == tokens
        same_output = got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got, ref)
        tokens_text = "equal" if same_tokens else f"{r['token_ids']} != {tokens}"
        if same_output:
            output_text = "bit-identical"
        else:
            diff = (got.float() - ref.float()).abs().max().item() if got.shape == ref.shape else float("nan")
            output_text = f"differ, max |diff| {diff:.3g}"
        print(f"  {'ok  ' if same_tokens and same_output else 'FAIL'} {name} prompt {r['index']} (rank {r['rank']}): "
              + (f"tokens {tokens_text}, " if causal else "")
              + f"{'logits' if causal else 'last_hidden_state'} {list(got.shape)} {output_text}")
        ok = ok and same_tokens and same_output
    return ok


def check_memory(name: str, summary: dict, out: Path) -> bool:
    manifest = load_manifest(out)
    local = sum(r.chunk_bytes for r in manifest.layers)
    ok = True
    for m in summary["ranks"]:
        slots_ok = m["slot_bytes"] == 2 * manifest.max_total_bytes
        shards_ok = local <= m["shard_bytes"] <= local + 4096 * len(manifest.layers)
        ok &= slots_ok and shards_ok
        print(f"  {'ok  ' if slots_ok and shards_ok else 'FAIL'} {name} rank {m['rank']} on {m['device']} "
              f"({m['backend']}): shards {m['shard_bytes']} B (R/N = {local}), slots {m['slot_bytes']} B "
              f"(2·max|T| = {2 * manifest.max_total_bytes}), replicated parameters {m['parameter_bytes']} B")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backends", default="auto,nccl,ce", help="comma-separated gather backends to run")
    parser.add_argument("--work", type=Path, default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu (with --backends auto) dry-runs this script")
    args = parser.parse_args()
    # Never NVLink multicast on shared machines (ce's symmetric memory would otherwise probe it).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import transformers

    gpus = torch.cuda.device_count()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {gpus} GPU(s)"
          + (f": {torch.cuda.get_device_name(0)}" if gpus else ""), flush=True)
    if args.device == "cuda" and gpus < args.nproc:
        print(f"need {args.nproc} GPUs, found {gpus}; nothing checked")
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="check_run_gpu-"))
    failures = []
    for arch, sharded, convert_kw in CASES:
        src = make_checkpoint(work / "src" / arch, arch, sharded=sharded)
        out = work / "out" / arch
        convert(src, out, args.nproc, overwrite=True, **convert_kw)
        causal = arch != "bert"
        want = transformers_outputs(src, PROMPTS, causal, K, "cuda:0" if args.device == "cuda" else "cpu")
        print(f"{arch}: {args.nproc} ranks, {len(PROMPTS)} prompts, {K} tokens each, convert {convert_kw}", flush=True)
        for backend in args.backends.split(","):
            name = f"{arch}/{backend}"
            saved = work / f"{arch}-{backend}.pt"
            summary, log, seconds = shardprep_run(out, args.nproc, args.device, backend, saved)
            if summary is None:
                print(f"  FAIL {name}: `shardprep run` failed after {seconds:.1f} s:\n{log}", flush=True)
                failures.append(name)
                continue
            print(f"  run {name}: {seconds:.1f} s", flush=True)
            outputs_ok = compare(name, summary, saved, want, causal)
            memory_ok = check_memory(name, summary, out)
            if not (outputs_ok and memory_ok):
                failures.append(name)
    print(f"{'FAILED: ' + ', '.join(failures) if failures else 'all equal'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
