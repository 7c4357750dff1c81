"""The GPU checks, as tests (marked `gpu`, skipped without CUDA): CUDA gives the CPU's bytes, and
`shardprep run --device cuda` gives transformers' outputs on the same GPU, bit for bit.

On a GPU machine: `python3 -m pytest -q -m gpu tests/standalone/test_gpu_checks.py tests/runtime/test_gpu_runtime.py`.
"""

from __future__ import annotations

import filecmp
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.checkpoints import make_checkpoint
from support.fp8_fixture import quantize_checkpoint_fp8
from support.runs import transformers_outputs

from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert
from shardprep.prep.requant_jobs import RequantOptions
from shardprep.requant import requant_ue8m0

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn


def random_case(shape: tuple[int, ...], seed: int, log_scale_range=(-14.0, -2.0)):
    gen = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    weight = (torch.randn(shape, generator=gen) * 120).clamp(-448, 448).to(FP8)
    scale_shape = (*lead, math.ceil(n / 128), math.ceil(k / 128))
    scale = torch.empty(scale_shape).uniform_(*log_scale_range, generator=gen).exp()
    return weight, scale


def zero_blocks_case():
    weight, scale = random_case((384, 300), seed=3)
    weight[:128, :128] = 0  # all-zero block: scale 2^-22
    scale[1, 1] = 1e-12  # amax under the 1e-4 floor
    return weight, scale


def pow2_edges_case():
    """Blocks whose maximum is exactly 448 * 2^k, and a few float32 ulps above it (the fp32 recipe's only
    window where torch.log2 would disagree with exponent bits)."""
    weight = torch.zeros(128 * 4, 128 * 8)
    weight[::128, ::128] = 448.0
    k = torch.arange(-24, 8, dtype=torch.float32).view(4, 8)
    bits = torch.pow(2.0, k).view(torch.int32) + torch.arange(32, dtype=torch.int32).view(4, 8) % 4
    return weight.to(FP8), bits.view(torch.float32)


def bf16_scales_case():
    weight, scale = random_case((300, 300), seed=6)
    return weight, scale.to(torch.bfloat16)


CASES = {
    "2d-aligned": lambda: random_case((512, 384), seed=1),
    "2d-tails": lambda: random_case((300, 200), seed=2),
    "3d-experts-tails": lambda: random_case((8, 200, 136), seed=4),
    "zero-blocks": zero_blocks_case,
    # Down to e^-90: products of small codes and small scales are float32 subnormals.
    "extreme-scales": lambda: random_case((640, 640), seed=5, log_scale_range=(-90.0, 75.0)),
    "pow2-edges": pow2_edges_case,
    "bf16-scales": lambda: bf16_scales_case(),
    "2d-large-multipass": lambda: random_case((4096, 7168), seed=7),
}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many bytes differ (0 when identical)."""
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())




@pytest.mark.parametrize("recipe", ["sglang", "fp32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_requant_on_cuda_gives_the_cpu_bytes(case, recipe):
    weight, scale = CASES[case]()
    cpu_q, cpu_s = requant_ue8m0(weight, scale, recipe=recipe, name=case)
    cuda_q, cuda_s = requant_ue8m0(weight, scale, recipe=recipe, name=case, device="cuda")
    assert same_bytes(cpu_q, cuda_q) == 0 and same_bytes(cpu_s, cuda_s) == 0


def test_convert_on_cuda_writes_the_cpu_files(tmp_path):
    # hidden 160: every weight has tail blocks.
    bf16 = make_checkpoint(tmp_path / "bf16", "deepseek-v3", hidden=160, sharded=True, tokenizer=False)
    fp8 = tmp_path / "fp8"
    quantize_checkpoint_fp8(bf16, fp8)
    outs = {}
    for device in ("cpu", "cuda"):
        outs[device] = tmp_path / f"out-{device}"
        summary = convert(fp8, outs[device], 4, preset="deepseek-v3", requant=RequantOptions(device=device))
        assert summary.requantized_tensors > 0
    files = sorted(p.relative_to(outs["cpu"]) for p in outs["cpu"].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(outs["cuda"]) for p in outs["cuda"].rglob("*") if p.is_file())
    differ = [str(f) for f in files if f.name != "shard_manifest.json"
              and not filecmp.cmp(outs["cpu"] / f, outs["cuda"] / f, shallow=False)]
    assert not differ


K = 8
PROMPTS = ["hello world", "the model", "shard the weights gpu rank layer fast"]  # rank 1 of 2 idles once
RUN_CASES = {
    "llama": (False, {"preset": "llama"}),
    "qwen3-moe": (True, {"preset": "qwen3-moe"}),
    "bert": (False, {"targets": ["*.attention.self.*.weight", "*.intermediate.dense.weight"], "layers": "all"}),
}


@pytest.mark.parametrize("backend", ["auto", "nccl", "ce"])
@pytest.mark.parametrize("arch", sorted(RUN_CASES))
def test_run_on_two_gpus_matches_transformers_bit_for_bit(arch, backend, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    sharded, convert_kw = RUN_CASES[arch]
    src = make_checkpoint(tmp_path / "src", arch, sharded=sharded)
    out = tmp_path / "out"
    convert(src, out, 2, **convert_kw)
    causal = arch != "bert"
    want = transformers_outputs(src, PROMPTS, causal, K, "cuda:0")
    saved = tmp_path / "outputs.pt"
    cmd = [sys.executable, "-m", "shardprep", "run", str(out), "--nproc", "2", "--device", "cuda", "--backend",
           backend, "--json", "--max-new-tokens", str(K), "--save-outputs", str(saved)]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    outputs = torch.load(saved)
    outputs = outputs if isinstance(outputs, list) else [outputs]
    for r, got, (tokens, ref) in zip(report["prompts"], outputs, want):
        assert not causal or r["token_ids"] == tokens
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    manifest = load_manifest(out)
    local = sum(r.chunk_bytes for r in manifest.layers)
    for m in report["ranks"]:
        assert m["device"].startswith("cuda")
        assert local <= m["shard_bytes"] <= local + 4096 * len(manifest.layers)
