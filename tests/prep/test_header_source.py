"""`plan` and `convert --dry-run` on a hub id read config.json, the index and the safetensors headers only.

A local server (tests/support/fake_hub.py) stands in for the hub, HF_ENDPOINT pointed at it, serving a DeepSeek-V3
at its published size (in BF16: 1.3 TB) whose data is a hole (tests/support/sparse_checkpoints.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.fake_hub import FakeHub
from support.sparse_checkpoints import DEEPSEEK_V3_CONFIG, deepseek_v3_tensors, write_sparse_checkpoint

REPO = "tiny-org/deepseek-v3-bf16"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    config = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "quantization_config"}
    src = write_sparse_checkpoint(tmp_path_factory.mktemp("hub") / "repo", config, deepseek_v3_tensors(config))
    with FakeHub({REPO: src}) as server:
        yield server, src


def run_cli(args, hub_server, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env |= {"HF_ENDPOINT": hub_server.endpoint, "HF_HUB_CACHE": str(tmp_path / "cache"),
            "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "-m", "shardprep", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)


def files_bytes(src):
    return sum(p.stat().st_size for p in src.iterdir())


@pytest.mark.parametrize("command", [
    ["plan", REPO, "--preset", "deepseek-v3", "--layers", "1-60", "--dp", "16", "--ep", "16", "--json"],
    ["convert", REPO, "OUT", "--ranks", "8", "--preset", "deepseek-v3", "--dry-run", "--json"],
])
def test_a_hub_id_is_planned_from_its_headers_alone(hub, tmp_path, command):
    server, src = hub
    before = server.sent_bytes
    proc = run_cli([str(tmp_path / a) if a == "OUT" else a for a in command], server, tmp_path)
    assert proc.returncode == 0, (proc.stderr, server.requests[-5:])
    sent = server.sent_bytes - before
    report = json.loads(proc.stdout)
    # What the tool says it fetched is what the server sent, and both are headers: well under 1% of the files.
    assert report["fetched_bytes"] == sent
    assert sent < 0.01 * files_bytes(src), (sent, files_bytes(src))
    # Nothing reached the cache: config.json and the index are read into memory, and no weights were downloaded.
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert not cached, cached
    assert not (tmp_path / "OUT").exists()


def test_the_hub_plan_equals_the_local_plan(hub, tmp_path):
    server, src = hub
    args = ["--preset", "deepseek-v3", "--layers", "1-60", "--dp", "16", "--ep", "16", "--json"]
    remote = json.loads(run_cli(["plan", REPO, *args], server, tmp_path).stdout)
    local = json.loads(run_cli(["plan", str(src), *args], server, tmp_path).stdout)
    assert local["fetched_bytes"] is None and remote["fetched_bytes"] > 0
    for key in ("every_layer", "capacity", "experts", "layers", "verdict_line"):
        assert remote[key] == local[key], key


def test_a_repo_the_hub_does_not_have_is_one_line(hub, tmp_path):
    server, _ = hub
    proc = run_cli(["plan", "tiny-org/absent", "--ranks", "8"], server, tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: tiny-org/absent: "), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_block_fp8_dry_run_fetches_the_scales_it_checks_by_range(checkpoint_cache, tmp_path):
    # A small real block-FP8 checkpoint (not sparse): deciding the requant reads scales, fetched by range.
    from support.fp8_fixture import quantize_checkpoint_fp8

    src = quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3", sharded=True), tmp_path / "fp8")
    args = ["--ranks", "2", "--preset", "deepseek-v3", "--dry-run", "--json"]
    with FakeHub({"tiny-org/ds-fp8": src}) as server:
        remote = run_cli(["convert", "tiny-org/ds-fp8", tmp_path / "a", *args], server, tmp_path)
        assert remote.returncode == 0, remote.stderr
        ranges = [r for r in server.requests if r[2] is not None]
    local = json.loads(run_cli(["convert", src, tmp_path / "b", *args], server, tmp_path).stdout)
    remote_summary = json.loads(remote.stdout)
    assert remote_summary["quantization"] == local["quantization"] is not None
    assert remote_summary["requantized_weights"] == local["requantized_weights"] > 0
    # Headers (one range per file) and at least one scale beyond them.
    assert len(ranges) > len({p for _, p, _ in ranges})
