"""The draft's first gather off the target's forward (`prefetch_draft()`, gatherer.py "The draft's first gather"), on
real gloo groups of 2 ranks, against the source checkpoint: prefetched, inline at a cold start, and in the target's
forward (today's schedule) give the same bytes; skipped draft steps keep the ranks aligned; misuse is refused or
harmless. CUDA graphs: tests/runtime/test_gpu_draft_prefetch.py.

Three drafts: DeepSeek-V3's MTP layer as convert records it (one layer after two target layers), and a Llama's last
two layers, or last layer, recorded as a draft (the gatherer reads only the record's layers, whatever made them).
Every rank loads from a directory that holds only its own rank file.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
import torch
from support.spawn_group import run_ranks
from test_gatherer import _error, _mismatches, local_only_dir

from shardprep.prep.convert import convert

N = 2
DRAFTS = {"mtp": None, "two-layer": (4, 5), "one-layer": (5,)}  # layers marked as a draft's in the Llama's manifest


@pytest.fixture(scope="module")
def runs(checkpoint_cache, conversion_cache, tmp_path_factory):
    """draft name → (source dir, per-rank results)."""
    root = tmp_path_factory.mktemp("draft-prefetch")
    mtp_src, llama_src = checkpoint_cache("deepseek-v3-mtp", layers=3), checkpoint_cache("llama", layers=6)
    mtp_out = conversion_cache(mtp_src, N, preset="deepseek-v3")
    llama_out = conversion_cache(llama_src, N, preset="llama")
    cases = {name: (str(mtp_src if marked is None else llama_src), marked,
                    [str(local_only_dir(mtp_out if marked is None else llama_out, r, root / f"{name}-{r}"))
                     for r in range(N)]) for name, marked in DRAFTS.items()}
    results = run_ranks(_suite, N, cases, timeout=400)
    return {name: (cases[name][0], [r[name] for r in results]) for name in cases}


# -- what every rank runs ---------------------------------------------------------------------------
def _suite(rank: int, n: int, cases: dict) -> dict:
    return {name: _case(rank, n, src, marked, dirs) for name, (src, marked, dirs) in cases.items()}


def _case(rank, n, src_dir, marked, dirs) -> dict:
    import torch.distributed as dist
    from support.checkpoints import read_state_dict

    from shardprep.loader.rank_shards import RankShards, open_rank
    from shardprep.manifests.draft_layers import MTP, DraftLayers
    from shardprep.runtime import LayerGatherer

    src = read_state_dict(src_dir)
    shards = open_rank(dirs[rank], rank, n)
    if marked is not None:
        shards = RankShards(replace(shards.manifest, draft=DraftLayers(MTP, marked)), rank, shards.buffer)
    manifest = shards.manifest
    out: dict = {"layers": [r.layer for r in manifest.layers], "draft": list(manifest.draft.layers)}

    def target(g):
        g.begin()
        bad = []
        for layer in g.layers[:g._draft_at]:
            bad += _mismatches(g.wait(layer), manifest.layer(layer), src)
            g.done(layer)
        return bad

    def draft(g):
        bad = []
        for layer in g.layers[g._draft_at:]:
            bad += _mismatches(g.wait(layer), manifest.layer(layer), src)
            g.done(layer)
        return bad

    def step(g, prefetch=True, run_draft=True) -> dict:
        """One target forward, the prefetch, the draft: the mismatched views and who issued how many gathers."""
        bad, start = target(g), g.gathers_issued
        if prefetch:
            g.prefetch_draft()
        prefetched = g.gathers_issued - start
        if run_draft:
            bad += draft(g)
        return {"bad": bad, "by_prefetch": prefetched, "by_draft": g.gathers_issued - start - prefetched}

    today = LayerGatherer(shards)  # draft_first="auto", eager: the draft's first gather is the forward's own
    out["today"] = [step(today) for _ in range(2)]
    g = LayerGatherer(shards, draft_first="detached", timeout=timedelta(seconds=60))
    out["no_forward_yet"] = _error(g.prefetch_draft)
    out["prefetch"] = [step(g) for _ in range(3)]
    out["inline"] = [step(g, prefetch=False) for _ in range(2)]
    # Twice, and after the draft began: the later calls issue nothing.
    twice, d = step(g, run_draft=False), g.layers[g._draft_at]
    before = g.gathers_issued
    g.prefetch_draft()
    twice["again"] = g.gathers_issued - before
    twice["bad"] += _mismatches(g.wait(d), manifest.layer(d), src)
    before = g.gathers_issued
    g.prefetch_draft()
    twice["after_begun"] = g.gathers_issued - before
    g.done(d)
    twice["bad"] += _rest(g, manifest, src, g._draft_at + 1)
    out["twice"] = twice
    # During the target's forward: refused before anything is issued; the forward then goes on.
    g.begin()
    before = g.gathers_issued
    out["in_forward"] = {"error": _error(g.prefetch_draft), "issued": g.gathers_issued - before,
                         "bad": _rest(g, manifest, src, 0)}
    out["replayed"] = _error(lambda: g.prefetch_draft(replayed=True))
    # Skipped draft steps on every rank: a prefetched G(D) left unread, then a step with no prefetch at all.
    skipped = [step(g, run_draft=False), step(g, prefetch=False, run_draft=False), step(g)]
    out["skipped_everywhere"] = {"steps": skipped, "next_begin": _error(g.begin)}
    _rest(g, manifest, src, 0)
    if len(manifest.draft.layers) == 1:
        # One rank skips its draft step (no prefetch, no draft), the other runs it; then one idles through a forward.
        steps = [step(g, prefetch=rank == 0, run_draft=rank == 0), step(g)]
        if rank == 1:
            g.idle_step()
        else:
            steps.append(step(g))
        steps.append(step(g))
        out["skipped_on_one_rank"] = {"steps": steps, "next_begin": _error(g.begin)}
        _rest(g, manifest, src, 0)
    out["no_false_alarm"] = _error(g.begin) or _rest(g, manifest, src, 0) or None
    out["bad_option"] = _error(lambda: LayerGatherer(shards, draft_first="eventually"))
    if marked == (4, 5):
        # The control: the rank that skips its prefetch no longer issues G(D) at its next begin(). The ranks' gathers
        # then pair wrongly, and the alignment tags (or a timeout) must say so. On a side group: it is left unusable.
        side = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
        c = LayerGatherer(shards, group=side, draft_first="detached", timeout=timedelta(seconds=3))
        if rank == 1:
            c._issue_draft_first = lambda after_replay: None
        try:
            step(c, prefetch=rank == 0, run_draft=False)
            out["control"] = {"bad": step(c)["bad"] + step(c)["bad"], "error": _error(c.begin)}
        except Exception as exc:  # a gather that never completes, on the rank left waiting
            out["control"] = {"bad": [], "error": str(exc)}
    return out


def _rest(g, manifest, src, start) -> list[str]:
    bad = []
    for layer in g.layers[start:]:
        bad += _mismatches(g.wait(layer), manifest.layer(layer), src)
        g.done(layer)
    return bad


# -- the tests --------------------------------------------------------------------------------------
def test_the_drafts_are_where_the_records_say(runs):
    expected = {"mtp": ([1, 2, 3], [3]), "two-layer": ([1, 2, 3, 4, 5], [4, 5]), "one-layer": ([1, 2, 3, 4, 5], [5])}
    for name, (_, results) in runs.items():
        for r in results:
            assert (r["layers"], r["draft"]) == expected[name]


@pytest.mark.parametrize("draft", DRAFTS)
def test_prefetched_inline_and_in_forward_first_gathers_give_the_sources_bytes(runs, draft):
    for r in runs[draft][1]:
        # Today's schedule: the forward issued G(D) itself (and G(D+1), two slots ahead); the prefetch does nothing.
        assert r["today"] == [{"bad": [], "by_prefetch": 0, "by_draft": 0}] * 2
        # Detached: the prefetch issues G(D) (one gather), the draft's first wait only waits for it.
        later = len(r["draft"]) - 1
        assert r["prefetch"] == [{"bad": [], "by_prefetch": 1, "by_draft": later}] * 3
        # A cold start: no prefetch, the draft's first wait gathers inline.
        assert r["inline"] == [{"bad": [], "by_prefetch": 0, "by_draft": later + 1}] * 2


@pytest.mark.parametrize("draft", DRAFTS)
def test_a_second_prefetch_or_one_after_the_draft_began_issues_nothing(runs, draft):
    for r in runs[draft][1]:
        assert r["twice"] == {"bad": [], "by_prefetch": 1, "by_draft": 0, "again": 0, "after_begun": 0}
        assert r["no_forward_yet"] is None


@pytest.mark.parametrize("draft", DRAFTS)
def test_misuse_is_refused_before_any_gather_is_issued(runs, draft):
    for r in runs[draft][1]:
        assert "prefetch_draft() during the target's forward" in r["in_forward"]["error"]
        assert r["in_forward"]["issued"] == 0 and r["in_forward"]["bad"] == []
        assert "without a captured target forward to replay" in r["replayed"]
        assert "draft_first='eventually': expected one of auto, detached, in_target" in r["bad_option"]


@pytest.mark.parametrize("draft", DRAFTS)
def test_skipped_draft_steps_keep_the_ranks_aligned(runs, draft):
    for r in runs[draft][1]:
        skipped = r["skipped_everywhere"]
        assert [s["bad"] for s in skipped["steps"]] == [[], [], []] and skipped["next_begin"] is None
        if len(r["draft"]) == 1:
            one = r["skipped_on_one_rank"]
            assert all(s["bad"] == [] for s in one["steps"]) and one["next_begin"] is None
        assert r["no_false_alarm"] is None


def test_without_the_skipped_steps_gather_the_ranks_slip_and_the_tags_say_so(runs):
    messages = [r["control"]["error"] for r in runs["two-layer"][1]]
    assert any(m is not None and "misaligned" in m for m in messages), messages
    assert all(m is not None and ("misaligned" in m or "did not complete within" in m) for m in messages), messages


def test_a_bound_mtp_draft_prefetched_or_inline_reads_the_sources_weights_in_every_pass(checkpoint_cache, tmp_path,
                                                                                          world_of_one):
    import transformers
    from support.checkpoints import read_state_dict
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from shardprep.errors import RuntimeShardError
    from shardprep.loader.rank_shards import open_rank
    from shardprep.runtime.binding import bind, bind_draft
    from shardprep.runtime.gatherer import LayerGatherer

    src, out, mtp = checkpoint_cache("deepseek-v3-mtp", layers=3), tmp_path / "n1", 3
    convert(src, out, 1, preset="deepseek-v3")
    config = transformers.AutoConfig.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    shards = open_rank(out, 0)
    binding = bind(model, shards, LayerGatherer(shards, draft_first="detached"))
    block = DeepseekV3DecoderLayer(config, layer_idx=mtp).to(torch.bfloat16).eval()
    bind_draft(binding, {mtp: block})
    source, name = read_state_dict(src), f"model.layers.{mtp}.self_attn.o_proj.weight"
    ids, hidden = torch.tensor([[5, 6, 7]]), torch.randn(1, 3, config.hidden_size, dtype=torch.bfloat16)
    rotary = model.model.rotary_emb(hidden, torch.arange(3)[None])
    gatherer, seen = binding.gatherer, []
    with torch.inference_mode():
        for prefetch in (True, False, True):
            model(ids)
            issued = gatherer.gathers_issued
            if prefetch:
                binding.prefetch_draft()
            seen.append(gatherer.gathers_issued - issued)  # 1 when prefetched, else the first pass gathers inline
            for _ in range(3):
                block(hidden, position_embeddings=rotary, attention_mask=None)
                seen.append(torch.equal(block.self_attn.o_proj.weight, source[name]))
            seen.append(gatherer.gathers_issued - issued)
        binding.idle_step()
    # Prefetched: the prefetch's gather, none by the passes; inline: the first pass's.
    assert seen == [1, True, True, True, 1] + [0, True, True, True, 1] + [1, True, True, True, 1]
    assert gatherer.gathers_issued == 3 * 4
    with pytest.raises(RuntimeShardError, match="without a captured target forward"):
        binding.prefetch_draft(replayed=True)
