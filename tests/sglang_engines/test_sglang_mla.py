"""SGLang's `--load-format shardprep` on a tiny DeepSeek-V3 (MLA + MoE with a shared expert), SGLang 0.5.23 on the
CPU, under DP attention (`tp_size=2, dp_size=2, enable_dp_attention=True`: attention TP 1, two DP ranks, one shard
group of two): sharded mode gives full mode's tokens, bit for bit, under an uneven load, and the sharded engine's KV
pool is larger than the full one's by the bytes sharding saved. (That full mode under DP attention gives SGLang's
own loader's tokens from the source is checked on this model in block FP8, test_sglang_fp8.py, and in bf16 on
Qwen3-MoE, test_sglang_full_mode.py; an engine here costs a minute of CI, so not again.)

The `deepseek-v3` preset shards q_a_proj + kv_a_proj_with_mqa, q_b_proj, o_proj and the shared expert, and never
kv_b_proj. SGLang fuses q_a_proj and kv_a_proj_with_mqa into `fused_qkv_a_proj_with_mqa` (the preset's fused view
binds to it), and after loading absorbs kv_b_proj into `w_kc`/`w_vc` (`post_load_weights`), reading only
kv_b_proj, which is loaded whole from the replicated part. The shared expert is replicated under DP attention only
with `SGLANG_SHARED_EXPERT_TP1=1` (SGLang's switch, which an all-to-all MoE backend such as DeepEP implies): the
engines run with it, and one runs without it, whose shared expert SGLang splits over TP, which sharded mode refuses
in one line. The checkpoint is `deepseek-v3-published` (tests/support/checkpoints.py): the `deepseek-v3` fixture with
the config keys SGLang reads that transformers leaves out (YaRN rope, MoE keys), experts 64 wide, 8 layers (with fewer
than 5 equal layers a rank's R/N + 2 slots exceed R).

The load is uneven: three requests asking for 8, 2 and 6 tokens over two DP ranks, so one rank runs SGLang's
IDLE batches while the other decodes, and its gathers must pair with the busy rank's.

KV sizing: the full and sharded engines size their KV pool under the test plugin fixed_cpu_memory.py (free memory
= a fixed budget minus the bytes of every live CPU tensor, in place of the host's free memory, which other
processes move by gigabytes), without the `max_total_tokens` cap of the other engines. Everything else of SGLang's
sizing is its own. The MLA engines need the test plugin torch_native_mla.py (MLA's absorbed path in prefill too).

Every engine of this module runs in one process (sglang_runs.py). Skipped where SGLang is not installed.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(1800)

from sglang_runs import run_engines  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402

PROMPTS = ["hello world", "a b c", "the model shard weights"]
TOKENS = [8, 2, 6]
LAYERS = 8
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
SHARDED = {"model_loader_extra_config": '{"shard_weights": true}'}
REPLICATED_SHARED_EXPERT = {"SGLANG_SHARED_EXPERT_TP1": "1"}
FIXED_MEMORY = {**REPLICATED_SHARED_EXPERT, "SHARDPREP_TEST_CPU_MEMORY_BYTES": str(64 << 20)}
UNCAPPED = {"max_total_tokens": None}  # the pool as SGLang sizes it
STARTUP = (r"shardprep: DP rank (\d) of 2 serves (\S+) sharded: (\d+) layers bound .*?resident target bytes (\d+) = "
           r"R/N (\d+) \+ 2 slots (\d+) \(\+ (\d+) alignment padding\), against (\d+) for full weights; .*?rank file "
           r"(\d) of 2.*?; (\d+) target weights built without storage")


@pytest.fixture(scope="module")
def engines(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-mla")
    src = checkpoint_cache("deepseek-v3-published", layers=LAYERS)
    out = root / "out"
    convert(src, out, 2, preset="deepseek-v3")

    def run(name, model, env, **engine):
        return {"name": name, "model": str(model), "engine": {**DP_ATTENTION, **engine}, "prompts": PROMPTS,
                "max_tokens": TOKENS, "env": env}

    plan = {"runs": [run("full", out, FIXED_MEMORY, load_format="shardprep", **UNCAPPED),
                     run("sharded", out, FIXED_MEMORY, load_format="shardprep", **UNCAPPED, **SHARDED),
                     # SGLang's default: the shared expert split over TP 2, not replicated; refused at load.
                     {**run("split shared expert", out, {}, load_format="shardprep", **SHARDED), "refusal": True}]}
    results, log = run_engines(plan, root)
    return results, log, out


def startup_lines(log: str) -> list[tuple[str, ...]]:
    """The sharded engine's startup lines (it logs them while it loads, after the full engine's tokens)."""
    return re.findall(STARTUP, log.split("ENGINE-TIME 'full'")[1].split("ENGINE-TIME 'sharded'")[0])


def test_mla_sharded_mode_gives_full_modes_tokens_bit_for_bit_under_uneven_load(engines):
    results = engines[0]
    assert "tokens" in results["full"], results["full"]
    assert [len(t) for t in results["full"]["tokens"]] == TOKENS
    assert results["sharded"]["tokens"] == results["full"]["tokens"]


def test_each_rank_binds_sglangs_fused_qkv_a_proj_with_mqa_and_builds_every_target_without_storage(engines):
    # Layers 1.. (convert leaves layer 0, the dense one, replicated), each with five: q_a + kv_a (SGLang's
    # fused_qkv_a_proj_with_mqa), q_b_proj, o_proj, the shared expert's gate_up_proj and down_proj. Not kv_b_proj.
    lines = startup_lines(engines[1])
    assert sorted(line[0] for line in lines) == ["0", "1"], lines
    for rank, served, layers, *_, rank_file, made in lines:
        assert served == str(engines[2]) and rank_file == rank
        assert (int(layers), int(made)) == (LAYERS - 1, 5 * (LAYERS - 1))


def test_kv_pool_of_the_sharded_engine_is_larger_by_the_bytes_sharding_saved(engines):
    results, log, out = engines
    config = json.loads((out / "config.json").read_text())
    # One token's KV cache in SGLang's MLA pool: the latent and the rope key, bf16, in every layer.
    per_token = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2 * config["num_hidden_layers"]
    lines = startup_lines(log)
    # SGLang sizes both ranks' pools from the smaller free memory of the two: the rank holding more.
    held = max(int(resident) + int(padding) for _, _, _, resident, _, _, padding, *_ in lines)
    saved = int(lines[0][7]) - held
    more = results["sharded"]["max_total_num_tokens"] - results["full"]["max_total_num_tokens"]
    assert saved > per_token and more > 0, (saved, more)
    # SGLang floors the pool to whole tokens (one token's bytes), and what else differs between the two engines'
    # live tensors is the gatherer's bookkeeping (tags, one-element placeholders: hundreds of bytes), against a
    # saving of 65 kB here.
    assert abs(more * per_token - saved) <= per_token + 4096, (more, per_token, saved)


def test_a_shared_expert_that_sglang_splits_over_tp_is_refused_in_one_line(engines):
    results, log, out = engines
    assert "tokens" not in results["split shared expert"], results["split shared expert"]
    assert (f"{out}: SGLang splits the target model.layers.1.mlp.shared_experts.gate_up_proj over its 2 TP ranks, so "
            "it is not replicated under DP attention and cannot be sharded; set SGLANG_SHARED_EXPERT_TP1=1") in log
