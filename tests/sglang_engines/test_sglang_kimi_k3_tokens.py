"""Kimi K3 (KDA + MLA + latent MoE + attention residuals) in SGLang 0.5.23 on the CPU, by its tokens: greedy tokens
and each token's log-probability, bit for bit, through SGLang's own loader, shardprep's full mode and its sharded
mode.

K3's forward runs here with the test plugin k3_ops.py (torch references for the six Triton / compiled ops a CPU
lacks, each checked in test_k3_ops.py) and kimi_k3_build.py (K3 built on the CPU). The model is K3's text layout
as SGLang loads one (`KimiK3LinearForCausalLM`, tests/support/checkpoints.py), with peaked logits: norms 1 + 0.02·N, the
KDA short convolutions 0.5·N, the LM head ×4 and `enable_fp32_lm_head`, without which the tiny model's bf16 logits
tie and a token would not depend on every weight. That it does is shown here: the same model with one KDA layer's
o_proj doubled gives another first token than full mode at tp 1 (on the second prompt, SGLang 0.5.23 on this CPU).

The comparisons:
- tp 2, dp 2 under DP attention (attention TP 1; one shard group of two DP ranks), an uneven load (three requests
  of 8, 2 and 6 tokens: one rank finishes first and keeps stepping on SGLang's idle batches while the other
  decodes): full mode = SGLang's own loader; and sharded mode over two `launch_server` nodes on this host, each
  node's directory holding only its own rank file, asked over HTTP = full mode.

K3's shared experts are not sharded: SGLang 0.5.23 splits them over its TP ranks unless its MoE runs an all-to-all
backend (none does on the CPU), and shardprep's sharded mode rightly refuses a target SGLang splits
(test_sglang_kimi_k3.py). The directory is converted with the `kimi-k3` preset less its shared experts, which stay
replicated and are loaded as SGLang loads them. The MLP widths are 128 and 64 (SGLang on the CPU pads them to a
multiple of 32·TP otherwise). Every engine of this module runs in one process (sglang_runs.py). Skipped where SGLang
is not installed.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(3600)

from k3_ops import ENV as K3_OPS  # noqa: E402
from k3_ops import LINE  # noqa: E402
from kimi_k3_build import ENV as BUILD  # noqa: E402
from sglang_runs import check_nodes_served_their_rank_files, node_directories, run_engines  # noqa: E402
from support.checkpoints import make_kimi_k3_checkpoint  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.selection import load_preset  # noqa: E402

L = 4  # KDA in layers 0, 1, 3, MLA in layer 2; layer 0 dense
PROMPTS = ["hello world", "a b c", "the model shard weights"]
TOKENS = [8, 2, 6]
PEAKED = {"enable_fp32_lm_head": True}
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
SHARDED = {"load_format": "shardprep", **DP_ATTENTION, "model_loader_extra_config": json.dumps({"shard_weights": True}),
           "trust_remote_code": True}
"""What the two sharded nodes run (docs/recipes.md's SGLang K3 recipe is held to it, test_sglang_recipes.py)."""
DOUBLED = "model.layers.1.self_attn.o_proj.weight"
"""The KDA layer's output projection the failing comparison doubles."""


def without_shared_experts(path) -> str:
    """The `kimi-k3` preset less its shared experts, written to `path`."""
    preset = load_preset("kimi-k3")
    path.write_text(json.dumps({
        "name": "kimi-k3-without-shared-experts", "targets": [t for t in preset.targets if "shared_experts" not in t],
        "fused": [{"name": r.name, "members": list(r.members), "pad_rows_to": r.row_multiple} for r in preset.fused
                  if "shared_experts" not in r.name]}))
    return str(path)


def with_doubled(src, directory):
    """A copy of checkpoint `src` whose DOUBLED weight is twice its value (exact in bf16)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, directory)
    tensors = load_file(src / "model.safetensors")
    tensors[DOUBLED] = tensors[DOUBLED] * 2
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(results, the runner's log, the converted directory)."""
    root = tmp_path_factory.mktemp("sglang-kimi-k3-tokens")
    src = make_kimi_k3_checkpoint(root / "text", layers=L, sglang_text=True, intermediate_size=128,
                                  moe_intermediate_size=64, lm_head_scale=4.0)
    doubled = with_doubled(src, root / "doubled")
    out = root / "out"
    convert(src, out, 2, preset=without_shared_experts(root / "preset.json"))

    def run(name, model, **engine):
        # refusal: a scheduler that fails is recorded as this run's error, and the next engine still starts
        return {"name": name, "model": str(model), "engine": {**PEAKED, **engine}, "prompts": PROMPTS,
                "max_tokens": TOKENS, "logprobs": True, "refusal": True}

    server = [arg for key, value in {**SHARDED, **PEAKED}.items()
              for arg in [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])]
    plan = {"env": {BUILD: "1", K3_OPS: "1"},
            # Full mode = SGLang's loader is checked under DP attention (attention TP 1, as at tp 1) only: a tp-1
            # pair of the same comparison cost 75 s of CI and showed nothing more.
            "runs": [run("full tp1", out, load_format="shardprep"), run("doubled tp1", doubled),
                     run("loader dp2", src, **DP_ATTENTION),
                     run("full dp2", out, load_format="shardprep", **DP_ATTENTION),
                     {"name": "sharded two nodes", "model": str(out), "server": server, "prompts": PROMPTS,
                      "max_tokens": TOKENS, "logprobs": True, "node_models": node_directories(out, root, 2)}]}
    results, log = run_engines(plan, root, timeout=3600)
    return results, log, out


def generated(results: dict, name: str) -> dict:
    run = results[name]
    assert "tokens" in run, run
    assert [len(t) for t in run["tokens"]] == TOKENS and [len(p) for p in run["logprobs"]] == TOKENS
    return run


def test_k3_generates_through_the_torch_references_in_every_engine(engines):
    results, log, _ = engines
    assert log.count(LINE) >= len(results)  # each engine's scheduler process(es) registered them
    for name in results:
        generated(results, name)


def test_doubling_one_kda_layers_o_proj_changes_the_first_token(engines):
    results = engines[0]
    full, doubled = generated(results, "full tp1"), generated(results, "doubled tp1")
    assert [t[0] for t in doubled["tokens"]] != [t[0] for t in full["tokens"]]


def test_full_mode_gives_sglangs_own_loaders_tokens_and_logprobs_under_dp_attention_with_uneven_load(engines):
    results = engines[0]
    full, loader = generated(results, "full dp2"), generated(results, "loader dp2")
    assert full["tokens"] == loader["tokens"] and full["logprobs"] == loader["logprobs"]


def test_two_sharded_nodes_each_holding_only_its_rank_file_give_full_modes_tokens_and_logprobs(engines):
    results, log, out = engines
    sharded, full = generated(results, "sharded two nodes"), generated(results, "full dp2")
    assert sharded["tokens"] == full["tokens"] and sharded["logprobs"] == full["logprobs"]
    check_nodes_served_their_rank_files(out, log, 2)
