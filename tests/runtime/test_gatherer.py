"""LayerGatherer on real multi-process gloo groups (N = 2, 4 and 8), against the source checkpoint.

One group per world size runs every scenario in sequence (process start is the cost); each test
below checks one behaviour from that run. Every rank loads from a directory that holds only its own
rank file.
"""

from __future__ import annotations

import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from support.spawn_group import run_ranks

from shardprep.errors import RuntimeShardError

WORLD_SIZES = (2, 4, 8)  # 8: the seed's one-node deployment, for correctness (no 8-GPU machine is lent)
SLIP_SIZES = (2, 4)  # the misalignment scenarios wait out gloo timeouts: not at every size


def local_only_dir(out: Path, rank: int, dest: Path) -> Path:
    """A copy of OUT (hard links) without the other ranks' shard files."""
    from shardprep.manifests import load_manifest

    mine = load_manifest(out).rank_files[rank]
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if path.is_dir() or (rel.startswith("shards/") and rel != mine):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
    return dest


@pytest.fixture(scope="module")
def runs(checkpoint_cache, conversion_cache, tmp_path_factory):
    """world size → (source dir, converted dir, per-rank results of the scenario suite)."""
    src = checkpoint_cache("llama", layers=4)
    out = {}
    for n in WORLD_SIZES:
        root, converted = tmp_path_factory.mktemp(f"gather{n}"), conversion_cache(src, n, preset="llama")
        dirs = [str(local_only_dir(converted, r, root / f"rank{r}")) for r in range(n)]
        other = str(converted) if n == 2 else str(out[2][1])
        out[n] = (src, converted, run_ranks(_suite, n, dirs, str(src), other, timeout=180))
    return out


