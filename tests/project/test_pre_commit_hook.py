"""The pre-commit hooks of .pre-commit-hooks.yaml, run by pre-commit itself in a temporary git repository.

`pre-commit try-repo` runs a hook of this repository as a user's config would. The `language: system` hook
installs nothing, so the test needs no network (an unreachable proxy and PIP_NO_INDEX make sure of it);
the `language: python` hook is the same check run from pre-commit's own environment, which pre-commit
fills from the package index on first use, so here it is only held to the same definition.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardprep.manifests.manifest import MANIFEST_NAME
from shardprep.prep.convert import convert

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / ".pre-commit-hooks.yaml"


def hooks() -> dict[str, dict]:
    return {hook["id"]: hook for hook in yaml.safe_load(HOOKS.read_text())}


def test_both_hooks_run_the_same_check_on_manifest_files():
    by_id = hooks()
    python, system = by_id["shardprep-validate-manifest"], by_id["shardprep-validate-manifest-system"]
    assert (python["language"], system["language"]) == ("python", "system")
    assert python["entry"] == system["entry"] == "shardprep validate --manifest-only"
    assert python["files"] == system["files"]
    pattern = re.compile(python["files"])
    assert pattern.search("deploy/llama/shard_manifest.json") and pattern.search(MANIFEST_NAME)
    assert not pattern.search("deploy/not_shard_manifest.json.bak") and not pattern.search("my_shard_manifest.json")


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.mark.skipif(importlib.util.find_spec("pre_commit") is None,
                    reason="pre-commit is not installed (it is in shardprep[test])")
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs git and a git checkout of shardprep")
def test_the_hook_checks_every_manifest_in_a_repository_offline(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama"), out, 2, preset="llama")
    repo = tmp_path / "deployments"
    for name in ("good", "bad"):
        (repo / name).mkdir(parents=True)
        shutil.copyfile(out / MANIFEST_NAME, repo / name / MANIFEST_NAME)
    data = json.loads((repo / "bad" / MANIFEST_NAME).read_text())
    data["world_size"] = 3  # an edit without re-sealing: its own checksum and the layout both fail
    (repo / "bad" / MANIFEST_NAME).write_text(json.dumps(data, indent=1))
    (repo / "notes.json").write_text("{not a manifest")  # not matched by the hook
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    # `shardprep` on PATH runs this checkout, whatever is installed.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "shardprep").write_text(f"#!/bin/sh\nexec {sys.executable} -m shardprep \"$@\"\n")
    (bin_dir / "shardprep").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"), "PIP_NO_INDEX": "1",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}

    def run_hook() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pre_commit", "try-repo", str(ROOT),
                               "shardprep-validate-manifest-system", "--all-files"], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=300)

    result = run_hook()
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"valid, with warnings: good/{MANIFEST_NAME} (manifest only" in result.stdout, result.stdout
    assert f"invalid: bad/{MANIFEST_NAME}: world_size is 3 but rank_files lists 2 files" in result.stdout
    assert f"invalid: bad/{MANIFEST_NAME}: manifest_xxh3_128 is" in result.stdout and "notes.json" not in result.stdout
    shutil.copyfile(out / MANIFEST_NAME, repo / "bad" / MANIFEST_NAME)
    git(repo, "add", "-A")
    result = run_hook()
    assert result.returncode == 0 and "Passed" in result.stdout, result.stdout + result.stderr
