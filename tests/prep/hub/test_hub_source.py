"""A hub repo id resolves through a cache laid out the way huggingface_hub lays it out, fully offline."""

import json
import os
import subprocess
import sys

import pytest
from support.hub_cache import make_hub_cache


def run_cli(args, cache):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "shardprep", *map(str, args)], capture_output=True, text=True,
                          env=env)


def test_repo_id_converts_offline_from_cache_and_records_revision(checkpoint_cache, tmp_path):
    src = checkpoint_cache("llama", sharded=True)
    cache = tmp_path / "hub"
    commit = make_hub_cache(cache, "tiny-org/tiny-llama", src)
    out = tmp_path / "out"
    proc = run_cli(["convert", "tiny-org/tiny-llama", out, "--ranks", 2, "--preset", "llama", "--json"], cache)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "shard_manifest.json").read_text())
    assert manifest["source"]["repo_id"] == "tiny-org/tiny-llama"
    # The revision as typed (none: the default branch) and the commit it resolved to, kept apart.
    assert manifest["source"]["revision"] is None and manifest["source"]["commit"] == commit
    assert run_cli(["validate", out, "--source", src], cache).returncode == 0
    # Files without targets were hard-linked to the cache's blobs, not to the snapshot symlinks.
    summary = json.loads(proc.stdout)
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / commit
    assert summary["linked_files"], "a sharded checkpoint has files without targets: they must be linked"
    for name in summary["linked_files"]:
        blob = (snapshot / name).resolve()
        assert blob.parent.name == "blobs" and not (out / name).is_symlink()
        assert os.path.samefile(out / name, blob) and os.stat(blob).st_nlink == 2


@pytest.mark.parametrize("revision", [None, "v9"])
def test_repo_missing_from_cache_offline_is_a_clear_error(tmp_path, revision):
    cache = tmp_path / "hub"
    cache.mkdir()
    args = ["convert", "tiny-org/absent", tmp_path / "out", "--ranks", 2, "--preset", "llama"]
    if revision:
        args += ["--revision", revision]
    proc = run_cli(args, cache)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: tiny-org/absent: not in the local HF cache"), proc.stderr
    assert not (tmp_path / "out").exists()


def test_validate_against_a_repo_id_uses_the_recorded_commit(checkpoint_cache, tmp_path):
    src = checkpoint_cache("llama", sharded=True)
    cache = tmp_path / "hub"
    commit = make_hub_cache(cache, "tiny-org/tiny-llama", src)
    out = tmp_path / "out"
    assert run_cli(["convert", "tiny-org/tiny-llama", out, "--ranks", 2, "--preset", "llama"], cache).returncode == 0
    # main now points at a snapshot of other weights: validating against "main" would fail, the recorded
    # commit passes, and --revision overrides it.
    other = checkpoint_cache("llama", sharded=True, seed=1)
    newer = "fedcba9876543210fedcba9876543210fedcba98"
    repo_dir = cache / "models--tiny-org--tiny-llama"
    snap = repo_dir / "snapshots" / newer
    snap.mkdir()
    for path in sorted(other.iterdir()):
        (snap / path.name).write_bytes(path.read_bytes())
    (repo_dir / "refs" / "main").write_text(newer)
    assert run_cli(["validate", out, "--source", "tiny-org/tiny-llama"], cache).returncode == 0
    proc = run_cli(["validate", out, "--source", "tiny-org/tiny-llama", "--revision", newer, "--json"], cache)
    assert proc.returncode == 1
    codes = {p["code"] for p in json.loads(proc.stdout)["problems"]}
    assert "target_bytes_differ" in codes, codes
    assert commit != newer