# -- what every rank runs ---------------------------------------------------------------------------
def _suite(rank: int, n: int, dirs: list[str], src_dir: str, other_out: str) -> dict:
    import torch.distributed as dist
    from support.checkpoints import read_state_dict

    from shardprep.loader import open_rank
    from shardprep.runtime import LayerGatherer

    src = read_state_dict(src_dir)
    result: dict = {}
    shards = open_rank(dirs[rank], rank, n, verify=True)
    g = LayerGatherer(shards)
    result["backend"] = g.backend_name
    result["layers"] = list(g.layers)
    result["slot_bytes"] = g.slot_bytes
    result["max_total_bytes"] = shards.manifest.max_total_bytes
    result["views_in_slots"] = _views_in_slots(g)

    def forward(gatherer, skip_done=False):
        bad = []
        gatherer.begin()
        for layer in gatherer.layers:
            bad += _mismatches(gatherer.wait(layer), shards.manifest.layer(layer), src)
            if not skip_done:
                gatherer.done(layer)
        return bad

    result["exact"] = forward(g) + forward(g)
    replicated = shards.load_replicated("cpu")
    result["replicated_names"] = sorted(replicated)
    result["replicated_bad"] = [k for k, t in replicated.items() if not _same(t, src[k])]

    # The scenarios below use the debug gatherer: each begin() checks that all ranks are aligned.
    d = LayerGatherer(shards, debug_alignment=True, timeout=timedelta(seconds=60))
    result["aligned_start"] = forward(d)
    if rank == n - 1:
        d.idle_step()
        result["idle"] = []
    else:
        result["idle"] = forward(d)
    result["after_idle"] = forward(d)

    d.begin()
    d.begin()  # harmless: no second gather
    result["begin_twice"] = [*_rest_of_forward(d, shards, src, start=0), *forward(d)]

    d.begin()
    d.wait(d.layers[0])
    d.done(d.layers[0])
    result["restart"] = forward(d)  # begin() mid-forward abandons it; still aligned afterwards

    result["skip_done"] = forward(d, skip_done=True) + forward(d, skip_done=True) + forward(d)

    d.prefetch_first()
    result["prefetch"] = forward(d)
    result["cold_wait_first"] = _mismatches(d.wait_first(), shards.manifest.layer(d.layers[0]), src)
    result["cold_wait_first"] += _rest_of_forward(d, shards, src, start=1)

    errors = {}
    d.begin()
    errors["out_of_order"] = _error(lambda: d.wait(d.layers[1]))
    errors["prefetch_in_forward"] = _error(d.prefetch_first)
    errors["done_before_wait"] = _error(lambda: d.done(d.layers[1]))
    _rest_of_forward(d, shards, src, start=0)
    errors["wait_outside_forward"] = _error(lambda: d.wait(d.layers[0]))
    errors["unknown_layer"] = _error(lambda: d.wait(12345))
    result["errors"] = errors
    result["after_errors"] = forward(d)

    # Call sequences that must never let a gather overwrite a slot still being read.
    seq = LayerGatherer(shards, timeout=timedelta(seconds=60))
    result["sequences"] = {name: _script(seq, shards, src, ops) for name, ops in _sequences(seq.layers).items()}
    result["no_false_alarm"] = _error(seq.begin)  # every sequence above kept the ranks aligned
    result["no_false_alarm"] = result["no_false_alarm"] or _rest_of_forward(seq, shards, src, start=0) or None

    # A rank abandons a forward after one layer while its peers finish it (and, untagged, abandon the
    # next one instead): five gathers each, paired by position, so some views hold the wrong layer's
    # bytes. Without tags nothing notices. With tags, a rank raises at the first begin() after a
    # forward with a slipped pair has completed; a rank whose peers stopped there times out instead
    # of hanging (each run on a gloo group of its own, which a stuck gather leaves unusable).
    for tagged in (True, False) if n in SLIP_SIZES else ():
        side = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
        m = LayerGatherer(shards, group=side, timeout=timedelta(seconds=3), alignment_tags=tagged)
        wrong, error = _misaligned_forwards(m, shards, src, abandons_first=rank == n - 1)
        again = _error(m.begin) if error and "misaligned" in error else None
        result["misaligned" if tagged else "misaligned_untagged"] = {"wrong": wrong, "error": error, "again": again}

    # Rank 0 runs two forwards on g1, its peers one on g2 then one on g1: layer positions line up,
    # the forward counts of the second pair do not. Every gather completes; then g1 raises everywhere.
    g1, g2 = LayerGatherer(shards), LayerGatherer(shards)
    for gatherer in ([g1, g1] if rank == 0 else [g2, g1]):
        forward(gatherer)
    result["forward_slip"] = _error(g1.begin)

    if n == 4:  # a gatherer refuses shards converted for another world size, naming both
        foreign = open_rank(other_out, rank % 2)
        result["foreign_world"] = _error(lambda: LayerGatherer(foreign))

    # The last rank claims another step: every rank raises, naming it.
    result["mismatch"] = _error(lambda: d.begin(step=100 + (rank == n - 1)))

    # A rank that stops issuing gathers makes its peers fail within the timeout instead of hanging.
    t = LayerGatherer(shards, timeout=timedelta(seconds=2))
    dist.barrier()
    t.begin()
    if rank == 0:
        result["timeout"] = _error(lambda: [t.wait(layer) for layer in t.layers])
    else:
        time.sleep(3)  # stay up (not gathering) until rank 0 has timed out
    return result


