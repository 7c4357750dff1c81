"""The draft's first gather off the target's CUDA graph, on GPUs (marked `gpu`): the target's forward captured in one
graph, the draft's in another, the draft's first gather prefetched on the draft stream between them
(gatherer.py, "The draft's first gather"); every replay gives the eager bytes.

Each "layer" reduces every view of its layer to sums; target layer D−2, whose slot the draft's first gather reuses,
sleeps on the compute stream before reading it, so a prefetch that did not wait for it would change its sums (the
control below removes that wait and must see it). Before every step the slots are wiped: a replay that did not
gather again would read zeros. A Llama's last two layers (or last one) are recorded as the draft's.

It runs on as many ranks as there are GPUs, up to 2 (NCCL refuses two ranks on one GPU). On one GPU the directory is
converted for one rank and the copy path is forced: a "gather" is then a same-device copy of the layer (NCCL's
one-rank all-gather), which exercises the streams, events and graphs but no link.

    python3 -m pytest -q -m gpu tests/runtime/test_gpu_draft_prefetch.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.spawn_group import run_ranks
from test_gatherer import _error

from shardprep.prep.convert import convert

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SLEEP_CYCLES = 5_000_000  # a few ms of target layer D−2 before it reads its slot
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def _ranks() -> int:
    return max(1, min(2, torch.cuda.device_count())) if torch.cuda.is_available() else 1


@pytest.fixture(scope="module")
def gpu_runs(checkpoint_cache, tmp_path_factory):
    src = checkpoint_cache("llama", layers=6, hidden=1024, tokenizer=False)
    out = tmp_path_factory.mktemp("gpu-draft") / "out"
    convert(src, out, _ranks(), preset="llama")
    results = run_ranks(_suite, _ranks(), str(out), backend="nccl", env=ENV, timeout=240)
    return results


def _suite(rank: int, n: int, out: str) -> dict:
    from shardprep.loader.rank_shards import RankShards, open_rank
    from shardprep.manifests.draft_layers import MTP, DraftLayers

    device = torch.device("cuda", rank)
    shards = open_rank(out, rank, n, device=device)
    results: dict = {"device": torch.cuda.get_device_name(device), "ranks": n}
    for name, marked in (("two-layer", (4, 5)), ("one-layer", (5,))):
        drafted = RankShards(replace(shards.manifest, draft=DraftLayers(MTP, marked)), rank, shards.buffer)
        # The control lets the prefetch's gather run into the target's own: with 2 ranks two NCCL collectives of one
        # communicator could then run at once, in different orders (a hang), so it runs on one GPU only.
        modes = ("auto", "in_target", "skipped") + (("control",) if n == 1 else ())
        results[name] = {mode: _scenario(drafted, mode) for mode in modes}
        results[name]["eager_detached"] = _eager_detached(drafted)
        results[name]["eager_target"] = _eager_target_captured_draft(drafted)
    return results


class _Forward:
    """The target's and the draft's halves of one forward over `g`: per layer, the sums of its views into a row of
    `out` (target layer D−2 sleeping first)."""

    def __init__(self, g):
        self.g, self.d = g, g._draft_at
        self.names = {layer: sorted(g.views(layer)) for layer in g.layers}
        width = max(len(v) for v in self.names.values())
        self.out = torch.zeros(len(g.layers) + 1, width, dtype=torch.float32, device=g.device)

    def _layer(self, i: int, views) -> None:
        if i == self.d - 2:
            torch.cuda._sleep(SLEEP_CYCLES)
        sums = torch.stack([views[name].float().sum() for name in self.names[self.g.layers[i]]])
        self.out[i, :len(sums)].copy_(sums)

    def target(self) -> None:
        self.g.begin()
        for i, layer in enumerate(self.g.layers[:self.d]):
            self._layer(i, self.g.wait(layer))
            self.g.done(layer)

    def draft(self) -> None:
        # No done(): as the binding does, the draft's slots are released by the next forward (a later pass may follow).
        for i, layer in enumerate(self.g.layers[self.d:], self.d):
            self._layer(i, self.g.wait(layer))

    def draft_again(self) -> None:
        """A later pass of the draft's first layer, in a graph of its own: its sums into the extra last row."""
        views = self.g.wait_again(self.g.layers[self.d])
        sums = torch.stack([views[name].float().sum() for name in self.names[self.g.layers[self.d]]])
        self.out[-1, :len(sums)].copy_(sums)

    def wipe(self) -> None:
        for slot in self.g._slots:
            slot.memory.zero_()
        self.out.zero_()


