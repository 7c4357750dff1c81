"""What the binding itself costs a forward: a bound transformers model against the same model with resident weights.

    python3 benchmarks/bench_binding.py --device cuda --out binding.json          # one GPU, about a minute
    python3 benchmarks/bench_binding.py --device cpu --hidden 256 --layers 4      # CPU + gloo, seconds

One process, one rank: a Llama written by transformers (`tests/support/checkpoints.py`, random weights) converted for
one rank with the `llama` preset (every layer from 1 sharded), so a gather moves no byte between ranks (with
zero copy, none at all): what remains is the binding's per-layer path, the two ops `shardprep::layer_begin`
and `shardprep::layer_end` and the gatherer's bookkeeping behind them. Measured side by side, in one run, on
`--tokens` rows (decode-sized by default):

- resident: transformers' model with its own weights (`from_pretrained` on the source), eager;
- bound: `build_model` on the converted directory, eager; (bound − resident) / sharded layers is the
  binding's cost per layer;
- on CUDA, both captured in a CUDA graph and replayed: the ops' Python is gone from a replay, so bound
  should replay in the resident graph's time (the gathers of one rank are empty).

Every figure is the median of `--iters` timed steps after `--warmup`, device-synchronised. Results go to
--out as JSON and a table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def timed(fn, device, iters: int, warmup: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def graphed(step, device):
    """`step` captured in a CUDA graph (warmed up on a side stream first); returns the replay."""
    import torch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="JSON results file")
    a = p.parse_args()

    import torch
    import torch.distributed as dist
    import transformers
    from support.checkpoints import make_checkpoint
    from support.spawn_group import free_port

    from shardprep.prep.convert import convert
    from shardprep.standalone.hf_model import build_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.utils.logging.disable_progress_bar()
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-binding-"))
    src, out = work / "src", work / "out"
    if not (src / "config.json").exists():
        make_checkpoint(src, "llama", layers=a.layers, hidden=a.hidden, vocab=1024, head_dim=128)
    if not (out / "shard_manifest.json").exists():
        convert(src, out, 1, preset="llama", chunk_alignment="auto")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, timeout=timedelta(minutes=5),
                            **({"device_id": device} if device.type == "cuda" else {}))

    ids = torch.randint(0, 1024, (1, a.tokens), device=device)
    resident = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval().to(device)
    binding = build_model(out, device)
    bound = binding.model
    sharded = len(binding.layers)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "layers": a.layers, "sharded_layers": sharded, "hidden": a.hidden,
                     "tokens": a.tokens, "zero_copy": binding.gatherer.zero_copy,
                     "backend": binding.gatherer.backend_name}
    with torch.inference_mode():
        same = torch.equal(bound(ids, use_cache=False).logits, resident(ids, use_cache=False).logits)
        results["bit_identical"] = bool(same)
        results["resident_ms"] = timed(lambda: resident(ids, use_cache=False), device, a.iters, a.warmup)
        results["bound_ms"] = timed(lambda: bound(ids, use_cache=False), device, a.iters, a.warmup)
        if device.type == "cuda":
            replay_resident = graphed(lambda: resident(ids, use_cache=False), device)
            replay_bound = graphed(lambda: bound(ids, use_cache=False), device)
            results["resident_graph_ms"] = timed(replay_resident, device, a.iters, a.warmup)
            results["bound_graph_ms"] = timed(replay_bound, device, a.iters, a.warmup)
    results["eager_ratio"] = results["bound_ms"] / results["resident_ms"]
    results["per_layer_us"] = (results["bound_ms"] - results["resident_ms"]) / sharded * 1e3
    if "bound_graph_ms" in results:
        results["graph_ratio"] = results["bound_graph_ms"] / results["resident_graph_ms"]
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"| {results['device']} | {a.layers} layers × hidden {a.hidden}, {a.tokens} tokens, {sharded} bound "
          f"({results['backend']}, zero copy {results['zero_copy']}) | bit-identical {results['bit_identical']} |")
    print(f"| eager | resident {results['resident_ms']:.3f} ms | bound {results['bound_ms']:.3f} ms | "
          f"{results['eager_ratio']:.3f}× | {results['per_layer_us']:+.1f} µs per bound layer |")
    if "graph_ratio" in results:
        print(f"| CUDA graph | resident {results['resident_graph_ms']:.3f} ms | "
              f"bound {results['bound_graph_ms']:.3f} ms | {results['graph_ratio']:.3f}× |")
    sys.stdout.flush()
    os._exit(0)  # leave the process group without interpreter teardown (see shardprep/cli/run.py)


if __name__ == "__main__":
    main()