def _sequences(layers) -> dict[str, list[tuple]]:
    """Scripts of gatherer calls (op, layer): misuse between and inside forwards, then a clean forward."""
    a, b, c = layers
    body = [("wait", a), ("done", a), ("wait", b), ("done", b), ("wait", c), ("done", c)]
    full = [("begin",), *body]
    return {
        "stray_done_after_prefetch": [*full, ("prefetch",), ("done", c), ("done", a), ("begin",), *body, *full],
        "skipped_done": [("begin",), ("wait", a), ("wait", b), ("wait", c), *full],
        "late_done": [("begin",), ("wait", a), ("wait", b), ("done", a), ("done", b), ("wait", c), ("done", c), *full],
        "done_twice": [("begin",), ("wait", a), ("done", a), ("done", a), ("wait", b), ("done", b), ("done", b),
                       ("wait", c), ("done", c), ("done", c), *full],
        "prefetch_after_skipped_last_done": [("begin",), ("wait", a), ("done", a), ("wait", b), ("done", b),
                                             ("wait", c), ("prefetch",), ("begin",), *body, *full],
        "prefetch_twice": [*full, ("prefetch",), ("prefetch",), ("begin",), *body],
        "begin_twice_then_midway": [("begin",), ("begin",), ("wait", a), ("done", a), ("begin",), *body, *full],
        "stray_done_then_begin_twice_after_prefetch": [*full, ("prefetch",), ("done", b), ("begin",), ("begin",),
                                                       *body],
    }


def _script(g, shards, src, ops) -> list[str]:
    """Run `ops`; every view stays checked until its done() (or, done() skipped, until the next call
    that may refill its slot), after a pause in which a gather wrongly issued into its slot would land
    (gloo gathers run on background threads)."""
    held: dict[int, dict] = {}
    bad: list[str] = []
    for op, *arg in ops:
        if held:
            time.sleep(0.02)
            for layer, views in held.items():
                bad += [f"before {op}{tuple(arg)}: layer {layer}'s {name} changed while it was read"
                        for name in _mismatches(views, shards.manifest.layer(layer), src)]
        if op == "done":
            held.pop(arg[0], None)
            g.done(arg[0])
            continue
        held.clear()
        if op == "wait":
            views = g.wait(arg[0])
            bad += [f"wait({arg[0]}): {name}" for name in _mismatches(views, shards.manifest.layer(arg[0]), src)]
            held[arg[0]] = views
        elif op == "begin":
            g.begin()
        else:
            g.prefetch_first()
    return bad


def _misaligned_forwards(g, shards, src, abandons_first: bool) -> tuple[list[str], str | None]:
    """Five gathers on every rank, of layers in different orders: the views that came out wrong, and
    the error that stopped it (or that the next begin() raises)."""
    a = g.layers[0]
    wrong: list[str] = []
    try:
        g.begin()
        if abandons_first:
            g.wait(a)  # issues the second gather; then the forward is abandoned
            g.begin()
            wrong += _rest_of_forward(g, shards, src, start=0)
        else:
            wrong += _rest_of_forward(g, shards, src, start=0)
            g.begin()
            wrong += _mismatches(g.wait(a), shards.manifest.layer(a), src)
    except RuntimeShardError as exc:
        return wrong, str(exc)
    return wrong, _error(g.begin)


def _rest_of_forward(g, shards, src, start):
    bad = []
    for layer in g.layers[start:]:
        bad += _mismatches(g.wait(layer), shards.manifest.layer(layer), src)
        g.done(layer)
    return bad


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def _mismatches(views: dict, record, src: dict) -> list[str]:
    expected = {e.name: src[e.name] for e in record.entries}
    expected.update({v.name: torch.cat([src[m] for m in v.members]) for v in record.views})
    bad = [name for name in expected if name not in views or not _same(views[name], expected[name])]
    return bad + [name for name in views if name not in expected]


def _views_in_slots(g) -> bool:
    ranges = [(s.memory.data_ptr(), s.memory.data_ptr() + s.memory.numel()) for s in g._slots]
    return all(any(a <= t.data_ptr() < b for a, b in ranges) for views in g._views for t in views.values())


def _error(fn) -> str | None:
    try:
        fn()
    except RuntimeShardError as exc:
        return str(exc)
    return None


