"""Where the block-FP8 decode MLP's time goes, kernel by kernel, on one GPU (the breakdown behind bench_fp8_gemm.py).

For each token count and each of the MLP's two shapes (8192 → 28672, 28672 → 8192), each timed as a CUDA graph
of the 8 layers' instances of that one kernel (different weights, so the weights come from HBM as in the MLP):

- gemm bf16 / gemm fp8: `x @ W.T` against torch's block-scaled GEMM on already-quantized activations;
- quant: the activation quantization alone, as torch ops, as Inductor compiles it (dynamic rows, as the
  runtime did before this kernel; static rows, as ../shared/probes/fp8_decode_probe.py did), and as the Triton kernel
  (`fp8_activation_kernel.quantize_for_gemm`);
- then the whole MLP with each quantization, and torch.profiler's kernel list of the MLP at 128 tokens.

Also checks that the Triton kernel's codes and scales equal the torch ops' bit for bit, and whether CUDA events
recorded inside a graph capture (`torch.cuda.Event(external=True)`) time its replays (what `shardprep profile`
relies on). One JSON object at the end (and in --out).

    python3 benchmarks/bench_fp8_kernels.py --tokens 16,128,1024 --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fp8_gemm import LAYERS, F, H, block_quantized, timed  # noqa: E402

from shardprep.standalone.block_fp8 import quantize_activations  # noqa: E402
from shardprep.standalone.fp8_activation_kernel import quantize_for_gemm  # noqa: E402


def plain_ops(x):
    q, s = quantize_activations(x)
    return q, s.t().contiguous().t()


_static = torch.compile(quantize_activations, dynamic=False)


def static_compiled(x):
    q, s = _static(x)
    return q, s.t().contiguous().t()


_dynamic = torch.compile(plain_ops, fullgraph=True)  # what block_fp8_linear captured before the Triton kernel


def dynamic_compiled(x):
    torch._dynamo.mark_dynamic(x, 0)
    return _dynamic(x)


QUANTS = {"plain_ops": plain_ops, "compiled_dynamic": dynamic_compiled, "compiled_static": static_compiled,
          "triton": quantize_for_gemm}


def graph_of(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def gemm(q, s, codes, scale):
    return torch._scaled_mm(q, codes.t(), scale_a=s, scale_b=scale.t(), out_dtype=torch.bfloat16)


def split_k2(halves, codes, scale_halves):
    """The GEMM as two over K's halves, in float32, summed: twice the output tiles for cuBLAS to spread.

    `halves`: each half of the activations quantized on its own; `scale_halves`: the weight scales' halves, each
    contiguous (torch refuses sliced scales: "Invalid scaling configuration")."""
    h = codes.shape[1] // 2
    parts = [torch._scaled_mm(q, codes[:, i * h:(i + 1) * h].t(), scale_a=s, scale_b=sw.t(), out_dtype=torch.float32)
             for i, ((q, s), sw) in enumerate(zip(halves, scale_halves))]
    return (parts[0] + parts[1]).to(torch.bfloat16)


def mlp(x, layers, quant):
    for (w1, q1, s1), (w2, q2, s2) in layers:
        if quant is None:
            x = torch.relu(x @ w1.t()) @ w2.t()
        else:
            x = gemm(*quant(torch.relu(gemm(*quant(x), q1, s1))), q2, s2)
    return x


def events_in_graph() -> dict:
    """Whether events recorded inside a capture give the replay's timeline."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    marks = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(3)]

    def work():
        marks[0].record()
        b = a @ a
        marks[1].record()
        c = b @ b @ b
        marks[2].record()
        return c

    try:
        graph = graph_of(work)
        out = {}
        for _ in range(3):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            out = {"one_matmul_ms": marks[0].elapsed_time(marks[1]),
                   "three_matmuls_ms": marks[1].elapsed_time(marks[2]),
                   "replay_ms": begin.elapsed_time(end), "begin_to_first_ms": begin.elapsed_time(marks[0])}
        return {"works": True, **out}
    except Exception as exc:  # noqa: BLE001 - what failed is the finding
        return {"works": False, "error": f"{type(exc).__name__}: {exc}"[:400]}