def _scenario(shards, mode: str) -> dict:
    """Eager reference, then the target and the draft captured in two graphs and replayed step after step."""
    from shardprep.runtime import LayerGatherer

    first = "in_target" if mode == "in_target" else "auto"
    g = LayerGatherer(shards, backend="nccl", zero_copy=False, draft_first=first)
    f = _Forward(g)
    device = g.device
    f.target()
    g.prefetch_draft()  # eagerly: the forward's own schedule issued G(D) already, so this issues nothing
    f.draft()
    f.draft_again()
    torch.cuda.synchronize()
    want = f.out.clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up away from the default stream, as torch.cuda.graph asks
        for _ in range(2):
            f.target()
            g.prefetch_draft()
            f.draft()
            f.draft_again()
    torch.cuda.current_stream(device).wait_stream(side)
    target, draft, again = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(target, capture_error_mode="thread_local"):
        f.target()
    issued = g.gathers_issued
    g.prefetch_draft()
    prefetched_at_capture = g.gathers_issued - issued
    with torch.cuda.graph(draft, capture_error_mode="thread_local"):
        f.draft()
    with torch.cuda.graph(again, capture_error_mode="thread_local"):
        f.draft_again()
    if mode == "control":
        # The prefetch no longer waits for the target's layer D−2: it waits on a new handoff event, never recorded
        # in the target's graph. The graph still records the old one, which must stay alive (gather_streams.py):
        # before it was kept, this replacement destroyed it and the next replay died of SIGSEGV on an H100.
        g.streams = replace(g.streams, handoff=torch.cuda.Event(external=True))
    result: dict = {"prefetched_at_capture": prefetched_at_capture, "replays": [], "by_prefetch": []}
    for step in range(3):
        f.wipe()
        target.replay()
        issued = g.gathers_issued
        g.prefetch_draft(replayed=True)
        result["by_prefetch"].append(g.gathers_issued - issued)
        if mode == "skipped" and step == 1:
            continue  # the draft does not run: the next replay's gathers follow the unread prefetch, unsynchronised
        draft.replay()
        draft.replay()  # a draft graph replayed twice in one step: the same weights
        again.replay()
        torch.cuda.synchronize()
        result["replays"].append(bool(torch.equal(f.out, want)))
        result["alignment"] = _error(g.check_alignment)
    # The draft after a replay, eagerly: the prefetch brought the host state to the draft.
    f.wipe()
    target.replay()
    g.prefetch_draft(replayed=True)
    f.draft()
    f.draft_again()
    torch.cuda.synchronize()
    result["eager_draft_after_replay"] = bool(torch.equal(f.out, want))
    result["nonzero"] = bool((want[:-1] != 0).any(dim=1).all())
    if mode == "auto":
        # Misuse: the draft's graph replayed without this step's prefetch reads an earlier forward's bytes, which the
        # tags (an earlier forward's count) report at the next check. The gatherer is failed afterwards.
        f.wipe()
        target.replay()
        draft.replay()
        torch.cuda.synchronize()
        result["stale_draft_caught"] = _error(g.check_alignment)
        result["stale_draft_rows_wrong"] = not bool(torch.equal(f.out[f.d:-1], want[f.d:-1]))
    return result


def _eager_detached(shards) -> dict:
    """No graph: draft_first="detached" with the prefetch, then the inline fallback (a cold start), then today's."""
    from shardprep.runtime import LayerGatherer

    found = {}
    for name, first, prefetch in (("prefetch", "detached", True), ("inline", "detached", False),
                                  ("today", "auto", True)):
        g = LayerGatherer(shards, backend="nccl", zero_copy=False, draft_first=first)
        f = _Forward(g)
        same = []
        for _ in range(3):
            f.wipe()
            f.target()
            if prefetch:
                g.prefetch_draft()
            f.draft()
            torch.cuda.synchronize()
            same.append(f.out[:-1].clone())
        found[name] = same
    want = found["today"][0]
    return {name: [bool(torch.equal(x, want)) for x in outs] for name, outs in found.items()}