# -- the tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_every_layer_is_bit_exact_with_the_source(runs, n):
    src, out, results = runs[n]
    for r in results:
        assert r["backend"] == "gloo"
        assert r["layers"] == [1, 2, 3]
        assert r["exact"] == []


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_views_are_zero_copy_into_two_slots_of_max_layer_bytes(runs, n):
    for r in runs[n][2]:
        assert r["views_in_slots"]
        assert r["slot_bytes"] == 2 * r["max_total_bytes"]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_replicated_tensors_load_from_a_directory_with_only_the_local_rank_file(runs, n):
    src, out, results = runs[n]
    from support.checkpoints import read_state_dict

    from shardprep.manifests import load_manifest

    targets = set(load_manifest(out).target_names())
    for r in results:
        assert r["replicated_names"] == sorted(set(read_state_dict(src)) - targets)
        assert r["replicated_bad"] == []


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_idle_rank_stays_aligned(runs, n):
    for r in runs[n][2]:
        assert r["aligned_start"] == [] and r["idle"] == [] and r["after_idle"] == []


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_begin_twice_is_harmless_and_begin_midway_restarts(runs, n):
    for r in runs[n][2]:
        assert r["begin_twice"] == []
        assert r["restart"] == []


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_skipping_done_stays_correct(runs, n):
    for r in runs[n][2]:
        assert r["skip_done"] == []


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_prefetch_first_and_cold_wait_first(runs, n):
    for r in runs[n][2]:
        assert r["prefetch"] == [] and r["cold_wait_first"] == []


def test_misuse_raises_before_any_gather_is_issued(runs):
    for r in runs[2][2]:
        e = r["errors"]
        assert "wait(2) while layer 1 is next" in e["out_of_order"]
        assert "prefetch_first() during a forward" in e["prefetch_in_forward"]
        assert "done(2) before wait(2)" in e["done_before_wait"]
        assert "call begin() first" in e["wait_outside_forward"]
        assert "layer 12345 is not gathered" in e["unknown_layer"]
        assert r["after_errors"] == []


def test_world_size_mismatch_names_both_sizes(runs):
    for rank, r in enumerate(runs[4][2]):
        assert f"rank {rank % 2} of 2" in r["foreign_world"] and f"rank {rank} of 4" in r["foreign_world"]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_debug_alignment_mismatch_names_the_disagreeing_rank(runs, n):
    for r in runs[n][2]:
        msg = r["mismatch"]
        assert msg is not None and f"rank(s) [{n - 1}] differ from rank(s) {list(range(n - 1))}" in msg
        assert "step 101" in msg and "step 100" in msg


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_no_call_sequence_overwrites_a_slot_still_being_read(runs, n):
    for r in runs[n][2]:
        assert set(r["sequences"]) == set(_sequences((1, 2, 3)))
        assert {name: bad for name, bad in r["sequences"].items() if bad} == {}
        assert r["no_false_alarm"] is None


@pytest.mark.parametrize("n", SLIP_SIZES)
def test_a_rank_that_abandons_a_forward_alone_is_caught_at_the_next_begin(runs, n):
    results = runs[n][2]
    # Without tags the schedules slip silently: ranks computed with another layer's bytes.
    assert all(r["misaligned_untagged"]["wrong"] for r in results)
    assert all(r["misaligned_untagged"]["error"] is None for r in results)
    # With tags the ranks that completed the slipped forward (all but the one that abandoned) raise
    # at their next begin(), and stay failed; the abandoning rank is left waiting and times out.
    for rank, r in enumerate(results):
        msg = r["misaligned"]["error"]
        if rank < n - 1:
            assert msg is not None and "gathers are misaligned" in msg and "was paired with rank" in msg, msg
            assert r["misaligned"]["again"] == msg
        else:
            assert msg is not None and ("gathers are misaligned" in msg or "did not complete within" in msg), msg


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_a_forward_count_slip_is_caught_even_when_layer_positions_line_up(runs, n):
    for r in runs[n][2]:
        msg = r["forward_slip"]
        assert msg is not None and "forward 1" in msg and "forward 2" in msg, msg


def test_a_peer_that_stops_gathering_times_out_instead_of_hanging(runs):
    msg = runs[2][2][0]["timeout"]
    assert msg is not None and "did not complete within 0:00:02" in msg