def per_kernel(tokens: int, k: int, n: int, weights: list, iters: int, dev: torch.device) -> dict:
    """Each kernel of one MLP shape at one token count: a graph of its 8 layers' instances, per instance (ms)."""
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    row: dict = {"tokens": tokens, "shape": f"{k}->{n}"}

    def graph_ms(fn) -> float:
        return timed(graph_of(fn).replay, iters) / LAYERS

    row["gemm_bf16_ms"] = graph_ms(lambda: [x @ w.t() for w, _, _ in weights])
    q, s = quantize_for_gemm(x)
    row["gemm_fp8_ms"] = graph_ms(lambda: [gemm(q, s, c, sc) for _, c, sc in weights])
    try:
        halves = [quantize_for_gemm(x[:, :k // 2].contiguous()), quantize_for_gemm(x[:, k // 2:].contiguous())]
        split = [(c, [sc[:, :k // 256].contiguous(), sc[:, k // 256:].contiguous()]) for _, c, sc in weights]
        row["gemm_fp8_split_k2_ms"] = graph_ms(lambda: [split_k2(halves, c, sh) for c, sh in split])
    except Exception as exc:  # noqa: BLE001 - a layout cuBLAS refuses is the finding
        row["gemm_fp8_split_k2_error"] = f"{type(exc).__name__}: {exc}"[:300]
    xs = [torch.randn(tokens, k, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    for name, quant in QUANTS.items():
        row[f"quant_{name}_ms"] = graph_ms(lambda quant=quant: [quant(v) for v in xs])
    row["weight_gbps_fp8"] = n * k / row["gemm_fp8_ms"] / 1e6
    row["weight_gbps_bf16"] = 2 * n * k / row["gemm_bf16_ms"] / 1e6
    return row


def whole_mlp(tokens: int, layers: list, iters: int, dev: torch.device) -> tuple[dict, dict]:
    """The MLP with each quantization (graph; Triton and plain ops eagerly too), and profiler kernels at 128."""
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
    row: dict = {"tokens": tokens, "bf16_ms": timed(graph_of(lambda: mlp(x, layers, None)).replay, iters)}
    for name, quant in QUANTS.items():
        row[f"fp8_{name}_ms"] = timed(graph_of(lambda quant=quant: mlp(x, layers, quant)).replay, iters)
        row[f"fp8_{name}_ratio"] = row[f"fp8_{name}_ms"] / row["bf16_ms"]
    row["fp8_triton_eager_ms"] = timed(lambda: mlp(x, layers, quantize_for_gemm), iters)
    row["fp8_plain_ops_eager_ms"] = timed(lambda: mlp(x, layers, plain_ops), iters)
    kernels = {}
    if tokens == 128:
        for name in ("compiled_dynamic", "triton"):
            graph = graph_of(lambda name=name: mlp(x, layers, QUANTS[name]))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
            found = [{"name": e.key[:90], "count": e.count // 5, "us_per_step": e.device_time_total / 5}
                     for e in prof.key_averages() if e.device_time_total > 0]
            kernels[f"profile_128_{name}"] = sorted(found, key=lambda e: -e["us_per_step"])[:12]
    return row, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,128,1024")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    layers = [(block_quantized(F, H, dev), block_quantized(H, F, dev)) for _ in range(LAYERS)]
    result: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                    "events_in_graph": events_in_graph(), "bitwise": {}, "per_kernel": [], "mlp": []}
    for k in (H, F):
        for m in (4, 16, 128, 1000):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 3
            x[0, :128] = 0  # an all-zero group
            q0, s0 = plain_ops(x)
            q1, s1 = quantize_for_gemm(x)
            result["bitwise"][f"{m}x{k}"] = {
                "codes_equal": bool(torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))),
                "scales_equal": bool(torch.equal(s0, s1)), "scale_strides": [s1.stride(), s0.stride()]}
    for tokens in (int(t) for t in args.tokens.split(",")):
        for k, n, idx in ((H, F, 0), (F, H, 1)):
            result["per_kernel"].append(per_kernel(tokens, k, n, [lay[idx] for lay in layers], args.iters, dev))
            print(json.dumps(result["per_kernel"][-1]), flush=True)
        row, kernels = whole_mlp(tokens, layers, args.iters, dev)
        result["mlp"].append(row)
        result.update(kernels)
        print(json.dumps(row), json.dumps(kernels), flush=True)
    print(json.dumps({k: v for k, v in result.items() if k in ("events_in_graph", "bitwise")}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print("| tokens | shape | gemm bf16 | gemm fp8 | split-K 2 | fp8 GB/s | quant plain | compiled dyn "
          "| compiled static | triton |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["per_kernel"]:
        print(f"| {r['tokens']} | {r['shape']} | {r['gemm_bf16_ms']:.4f} | {r['gemm_fp8_ms']:.4f} | "
              f"{r.get('gemm_fp8_split_k2_ms', float('nan')):.4f} | "
              f"{r['weight_gbps_fp8']:.0f} | {r['quant_plain_ops_ms']:.4f} | {r['quant_compiled_dynamic_ms']:.4f} | "
              f"{r['quant_compiled_static_ms']:.4f} | {r['quant_triton_ms']:.4f} |")
    print("| tokens | bf16 | fp8 plain | compiled dyn | compiled static | triton | triton × bf16 "
          "| triton eager |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["mlp"]:
        print(f"| {r['tokens']} | {r['bf16_ms']:.3f} | {r['fp8_plain_ops_ms']:.3f} | "
              f"{r['fp8_compiled_dynamic_ms']:.3f} | "
              f"{r['fp8_compiled_static_ms']:.3f} | {r['fp8_triton_ms']:.3f} | {r['fp8_triton_ratio']:.3f} | "
              f"{r['fp8_triton_eager_ms']:.3f} |")


if __name__ == "__main__":
    main()
