"""`shardprep profile` on 2 GPUs (marked `gpu`, skipped without them): the CUDA path measures what the CPU
dry run only exercises, and `shardprep plan` predicts from it.

On a GPU machine: `python3 -m pytest -q -m gpu tests/standalone/test_gpu_plan.py` (part of `gpu_checks.sh checks`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.manifests import load_manifest
from shardprep.planning.profile_format import load_profile
from shardprep.prep.convert import convert

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices")]


def test_profile_on_two_gpus_measures_gathers_interference_and_steps(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama", layers=8, hidden=512), out, 2, preset="llama", layers="1-:2")
    path = tmp_path / "profile.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    proc = subprocess.run([sys.executable, "-m", "shardprep", "profile", str(out), "--nproc", "2", "--tokens",
                           "16,256", "--backend", "ce", "--backend", "nccl", "--iters", "5", "--out", str(path)],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = load_profile(path)
    assert "H200" in p.device or "H100" in p.device or p.device.startswith("NVIDIA")
    assert [b.name for b in p.backends] == ["ce", "nccl"]
    assert all(ms > 0 for lay in p.layers for ms in lay.compute_ms)
    sharded = [r.layer for r in load_manifest(out).layers]
    for b in p.backends:
        assert sorted(b.gather_ms) == sharded and all(ms > 0 for ms in b.gather_ms.values())
        assert b.recv_gbps > 1 and min(b.compute_slowdown + b.gather_slowdown) >= 0
        assert all(ms > 0 for ms in b.sharded_step_ms)
    result = CliRunner().invoke(app, ["plan", str(out), "--ranks", "2", "--profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["backend"] == "ce" and len(report["every_layer"]["predictions"]) == 2
