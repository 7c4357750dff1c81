"""Shard groups inside a larger world: the mapping (rank r → group r // N, rank file r mod N), its node
check, the process groups every rank builds, and gathers, idle steps and step checks that stay inside
one group.

One gloo world of 4 ranks on 2 "nodes" (torchrun's GROUP_RANK 0 and 1, two ranks each) runs every
scenario; process start is the cost. `shardprep run` across nodes is tested in test_run.py.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
from support.spawn_group import run_ranks
from test_gatherer import local_only_dir

from shardprep.errors import ShardprepError
from shardprep.manifests.shard_groups import ShardGroups, group_size_problem, largest_node_local_group

W, N = 4, 2


# -- the mapping, pure ---------------------------------------------------------------------------
def test_rank_r_is_in_group_r_div_n_and_serves_rank_file_r_mod_n():
    g = ShardGroups.node_major(world_size=16, group_size=8, ranks_per_node=8)
    assert [g.group_of(r) for r in range(16)] == [0] * 8 + [1] * 8
    assert [g.rank_file_of(r) for r in range(16)] == list(range(8)) * 2
    assert g.enumeration() == [list(range(8)), list(range(8, 16))]
    assert g.cross_node_groups() == () and g.cross_node_problem() is None


def test_groups_that_straddle_a_node_boundary_are_named():
    assert ShardGroups.node_major(16, 16, ranks_per_node=8).cross_node_groups() == (0,)
    twelve = ShardGroups.node_major(24, 6, ranks_per_node=8)  # 6 does not divide 8: groups 1 and 2 straddle
    assert twelve.cross_node_groups() == (1, 2)
    assert twelve.nodes_of(1) == (0, 1) and twelve.nodes_of(2) == (1, 2)
    # The nodes ranks really run on, not the node size, decide: here rank 1 runs on node 1.
    assert ShardGroups(2, (0, 1, 1, 1)).cross_node_groups() == (0,)


def test_a_world_that_is_not_whole_groups_is_refused():
    assert group_size_problem(6, 4) == "6 ranks are not a whole number of shard groups of 4"
    with pytest.raises(ShardprepError, match="6 ranks are not a whole number of shard groups of 4"):
        ShardGroups.node_major(6, 4, ranks_per_node=8)


@pytest.mark.parametrize("world,per_node,expected", [(16, 8, 8), (8, 8, 8), (12, 8, 4), (6, 8, 6), (32, 4, 4),
                                                     (7, 8, 7), (14, 4, 2)])
def test_the_largest_node_local_group_divides_the_world_and_fits_a_node(world, per_node, expected):
    n = largest_node_local_group(world, per_node)
    assert n == expected
    assert not ShardGroups.node_major(world, n, per_node).cross_node_groups()


# -- the process groups, on 4 gloo ranks on 2 nodes ---------------------------------------------------
@pytest.fixture(scope="module")
def world(checkpoint_cache, conversion_cache, tmp_path_factory):
    """(source, converted dir, per-rank results): each rank's directory holds only its rank file."""
    src = checkpoint_cache("llama", layers=4)
    root, out = tmp_path_factory.mktemp("shard-groups"), conversion_cache(src, N, preset="llama")
    dirs = [str(local_only_dir(out, rank % N, root / f"rank{rank}")) for rank in range(W)]
    return src, out, run_ranks(_suite, W, dirs, str(src), timeout=180)


