"""Block-FP8 GEMMs at decode sizes on one GPU: shardprep's `block_fp8_linear` against bf16, in CUDA graphs.

The decode-shaped MLP of ../shared/MEASURED.md (8 layers of tokens × 8192 → 28672 → 8192, relu between),
each variant captured in one CUDA graph and timed by its replays (median of `--iters`, CUDA events):

- bf16: `x @ W.T`;
- fp8 plain ops: torch's block-scaled GEMM with the activation quantization as uncompiled torch ops;
- fp8 shardprep: `block_fp8_linear` as the runtime calls it (the quantization: one Triton kernel);
- also shardprep's eager time (no graph), what a forward outside a graph pays.

The floor is FP8's weight bytes over the HBM bandwidth (the datasheet's 4.8 TB/s, and a device-to-device
copy measured in the same run). One JSON line per token count, then a table.

    python3 benchmarks/bench_fp8_gemm.py --tokens 16,128,1024 --iters 50 --out fp8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardprep.standalone.block_fp8 import block_fp8_linear, quantize_activations  # noqa: E402

H, F, LAYERS = 8192, 28672, 8
DATASHEET_BYTES_PER_S = 4.8e12


def block_quantized(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 weight, its float8 codes, float32 scale per 128×128 block: amax / 448)."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    blocks = w.view(n // 128, 128, k // 128, 128).float()
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    return w, (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k), scale


def plain_ops_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The block-scaled GEMM with the activation quantization as plain torch ops, even inside a capture."""
    q, s = quantize_activations(x)
    return torch._scaled_mm(q, codes.t(), scale_a=s.t().contiguous().t(), scale_b=scale.t(), out_dtype=x.dtype)


def mlp(x: torch.Tensor, layers: list, variant: str) -> torch.Tensor:
    for (w1, q1, s1), (w2, q2, s2) in layers:
        if variant == "bf16":
            x = torch.relu(x @ w1.t()) @ w2.t()
        elif variant == "fp8_plain_ops":
            x = plain_ops_linear(torch.relu(plain_ops_linear(x, q1, s1)), q2, s2)
        else:
            x = block_fp8_linear(torch.relu(block_fp8_linear(x, q1, s1, (128, 128))), q2, s2, (128, 128))
    return x


def timed(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(x: torch.Tensor, layers: list, variant: str):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            mlp(x, layers, variant)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlp(x, layers, variant)
    return graph.replay


def copy_bandwidth(device: torch.device) -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), 20)
    return 2 * a.numel() / (ms / 1e3)  # bytes read + written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,128,1024")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    layers = [(block_quantized(F, H, device), block_quantized(H, F, device)) for _ in range(LAYERS)]
    copy_bps = copy_bandwidth(device)
    fp8_bytes = LAYERS * 2 * H * F
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16)
        row: dict = {"tokens": tokens, "device": torch.cuda.get_device_name(device), "torch": torch.__version__}
        for variant in ("bf16", "fp8_plain_ops", "fp8_shardprep"):
            row[f"{variant}_graph_ms"] = timed(graphed(x, layers, variant), args.iters)
        row["fp8_shardprep_eager_ms"] = timed(lambda x=x: mlp(x, layers, "fp8_shardprep"), args.iters)
        row["floor_datasheet_ms"] = fp8_bytes / DATASHEET_BYTES_PER_S * 1e3
        row["floor_measured_copy_ms"] = fp8_bytes / copy_bps * 1e3  # reading the weights once, at the copy's rate
        row["copy_gbps"] = copy_bps / 1e9
        row["ratio_to_bf16"] = row["fp8_shardprep_graph_ms"] / row["bf16_graph_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print("| tokens | bf16 graph | fp8 plain ops graph | fp8 shardprep graph | × bf16 | shardprep eager | floor |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['bf16_graph_ms']:.3f} | {r['fp8_plain_ops_graph_ms']:.3f} | "
              f"{r['fp8_shardprep_graph_ms']:.3f} | {r['ratio_to_bf16']:.3f} | {r['fp8_shardprep_eager_ms']:.3f} | "
              f"{r['floor_datasheet_ms']:.3f} (copy: {r['floor_measured_copy_ms']:.3f}) |")


if __name__ == "__main__":
    main()