def _eager_target_captured_draft(shards) -> dict:
    """The target's forward eager (its own schedule issues G(D), and G(D+1) with two draft layers), the draft's
    captured: one draft layer works (the graph waits for the eager G(D)); a second is refused at capture."""
    from shardprep.errors import RuntimeShardError
    from shardprep.runtime import LayerGatherer

    g = LayerGatherer(shards, backend="nccl", zero_copy=False)
    f = _Forward(g)
    f.target()
    f.draft()
    torch.cuda.synchronize()
    want = f.out[:-1].clone()
    f.target()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            f.draft()
    except RuntimeShardError as exc:
        return {"refused": str(exc)}
    same = []
    for _ in range(2):
        f.wipe()
        f.target()
        graph.replay()
        torch.cuda.synchronize()
        same.append(bool(torch.equal(f.out[:-1], want)))
    return {"refused": None, "replays": same}


# -- the tests --------------------------------------------------------------------------------------
DRAFTS = ("two-layer", "one-layer")


@pytest.mark.parametrize("draft", DRAFTS)
def test_a_captured_target_and_a_prefetched_draft_give_the_eager_bytes_replay_after_replay(gpu_runs, draft):
    for r in gpu_runs:
        auto = r[draft]["auto"]
        assert auto["nonzero"] and auto["prefetched_at_capture"] == 1
        assert auto["replays"] == [True] * 3 and auto["by_prefetch"] == [1] * 3
        assert auto["alignment"] is None and auto["eager_draft_after_replay"]


@pytest.mark.parametrize("draft", DRAFTS)
def test_a_draft_replayed_without_its_prefetch_is_reported_by_the_tags(gpu_runs, draft):
    for r in gpu_runs:
        auto = r[draft]["auto"]
        assert auto["stale_draft_rows_wrong"]
        assert auto["stale_draft_caught"] is not None and "misaligned" in auto["stale_draft_caught"]


@pytest.mark.parametrize("draft", DRAFTS)
def test_the_first_gather_inside_the_targets_graph_gives_the_eager_bytes_too(gpu_runs, draft):
    for r in gpu_runs:
        in_target = r[draft]["in_target"]
        assert in_target["prefetched_at_capture"] == 0 and in_target["by_prefetch"] == [0] * 3
        assert in_target["replays"] == [True] * 3 and in_target["eager_draft_after_replay"]


@pytest.mark.parametrize("draft", DRAFTS)
def test_a_skipped_draft_step_between_replays_keeps_the_bytes_right(gpu_runs, draft):
    for r in gpu_runs:
        skipped = r[draft]["skipped"]
        assert skipped["replays"] == [True, True] and skipped["by_prefetch"] == [1] * 3
        assert skipped["alignment"] is None


@pytest.mark.parametrize("draft", DRAFTS)
def test_without_the_handoff_the_prefetch_overwrites_a_slot_the_target_still_reads(gpu_runs, draft):
    if gpu_runs[0]["ranks"] != 1:
        pytest.skip("the control runs on one GPU (see _suite)")
    for r in gpu_runs:
        assert r[draft]["control"]["replays"] != [True] * 3, "the check saw nothing even without the protection"


def test_a_draft_graph_after_an_eager_target_works_for_one_layer_and_is_refused_for_two(gpu_runs):
    for r in gpu_runs:
        assert r["one-layer"]["eager_target"] == {"refused": None, "replays": [True, True]}
        refused = r["two-layer"]["eager_target"]["refused"]
        assert refused is not None and "draft_first='detached'" in refused


@pytest.mark.parametrize("draft", DRAFTS)
def test_eager_prefetch_and_inline_fallback_give_todays_bytes(gpu_runs, draft):
    for r in gpu_runs:
        assert r[draft]["eager_detached"] == {"prefetch": [True] * 3, "inline": [True] * 3, "today": [True] * 3}
