"""Shard groups on GPUs (marked `gpu`, skipped without CUDA; needs 4 GPUs): two groups of 2 inside a NCCL world
of 4 bound to its devices, with every gather backend.

What differs from one group on the world: the world's communicator is split for each group (every rank
takes part in every split), nccl-symm splits its own communicator from its group's, ce rendezvouses its
symmetric memory and passes its zero-copy descriptors within a group, the zero-copy agreement and the
debug step check run on the group. On a GPU machine:
`python3 -m pytest -q -m gpu tests/runtime/test_gpu_shard_groups.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from support.checkpoints import make_checkpoint
from support.runs import transformers_outputs
from support.spawn_group import run_ranks

from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu

W, N, K = 4, 2, 8
PROMPTS = ["hello world", "the model", "shard the weights gpu rank layer fast", "a b", "x y z"]  # group 0 busier
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def _needs_gpus() -> None:
    if torch.cuda.device_count() < W:
        pytest.skip(f"needs {W} GPUs, this machine has {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    _needs_gpus()
    root = tmp_path_factory.mktemp("gpu-groups")
    src = make_checkpoint(root / "src", "llama", layers=4, hidden=1024)
    outs = {}
    for alignment in ("none", "2MiB"):  # 2 MiB chunks: ce and nccl map the own chunk (zero copy)
        outs[alignment] = root / f"out-{alignment}"
        convert(src, outs[alignment], N, preset="llama", chunk_alignment=alignment)
    return src, outs, transformers_outputs(src, PROMPTS, True, K, "cuda:0")


@pytest.mark.parametrize("alignment", ["none", "2MiB"])
@pytest.mark.parametrize("backend", ["auto", "nccl", "ce", "nccl-symm"])
def test_four_gpus_in_two_shard_groups_match_transformers(llama, tmp_path, backend, alignment):
    src, outs, want = llama
    out = outs[alignment]
    saved = tmp_path / "outputs.pt"
    cmd = [sys.executable, "-m", "shardprep", "run", str(out), "--nproc-per-node", str(W), "--shard-group-size",
           str(N), "--device", "cuda", "--backend", backend, "--json", "--max-new-tokens", str(K), "--save-outputs",
           str(saved), *[a for p in PROMPTS for a in ("--prompt", p)]]
    env = dict(os.environ, HF_HUB_OFFLINE="1", **ENV,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for r, got, (tokens, ref) in zip(report["prompts"], torch.load(saved), want):
        assert r["token_ids"] == tokens
        assert got.dtype == ref.dtype and torch.equal(got, ref), r["prompt"]
    layers = len(load_manifest(out).layers)
    for m in report["ranks"]:
        group = [m["rank"] // N * N + i for i in range(N)]
        assert (m["group_ranks"], m["gather_group_ranks"], m["rank_file"]) == (group, group, m["rank"] % N)
        assert m["gathers"] == layers * (m["forwards"] + m["idle_steps"])
        if backend != "auto":
            assert m["backend"] == backend


def test_every_backend_gathers_exact_bytes_inside_its_group_with_the_step_check(llama):
    src, outs, _ = llama
    results = run_ranks(_suite, W, str(outs["2MiB"]), str(src), backend="nccl", env=ENV, timeout=600)
    for rank, r in enumerate(results):
        for name in ("nccl", "ce", "nccl-symm"):
            assert r[name] == {"exact": [], "ranks": [rank // N * N, rank // N * N + 1]}, (rank, name)
        assert r["zero_copy"] == {"nccl": True, "ce": True}
        # Rank 3 claims another step than rank 2: group 1 raises naming them, group 0 goes on.
        if rank < N:
            assert r["step_check"] is None
        else:
            assert "rank(s) [3] differ from rank(s) [2]" in r["step_check"]


def _suite(rank: int, world_size: int, out: str, src_dir: str) -> dict:
    import torch.distributed as dist
    from support.checkpoints import read_state_dict
    from test_gatherer import _mismatches

    from shardprep.errors import ShardprepError
    from shardprep.loader import open_rank
    from shardprep.runtime import LayerGatherer
    from shardprep.runtime.shard_groups import shard_group

    device = torch.device("cuda", rank)
    src = read_state_dict(src_dir)
    group = shard_group(N)
    result: dict = {"zero_copy": {}}
    for name in ("nccl", "ce", "nccl-symm"):
        shards = open_rank(out, group.rank_file, N, device=device)
        g = LayerGatherer(shards, group=group.process_group, backend=name, debug_alignment=True,
                          timeout=timedelta(seconds=120))
        if name != "nccl-symm":
            result["zero_copy"][name] = g.zero_copy
        bad = []
        for _ in range(2 if group.index == 0 else 3):  # the groups run different numbers of forwards
            g.begin()
            for layer in g.layers:
                views = g.wait(layer)
                torch.cuda.synchronize(device)
                bad += _mismatches({k: v.cpu() for k, v in views.items()}, shards.manifest.layer(layer), src)
                g.done(layer)
        result[name] = {"exact": bad, "ranks": dist.get_process_group_ranks(g.group)}
        if name == "nccl-symm":
            try:
                g.begin(step=7 + (rank == 3))
                result["step_check"] = None
            except ShardprepError as exc:
                result["step_check"] = str(exc)
        torch.cuda.synchronize(device)
        dist.barrier()
    return result
