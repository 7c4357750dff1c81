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

In block FP8 (the same K3 shape quantized by `fp8_fixture`, with the FP8 reference kernels fp8_kernels.py; what
stays bf16 and why in FP8_BF16), at tp 2, dp 2 under DP attention with the same uneven load: SGLang's own loader on
the FP8 source = full mode of the `--requant none` output; full = sharded for that output and for the default
(UE8M0) output, each sharded rank processing its FP8 targets at load and saying so in its startup line; UE8M0 ≠ as is
(SGLang's CPU path computes with the scales it is given), so those comparisons can fail. Sharded here is one engine
(both DP ranks in it); the two-node launch is the bf16 one's.

K3's shared experts are not sharded: SGLang 0.5.23 splits them over its TP ranks unless its MoE runs an all-to-all
backend (none does on the CPU), and shardprep's sharded mode rightly refuses a target SGLang splits
(test_sglang_kimi_k3.py). The directory is converted with the `kimi-k3` preset less its shared experts, which stay
replicated and are loaded as SGLang loads them. The MLP widths are 128 and 64 in bf16 (SGLang on the CPU pads them to a
multiple of 32·TP otherwise) and 256 in block FP8 (a multiple of 128·TP there). Every engine of this module runs in
one process (sglang_runs.py). Skipped where SGLang is not installed.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(3600)

from fp8_kernels import FP8_KERNELS  # noqa: E402
from fp8_kernels import LINE as FP8_LINE  # noqa: E402
from k3_ops import ENV as K3_OPS  # noqa: E402
from k3_ops import LINE  # noqa: E402
from kimi_k3_build import ENV as BUILD  # noqa: E402
from sglang_runs import check_nodes_served_their_rank_files, node_directories, run_engines  # noqa: E402
from support.checkpoints import make_kimi_k3_checkpoint  # noqa: E402
from support.fp8_fixture import bf16_modules, quantize_checkpoint_fp8  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.requant_jobs import RequantOptions  # noqa: E402
from shardprep.prep.selection import load_preset  # noqa: E402

L = 4  # KDA in layers 0, 1, 3, MLA in layer 2; layer 0 dense
PROMPTS = ["hello world", "a b c", "the model shard weights"]
TOKENS = [8, 2, 6]
PEAKED = {"enable_fp32_lm_head": True}
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
SHARDED = {"load_format": "shardprep", **DP_ATTENTION, "model_loader_extra_config": json.dumps({"shard_weights": True}),
           "trust_remote_code": True}
"""What the two sharded nodes run (docs/recipes.md's SGLang K3 recipe is held to it, test_sglang_recipes.py)."""
SHARDED_ENGINE = {key: value for key, value in SHARDED.items() if key not in DP_ATTENTION}
DOUBLED = "model.layers.1.self_attn.o_proj.weight"
"""The KDA layer's output projection the failing comparison doubles."""
FP8_BF16 = re.compile(r"\.experts\.|shared_experts|res_proj|routed_expert_(down|up)_proj|mlp\.(gate|up|down)_proj|"
                      r"self_attn\.(q|k|v|g|b|f_a|f_b|q_a)_proj|kv_a_proj_with_mqa")
"""What the block-FP8 K3 keeps in bf16; the rest are FP8: KDA's and MLA's o_proj and MLA's q_b_proj and kv_b_proj
(all but kv_b_proj sharding targets). In SGLang 0.5.23:
- KDA's q, k, v and g projections are one merged layer (`fused_qkvg_proj`), and block FP8 takes a merged layer only
  in whole 128-row blocks per member: the tiny model's are 64 rows (K3's are multiples of 128). MLA's q_a and kv_a
  are merged likewise (64 and 576 rows; `fused_qkv_a_proj_with_mqa`, which the checkpoint's `ignored_layers` must
  name itself: SGLang's K3 does not map it to its members there, and builds it FP8 otherwise).
- KDA's b, f_a and f_b are concatenated after loading (`_merge_bfa_weights`, one dtype), and b has a row per head,
  which SGLang's CPU packing does not take (rows a multiple of 16).
- The latent MoE's routed_expert_down_proj / up_proj: SGLang's `Fp8Config` does not say
  `supports_kimi_k3_quantized_latent_projections`, so K3 builds them in bf16, and SGLang's own loader copies an FP8
  checkpoint's bytes into them without their scales (its tokens then equal full mode's, both wrong; sharded mode
  refuses the dtype in one line).
- The attention-residual projections are built unquantized; the routed experts, the shared experts and layer 0's
  MLP are not sharding targets under DP attention (split over TP), so their format does not reach shardprep here.
(MLA's g_proj stays bf16 with KDA's, by name.)"""
STARTUP = (r"shardprep: DP rank (\d) of 2 serves (\S+) sharded: .*?rank file (\d) of 2; processed at load: (\d+) "
           r"quantized modules")


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


def fp8_checkpoint(root):
    """The tiny K3 (MLP widths 256) in block FP8 as DeepSeek's checkpoints are laid out, FP8_BF16 left bf16 and named
    in `ignored_layers` with the merged names SGLang builds them under."""
    from safetensors import safe_open

    src = make_kimi_k3_checkpoint(root / "fp8-source", layers=L, sglang_text=True, intermediate_size=256,
                                  moe_intermediate_size=256, lm_head_scale=4.0)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    fused = {n.removesuffix("kv_a_proj_with_mqa.weight") + "fused_qkv_a_proj_with_mqa" for n in names
             if n.endswith("kv_a_proj_with_mqa.weight")}
    kept = bf16_modules(names, FP8_BF16) | fused
    return quantize_checkpoint_fp8(src, root / "fp8", skip=lambda name: bool(FP8_BF16.search(name)),
                                   ignored_layers=sorted(kept))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(results, the runner's log, the converted directory)."""
    root = tmp_path_factory.mktemp("sglang-kimi-k3-tokens")
    src = make_kimi_k3_checkpoint(root / "text", layers=L, sglang_text=True, intermediate_size=128,
                                  moe_intermediate_size=64, lm_head_scale=4.0)
    doubled = with_doubled(src, root / "doubled")
    out = root / "out"
    preset = without_shared_experts(root / "preset.json")
    convert(src, out, 2, preset=preset)
    fp8 = fp8_checkpoint(root)
    fp8_outs = {"as-is": root / "fp8-as-is", "ue8m0": root / "fp8-ue8m0"}
    convert(fp8, fp8_outs["as-is"], 2, preset=preset, requant=RequantOptions(mode="none"))
    convert(fp8, fp8_outs["ue8m0"], 2, preset=preset)

    def run(name, model, env=None, **engine):
        # refusal: a scheduler that fails is recorded as this run's error, and the next engine still starts
        return {"name": name, "model": str(model), "engine": {**PEAKED, **engine}, "prompts": PROMPTS,
                "max_tokens": TOKENS, "logprobs": True, "refusal": True, "env": env or {}}

    server = [arg for key, value in {**SHARDED, **PEAKED}.items()
              for arg in [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])]
    plan = {"env": {BUILD: "1", K3_OPS: "1"},
            # Full mode = SGLang's loader is checked under DP attention (attention TP 1, as at tp 1) only: a tp-1
            # pair of the same comparison cost 75 s of CI and showed nothing more.
            "runs": [run("full tp1", out, load_format="shardprep"), run("doubled tp1", doubled),
                     run("loader dp2", src, **DP_ATTENTION),
                     run("full dp2", out, load_format="shardprep", **DP_ATTENTION),
                     {"name": "sharded two nodes", "model": str(out), "server": server, "prompts": PROMPTS,
                      "max_tokens": TOKENS, "logprobs": True, "node_models": node_directories(out, root, 2)},
                     # Block FP8: the kernels' plugin on for these runs only (the bf16 ones above run as before).
                     run("fp8 loader dp2", fp8, **DP_ATTENTION, env=FP8_KERNELS),
                     *[run(f"fp8 {mode} {how} dp2", fp8_outs[mode], **DP_ATTENTION, env=FP8_KERNELS,
                           **({"load_format": "shardprep"} if how == "full" else SHARDED_ENGINE))
                       for mode in fp8_outs for how in ("full", "sharded")]]}
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


def test_block_fp8_k3_full_mode_as_is_gives_sglangs_own_loaders_tokens_and_logprobs_under_dp_attention(engines):
    results, log, _ = engines
    assert FP8_LINE in log  # SGLang's block-FP8 CPU path ran, its kernels the plugin's
    loader, full = generated(results, "fp8 loader dp2"), generated(results, "fp8 as-is full dp2")
    assert full["tokens"] == loader["tokens"] and full["logprobs"] == loader["logprobs"]


@pytest.mark.parametrize("mode", ["as-is", "ue8m0"])
def test_block_fp8_k3_sharded_gives_full_modes_tokens_and_logprobs_under_uneven_load(engines, mode):
    results = engines[0]
    sharded, full = generated(results, f"fp8 {mode} sharded dp2"), generated(results, f"fp8 {mode} full dp2")
    assert sharded["tokens"] == full["tokens"] and sharded["logprobs"] == full["logprobs"]


def test_ue8m0_scales_change_the_block_fp8_k3s_logprobs_on_sglangs_cpu_path(engines):
    results = engines[0]
    assert generated(results, "fp8 ue8m0 full dp2")["logprobs"] != generated(results, "fp8 as-is full dp2")["logprobs"]


def test_each_sharded_rank_processes_the_block_fp8_k3s_targets_at_load(engines):
    _, log, out = engines
    lines = re.findall(STARTUP, log.split("ENGINE-TIME 'fp8 as-is full dp2'")[1])
    manifest = load_manifest(out.parent / "fp8-as-is")
    fp8_targets = [e.name for r in manifest.layers for e in r.entries if e.dtype == "F8_E4M3"]
    # Layers 1..3 bound: KDA's o_proj in 1 and 3, MLA's o_proj and q_b_proj in 2 (kv_b_proj is no target).
    assert len(fp8_targets) == 4, fp8_targets
    for mode in ("fp8-as-is", "fp8-ue8m0"):
        mine = [line for line in lines if line[1] == str(out.parent / mode)]
        assert sorted((rank, rank_file) for rank, _, rank_file, _ in mine) == [("0", "0"), ("1", "1")], lines
        assert all(int(modules) == len(fp8_targets) for *_, modules in mine)
