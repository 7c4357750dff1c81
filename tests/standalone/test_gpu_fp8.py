"""Block-FP8 models on one GPU (marked `gpu`, skipped without CUDA): torch's block-scaled GEMM, through the
binding, eagerly and in a CUDA graph, gives the resident model's bytes.

`python3 -m pytest -q -m gpu tests/standalone/test_gpu_fp8.py` (part of `benchmarks/gpu_checks.sh one-gpu`).

The CUDA-graph case is a block-FP8 Llama: transformers' MoE routing (the experts loop that the FP8 layers
run) reads which experts were hit on the host, which no CUDA graph can capture, so the DeepSeek-V3 (MLA +
MoE) case is eager only. On one GPU the directory is converted for one rank: a "gather" is a local copy.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support.fp8_fixture import quantize_checkpoint_fp8
from support.spawn_group import run_ranks

from shardprep.planning.profile_format import load_profile
from shardprep.prep.convert import convert
from shardprep.prep.export import export

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def fp8_dirs(checkpoint_cache, tmp_path_factory):
    """{arch: (converted for 1 rank, its export as a plain checkpoint)}, each block FP8 requantized to UE8M0."""
    root = tmp_path_factory.mktemp("gpu-fp8")
    dirs = {}
    # hidden 512: Llama's attention projections read 4 blocks of K, so they take the GEMM path (its MLP does not)
    for arch, preset, hidden in (("llama", "llama", 512), ("deepseek-v3-mla-blocks", "deepseek-v3", 256)):
        src = quantize_checkpoint_fp8(checkpoint_cache(arch, layers=4, hidden=hidden), root / f"{arch}-fp8")
        out, plain = root / f"{arch}-out", root / f"{arch}-plain"
        convert(src, out, 1, preset=preset)
        export(out, plain)
        dirs[arch] = (out, plain)
    return dirs


def test_the_block_scaled_gemm_is_the_float64_product_of_its_dequantized_operands():
    from support.fp8_fixture import quantize_block_fp8

    from shardprep.standalone.block_fp8 import block_fp8_linear, dequantize_blocks, quantize_activations, uses_scaled_mm

    torch.manual_seed(0)
    for m, k, n in ((64, 7168, 1536), (16, 8192, 28672), (5, 512, 256)):
        weight, scale = quantize_block_fp8(torch.randn(n, k))
        weight, scale = weight.cuda(), scale.cuda()
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert uses_scaled_mm(x, weight, (128, 128))
        got = block_fp8_linear(x, weight, scale, (128, 128)).double()
        # Both operands as the GEMM sees them: the activations' e4m3 codes times their 1×128 scales.
        codes, x_scale = quantize_activations(x)
        x_seen = dequantize_blocks(codes, x_scale, (1, 128), torch.float64)
        ref = x_seen @ dequantize_blocks(weight, scale, (128, 128), torch.float64).T
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 4e-3, (m, k, n, err)  # the bf16 output's rounding, and the accumulation's


@pytest.mark.parametrize("m,k", [(4, 512), (16, 8192), (100, 28672), (1000, 7168)])
def test_the_triton_quantization_gives_the_torch_ops_codes_and_scales_bit_for_bit(m, k):
    from shardprep.standalone.block_fp8 import quantize_activations
    from shardprep.standalone.fp8_activation_kernel import quantize_for_gemm

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 5
    x[0, :128] = 0  # an all-zero group
    x[-1, -128:] *= 1e-30  # a tiny one
    codes, scale = quantize_for_gemm(x)
    want_codes, want_scale = quantize_activations(x)
    assert scale.stride() == (1, m)  # outer-dim-major, as the GEMM takes it
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("m,k,n", [(24, 512, 256), (5, 1024, 640), (16, 4096, 4096), (3, 1536, 24576)])
def test_the_block_scaled_gemm_reads_only_its_operands(m, k, n):
    # Each operand copied elsewhere (and the old copy overwritten) gives the same bits: the GEMM path reads no
    # byte outside its operands (with K/128 not a multiple of 4 cuBLAS's did; uses_scaled_mm keeps those off it).
    from support.fp8_fixture import quantize_block_fp8

    from shardprep.standalone.block_fp8 import block_fp8_linear, uses_scaled_mm

    torch.manual_seed(1)
    weight, scale = (t.cuda() for t in quantize_block_fp8(torch.randn(n, k)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert uses_scaled_mm(x, weight, (128, 128))
    want = block_fp8_linear(x, weight, scale, (128, 128))
    for _ in range(5):
        pad = torch.empty(int(torch.randint(1, 1 << 16, ())), dtype=torch.uint8, device="cuda")  # move the allocator
        x2, w2, s2 = x.clone(), weight.clone(), scale.clone()
        x.fill_(0), weight.view(torch.uint8).fill_(0x7E), scale.fill_(float("nan"))  # the old copies overwritten
        got = block_fp8_linear(x2, w2, s2, (128, 128))
        x, weight, scale = x2, w2, s2
        assert torch.equal(got, want)
        del pad


def _graph_rank(rank, world_size, out, plain, graphs):
    from shardprep.standalone.block_fp8 import uses_scaled_mm
    from shardprep.standalone.hf_model import build_model, load_unsharded

    device = torch.device("cuda", 0)
    ids = torch.remainder(torch.arange(24, device=device) * 7 + 3, 128).view(1, 24)
    with torch.inference_mode():
        binding = build_model(out, device)
        model = binding.model
        fp8 = [m for m in model.modules() if type(m).__name__ == "FP8Linear"]
        scaled = sum(uses_scaled_mm(ids.new_empty(1, m.in_features, dtype=torch.bfloat16), m.weight, (128, 128))
                     for m in fp8)
        eager = model(ids, use_cache=False).logits
        again = model(ids, use_cache=False).logits
        replays = []
        if graphs:
            side = torch.cuda.Stream(device)  # warm-up off the capture stream, as CUDA graphs want
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                model(ids, use_cache=False)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static = model(ids, use_cache=False).logits
            for _ in range(3):
                static.zero_()
                graph.replay()
                replays.append(bool(torch.equal(static, eager)))
        resident = load_unsharded(plain, device)(ids, use_cache=False).logits
    return {"fp8_layers": len(fp8), "scaled_mm_layers": scaled, "eager_twice": bool(torch.equal(eager, again)),
            "replays": replays, "resident": bool(torch.equal(eager, resident))}


@pytest.mark.parametrize("arch,graphs", [("llama", True), ("deepseek-v3-mla-blocks", False)])
def test_a_bound_block_fp8_model_gives_the_resident_bytes_eagerly_and_in_a_cuda_graph(fp8_dirs, arch, graphs):
    out, plain = fp8_dirs[arch]
    (result,) = run_ranks(_graph_rank, 1, str(out), str(plain), graphs, backend="nccl", timeout=800)
    assert result["fp8_layers"] > 0 and result["scaled_mm_layers"] > 0, result
    assert result == {**result, "eager_twice": True, "resident": True, "replays": [True] * 3 if graphs else []}


def _profile(out, tmp_path, name, *extra):
    path = tmp_path / f"{name}.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NCCL_NVLS_ENABLE="0")
    proc = subprocess.run([sys.executable, "-m", "shardprep", "profile", str(out), "--nproc", "1", "--tokens", "16",
                           "--iters", "5", "--warmup", "1", "--out", str(path), *extra],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_profile(path), proc.stdout


def test_profile_times_cuda_graph_replays_and_says_so(fp8_dirs, tmp_path):
    graphed, printed = _profile(fp8_dirs["llama"][0], tmp_path, "graphs")
    assert (graphed.compute_mode, graphed.compute_mode_note) == ("cuda-graph", "")
    assert "CUDA-graph replays" in printed
    assert all(ms > 0 for lay in graphed.layers for ms in lay.compute_ms)
    assert graphed.backends[0].sharded_step_ms[0] > 0
    eager, _ = _profile(fp8_dirs["llama"][0], tmp_path, "eager", "--eager")
    assert (eager.compute_mode, eager.compute_mode_note) == ("eager", "eager asked for (--eager)")
    # A tiny model's eager forward is its host's launches; a replay is its kernels.
    assert graphed.replicated_step_ms[0] < eager.replicated_step_ms[0]


def test_profile_refuses_a_forward_no_graph_can_hold_in_one_line_naming_eager(fp8_dirs, tmp_path):
    # transformers' expert loop reads on the host which experts were hit: no graph can hold it.
    out = fp8_dirs["deepseek-v3-mla-blocks"][0]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NCCL_NVLS_ENABLE="0")
    proc = subprocess.run([sys.executable, "-m", "shardprep", "profile", str(out), "--nproc", "1", "--tokens", "16",
                           "--iters", "2", "--out", str(tmp_path / "p.json")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode != 0
    assert "could not be captured in a CUDA graph" in proc.stderr and "profile it with --eager" in proc.stderr, \
        proc.stderr[-2000:]
    moe, _ = _profile(out, tmp_path, "moe", "--eager")
    assert moe.compute_mode == "eager" and moe.backends[0].sharded_step_ms[0] > 0
