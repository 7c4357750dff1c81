"""`shardprep profile --dry-run`: the whole measuring path on CPU with gloo, and `plan` reading its output.

The times of a dry run mean nothing (a shared CPU); the test checks what was measured and how it is
recorded, and that the planner accepts it.
"""

import json
import os
import sys

import pytest
from support.terminal import run_on_a_terminal
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.manifests import load_manifest
from shardprep.planning.profile_format import PROFILE_SCHEMA, load_profile
from shardprep.prep.convert import convert


def test_dry_run_profiles_every_layer_and_backend_and_plan_reads_it(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama", layers=4), out, 2, preset="llama", layers="1-:2")
    path, trace = tmp_path / "profile.json", tmp_path / "trace.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="160")
    # stderr on a terminal, as a user's: rank 0 draws its measurements there as a bar (1 + 8 tokens, one backend:
    # 2 compute + 1 gathers + 2 beside compute + 2 sharded steps).
    code, stdout, shown = run_on_a_terminal([sys.executable, "-m", "shardprep", "profile", str(out), "--dry-run",
                                             "--out", str(path), "--trace", str(trace)], env)
    assert code == 0, shown[-3000:]
    assert "starting the ranks" in shown and "gloo sharded step at 8 tokens" in shown and "7/7" in shown, shown
    assert "gloo: gather-only" in stdout

    p = load_profile(path)
    manifest = load_manifest(out)
    assert json.loads(path.read_text())["schema"] == PROFILE_SCHEMA
    assert p.world_size == 2 and p.tokens == (1, 8) and p.dry_run
    assert (p.compute_mode, p.compute_mode_note) == ("eager", "no CUDA graphs on the CPU")
    assert "eager forwards: no CUDA graphs on the CPU" in " ".join(stdout.split())  # the title, wrapped
    assert [lay.layer for lay in p.layers] == [0, 1, 2, 3]
    assert [lay.layer for lay in p.layers if lay.total_bytes] == [1, 3]
    assert all(ms > 0 for lay in p.layers for ms in lay.compute_ms)
    assert all(ms > 0 for ms in p.replicated_step_ms + p.head_ms + p.tail_ms)
    (b,) = p.backends
    assert b.name == "gloo" and sorted(b.gather_ms) == [1, 3] and all(ms > 0 for ms in b.gather_ms.values())
    assert b.recv_bytes_per_forward == sum(r.chunk_bytes for r in manifest.layers)  # (N − 1)·Σ C at N = 2
    assert b.gather_only_ms > 0 and all(ms > 0 for ms in b.sharded_step_ms)
    assert len(b.compute_slowdown) == len(b.gather_slowdown) == 2
    assert min(b.compute_slowdown + b.gather_slowdown) >= 0

    result = CliRunner().invoke(app, ["plan", str(out), "--ranks", "2", "--profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [pr["tokens"] for pr in report["every_layer"]["predictions"]] == [1, 8]
    assert report["gather_source"].startswith("gloo (profile")

    # The measured timeline: rank 0's torch.profiler trace of one sharded step per token count.
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"shardprep::sharded step, 1 tokens", "shardprep::sharded step, 8 tokens"} <= names
    assert {f"shardprep::layer {i}" for i in range(4)} <= names
    assert {"shardprep::gather layer 1", "shardprep::gather layer 3"} <= names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "profile.json", "trace.json"]  # no temp left
    from support.trace_reader import read_trace

    read = read_trace(trace)
    placed = {e["name"] for p in read["processes"].values() for t in p["threads"].values() for e in t["entries"]}
    assert {"shardprep::sharded step, 8 tokens", "shardprep::layer 3", "shardprep::gather layer 3"} <= placed


def test_profile_refuses_a_rank_count_other_than_the_manifests(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama"), out, 2, preset="llama")
    result = CliRunner().invoke(app, ["profile", str(out), "--nproc", "3", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 2
    assert "converted for 2 ranks but --nproc is 3" in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_profile_refuses_a_directory_without_config_before_starting_ranks(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama"), out, 2, preset="llama")
    (out / "config.json").unlink()
    result = CliRunner().invoke(app, ["profile", str(out), "--dry-run", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {out / 'config.json'}: not found; copy the source's config.json into {out}"


def test_a_profile_says_how_it_timed_compute_and_one_without_the_key_timed_eager_forwards(tmp_path):
    from shardprep.errors import ProfileError
    from shardprep.planning.profile_format import LayerTimes, Profile

    graphed = Profile(1, "NVIDIA H200", (16,), (LayerTimes(0, (1.0,)),), (0.1,), (0.2,), (1.3,), (),
                      compute_mode="cuda-graph")
    data = graphed.to_dict()
    assert data["compute_mode"] == "cuda-graph" and Profile.from_dict(data) == graphed
    older = {k: v for k, v in data.items() if not k.startswith("compute_mode")}
    assert Profile.from_dict(older).compute_mode == "eager"  # written before graphs were timed
    with pytest.raises(ProfileError, match="compute_mode 'graph' is not one of cuda-graph, eager"):
        Profile.from_dict({**data, "compute_mode": "graph"})
