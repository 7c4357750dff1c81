"""conversion_cache (conftest.py): one conversion per argument set, and a shared output that changed is caught."""

import os
import shutil

import pytest
from conftest import _CachedOutput, _fingerprint

import shardprep
from shardprep.manifests import load_manifest


def test_one_conversion_per_argument_set_handed_to_every_caller(checkpoint_cache, conversion_cache, monkeypatch):
    calls = []
    real = shardprep.convert
    monkeypatch.setattr(shardprep, "convert", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    src = checkpoint_cache("llama")
    out = conversion_cache(src, 5, preset="llama")  # 5 ranks: no other fixture's argument set
    assert conversion_cache(src, 5, preset="llama") == out and len(calls) == 1
    other = conversion_cache(src, 5, preset="llama", chunk_alignment="2MiB")
    assert other != out and len(calls) == 2
    assert load_manifest(out).world_size == 5
    assert load_manifest(other).chunk_alignment != load_manifest(out).chunk_alignment
    with pytest.raises(TypeError, match="overwrite has no place in a shared output"):
        conversion_cache(src, 5, preset="llama", overwrite=True)


def test_a_shared_output_written_in_place_or_added_to_fails_naming_the_file(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    shardprep.convert(checkpoint_cache("llama"), out, 2, preset="llama")
    rank_file = out / load_manifest(out).rank_files[1]
    os.utime(rank_file, ns=(0, 0))  # so the write below moves its mtime however coarse the clock
    cached = _CachedOutput(out, _fingerprint(out), ["tests/test_x.py::test_writer"])
    cached.check()
    copy = shutil.copytree(out, tmp_path / "copy")
    (copy / "shard_manifest.json").write_text("{}")  # a copy is the test's own
    cached.check()
    with open(rank_file, "r+b") as f:  # same inode, same size: the mtime tells
        f.write(f.read(1))
    with pytest.raises(AssertionError, match=rf"{rank_file.name}; handed to tests/test_x.py::test_writer"):
        cached.check()
    cached = _CachedOutput(out, _fingerprint(out))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(AssertionError, match="changed: notes.txt"):
        cached.check()