def _suite(rank: int, world_size: int, dirs: list[str], src_dir: str) -> dict:
    import torch.distributed as dist
    from support.checkpoints import read_state_dict
    from test_gatherer import _mismatches

    from shardprep.loader import open_rank
    from shardprep.runtime import LayerGatherer
    from shardprep.runtime.shard_groups import shard_group

    os.environ["GROUP_RANK"] = str(rank // 2)  # as torchrun sets it: two nodes of two ranks
    src = read_state_dict(src_dir)
    result: dict = {"wrong_size": _error(lambda: shard_group(3))}
    # Refused on every rank, before any group is made: one group of 4 would span both nodes.
    result["cross_node"] = _error(lambda: shard_group(4))
    group = shard_group(N)
    result["same_group_again"] = shard_group(N) is group
    result.update(index=group.index, ranks=list(group.ranks), rank_file=group.rank_file, node=group.node,
                  process_group_ranks=dist.get_process_group_ranks(group.process_group))
    wide = shard_group(4, allow_cross_node_groups=True)
    result["wide_is_the_world"] = wide.process_group is dist.group.WORLD

    shards = open_rank(dirs[rank], group.rank_file, N, verify=True)

    def forward(g):
        g.begin()
        bad = []
        for layer in g.layers:
            bad += _mismatches(g.wait(layer), shards.manifest.layer(layer), src)
            g.done(layer)
        return bad

    g = LayerGatherer(shards, group=group.process_group, debug_alignment=True, timeout=timedelta(seconds=60))
    # The groups run different numbers of forwards (group 1 three, group 0 one), and within group 1
    # rank 3 idles while rank 2 computes: each group's gathers and step checks involve its ranks only.
    result["exact"] = forward(g)
    if group.index == 1:
        result["exact"] += forward(g)
        if rank == 3:
            g.idle_step()
        else:
            result["exact"] += forward(g)
        result["exact"] += forward(g)
    result["gathers"] = g.gathers_issued
    # The step check compares the group's ranks only, and names their global ranks: rank 3 claims
    # another step than rank 2; group 0 agrees with itself.
    result["step_check"] = _error(lambda: g.begin(step=7 + (rank == 3)))
    result["default_group_refused"] = _error(lambda: LayerGatherer(shards))
    dist.barrier()
    return result


def _error(fn) -> str | None:
    try:
        fn()
    except ShardprepError as exc:
        return str(exc)
    return None


def test_each_rank_gets_its_group_its_rank_file_and_its_node(world):
    for rank, r in enumerate(world[2]):
        assert (r["index"], r["ranks"], r["rank_file"], r["node"]) == (rank // N, [rank // N * N, rank // N * N + 1],
                                                                        rank % N, rank // 2)
        assert r["process_group_ranks"] == r["ranks"]  # read back from the process group itself
        assert r["same_group_again"]  # built once: every place that asks gets the same group


def test_a_world_that_is_not_whole_groups_is_refused_on_every_rank(world):
    for r in world[2]:
        assert r["wrong_size"] is not None and "4 ranks are not a whole number of shard groups of 3" in r["wrong_size"]


def test_a_group_spanning_nodes_is_refused_on_every_rank_unless_allowed(world):
    for r in world[2]:
        msg = r["cross_node"]
        assert msg is not None and msg.startswith("shard group 0 (ranks 0..3) spans nodes 0 and 1 of the 2 nodes")
        assert "--allow-cross-node-groups" in msg and "\n" not in msg
        assert r["wide_is_the_world"]  # allowed: one group of the whole world gathers over the world itself


def test_gathers_and_idle_steps_stay_inside_each_group(world):
    src, out, results = world
    from shardprep.manifests import load_manifest

    layers = len(load_manifest(out).layers)
    for rank, r in enumerate(results):
        assert r["exact"] == [], f"rank {rank}"
        assert r["gathers"] == layers * (1 if rank < 2 else 4)


def test_the_step_check_compares_only_the_groups_ranks_and_names_global_ranks(world):
    for rank, r in enumerate(world[2]):
        if rank < 2:
            assert r["step_check"] is None
        else:
            assert r["step_check"] is not None
            assert "rank(s) [3] differ from rank(s) [2]" in r["step_check"], r["step_check"]


def test_a_gatherer_on_the_world_refuses_shards_of_a_smaller_group_and_says_how(world):
    for rank, r in enumerate(world[2]):
        msg = r["default_group_refused"]
        assert msg is not None and f"rank {rank % N} of {N}" in msg and f"rank {rank} of {W}" in msg
        assert "shard_group(2)" in msg


# -- vLLM's sharded mode: the layout check (the engines run in tests/vllm_engines/) -------------------
def _layout(**changes):
    from shardprep.integrations.server import WorkerLayout

    base = dict(dp_rank=0, dp_size=4, dp_world_ranks=(0, 1, 2, 3), tp_size=1, pp_size=1, lockstep_dp=True,
                eager=True, device=torch.device("cpu"), platform="cpu")
    return WorkerLayout(**{**base, **changes})


def test_vllm_sharded_mode_takes_data_parallel_sizes_that_are_multiples_of_n(world):
    from shardprep.integrations.sharded_load import check_layout
    from shardprep.integrations.vllm.adapter import VllmAdapter
    from shardprep.manifests import load_manifest

    out, vllm = world[1], VllmAdapter.spelling
    manifest = load_manifest(out)
    check_layout(_layout(), vllm, manifest, out)
    check_layout(_layout(), vllm, manifest, out, group_size=2)
    with pytest.raises(ShardprepError, match=r"data_parallel_size=3 \(3 ranks are not a whole number of shard "
                                             r"groups of 2\); launch a multiple of 2 DP ranks"):
        check_layout(_layout(dp_size=3, dp_world_ranks=(0, 1, 2)), vllm, manifest, out)
    with pytest.raises(ShardprepError, match="shard_group_size 4, but .* was converted for 2 ranks"):
        check_layout(_layout(), vllm, manifest, out, group_size=4)


def test_vllm_options_take_a_shard_group_size_and_refuse_a_bad_one():
    from shardprep.integrations.load_options import ShardprepLoadOptions

    options = ShardprepLoadOptions.from_extra_config({"shard_weights": True, "shard_group_size": 8,
                                                      "allow_cross_node_groups": True})
    assert (options.shard_group_size, options.allow_cross_node_groups) == (8, True)
    for bad in (0, True, "8", 2.0):
        with pytest.raises(ShardprepError, match="'shard_group_size' must be a whole number >= 1"):
            ShardprepLoadOptions.from_extra_config({"shard_group_size": bad})


# -- plan and inspect: --dp W on nodes of --gpus-per-node G ---------------------------------------------
def cli(*args, code=0):
    from typer.testing import CliRunner

    from shardprep.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert result.exit_code == code, result.output
    return result


def test_plan_at_dp_16_picks_groups_of_8_and_reports_the_saving_at_that_n(checkpoint_cache):
    import json

    src = checkpoint_cache("llama", layers=8)
    at_dp = json.loads(cli("plan", src, "--preset", "llama", "--dp", 16, "--json").stdout)
    at_n = json.loads(cli("plan", src, "--preset", "llama", "--ranks", 8, "--json").stdout)
    assert at_dp["ranks"] == 8
    assert at_dp["groups"] | {"description": ""} == {
        "world_size": 16, "gpus_per_node": 8, "group_size": 8, "groups": 2, "cross_node_groups": [],
        "largest_node_local_group_size": 8, "description": ""}
    # Per GPU, DP 16 in groups of 8 saves and buys what N = 8 does.
    assert at_dp["every_layer"]["memory"] == at_n["every_layer"]["memory"]
    assert at_dp["capacity"]["kv_tokens"] == at_n["capacity"]["kv_tokens"] > 0
    assert at_dp["verdict"] == "memory only"
    assert "shard groups: W = 16 ranks in 2 shard groups of N = 8 consecutive ranks, each inside one node of 8 GPUs" \
        in cli("plan", src, "--preset", "llama", "--dp", 16).stdout


def test_plan_gives_a_crosses_nodes_verdict_when_a_group_would_span_nodes(checkpoint_cache):
    import json

    src = checkpoint_cache("llama", layers=8)
    report = json.loads(cli("plan", src, "--preset", "llama", "--ranks", 16, "--json").stdout)
    assert report["verdict"] == "crosses nodes" and report["groups"]["cross_node_groups"] == [0]
    assert report["verdict_line"].startswith("crosses nodes: on nodes of 8 GPUs, shard group 0 (ranks 0..15) spans "
                                             "nodes 0 and 1, so its gathers would cross the network")
    assert report["verdict_line"].endswith("plan --ranks 8, the largest shard group that fits a node")
    report = json.loads(cli("plan", src, "--preset", "llama", "--ranks", 4, "--dp", 16, "--gpus-per-node", 2,
                            "--json").stdout)
    assert report["verdict"] == "crosses nodes" and report["groups"]["cross_node_groups"] == [0, 1, 2, 3]
    assert report["verdict_line"].endswith("plan --ranks 2, the largest shard group that fits a node at --dp 16")


@pytest.mark.parametrize("args,expected", [
    (["--ranks", 8, "--dp", 12], "--dp 12 with --ranks 8: 12 ranks are not a whole number of shard groups of 8"),
    ([], "give --ranks N (the shard group size), or --dp W"),
], ids=["dp-not-whole-groups", "neither-ranks-nor-dp"])
def test_plan_refuses_group_sizes_the_dp_ranks_cannot_take(checkpoint_cache, args, expected):
    result = cli("plan", checkpoint_cache("llama", layers=8), "--preset", "llama", *args, code=2)
    assert result.stderr.startswith("error: ") and expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_inspect_reports_the_groups_at_dp_and_a_verdict_when_they_span_nodes(world):
    import json

    out = world[1]
    local = json.loads(cli("inspect", out, "--dp", 4, "--gpus-per-node", 2, "--json").stdout)
    assert (local["groups"]["groups"], local["groups"]["cross_node_groups"], local["verdict_line"]) == (2, [], None)
    spanning = json.loads(cli("inspect", out, "--dp", 4, "--gpus-per-node", 1, "--json").stdout)
    assert spanning["groups"]["cross_node_groups"] == [0, 1]
    assert spanning["verdict_line"].startswith("crosses nodes: on nodes of 1 GPU, shard group 0 (ranks 0..1) spans "
                                               "nodes 0 and 1 (and 1 more group)")
    assert spanning["verdict_line"].endswith(f"`shardprep reshard {out} NEW --ranks 1`")
    assert spanning["verdict_line"] in cli("inspect", out, "--dp", 4, "--gpus-per-node", 1).stdout
    result = cli("inspect", out, "--dp", 3, code=2)
    assert "--dp 3: 3 ranks are not a whole number of shard groups of 2" in result.stderr
