"""iter_full_targets: the full target tensors rebuilt from every rank's file, and what it refuses."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from support.checkpoints import read_state_dict
from support.damage import flip_byte

from shardprep.errors import IntegrityError
from shardprep.loader.full_targets import iter_full_targets
from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert


@pytest.fixture(scope="module")
def converted(checkpoint_cache, conversion_cache):
    """A llama checkpoint converted for 3 ranks (rows not divisible by 3: tensors straddle chunks)."""
    src = checkpoint_cache("llama", layers=4)
    return src, conversion_cache(src, 3, preset="llama")


def copy_of(out: Path, dest: Path) -> Path:
    shutil.copytree(out, dest)
    return dest



def test_full_targets_are_the_source_tensors_byte_for_byte(converted):
    src, out = converted
    source = read_state_dict(src)
    manifest = load_manifest(out)
    got = dict(iter_full_targets(out))
    assert sorted(got) == sorted(manifest.target_names())  # entries only: no fused view names
    for name, tensor in got.items():
        assert tensor.dtype == source[name].dtype and tensor.shape == source[name].shape, name
        assert torch.equal(tensor.view(torch.uint8), source[name].view(torch.uint8)), name


def test_only_the_chunks_holding_the_wanted_tensors_are_read(converted, tmp_path):
    src, out = converted
    manifest = load_manifest(out)
    record = manifest.layers[0]
    # The first entry of a layer starts in rank 0's chunk; pick one that ends there too.
    first = next(e for e in record.entries if e.offset + e.nbytes <= record.chunk_bytes)
    only0 = copy_of(out, tmp_path / "only0")
    for rel in manifest.rank_files[1:]:
        os.unlink(only0 / rel)
    got = dict(iter_full_targets(only0, names=[first.name]))
    assert list(got) == [first.name]
    assert torch.equal(got[first.name], read_state_dict(src)[first.name])
    last = record.entries[-1]  # lies in a later rank's chunk, whose file is gone
    missing = r"rank-0000([12])-of-00003\.safetensors: rank \1's shard file .* not found"
    with pytest.raises(IntegrityError, match=missing):
        dict(iter_full_targets(only0, names=[last.name]))


def test_flipped_byte_in_a_chunk_is_refused_naming_the_rank_file(converted, tmp_path):
    _, out = converted
    manifest = load_manifest(out)
    bad = copy_of(out, tmp_path / "bad")
    record = manifest.layers[-1]
    flip_byte(bad / manifest.rank_files[2], record.file_offset + record.chunk_bytes // 2)
    with pytest.raises(IntegrityError, match=f"{manifest.rank_files[2]}: layer {record.layer}'s chunk .* corrupt"):
        for _ in iter_full_targets(bad):
            pass
    # Without verification the same bytes are read as they are (the check is what refuses them).
    assert len(dict(iter_full_targets(bad, verify=False))) == len(manifest.target_names())


def test_truncated_or_missing_rank_file_is_refused_naming_it(converted, tmp_path):
    _, out = converted
    manifest = load_manifest(out)
    short = copy_of(out, tmp_path / "short")
    path = short / manifest.rank_files[1]
    os.truncate(path, manifest.layers[-1].file_offset + 1)
    with pytest.raises(IntegrityError, match=f"{manifest.rank_files[1]}: truncated"):
        dict(iter_full_targets(short, verify=False))
    path.unlink()
    with pytest.raises(IntegrityError, match=f"{manifest.rank_files[1]}: rank 1's shard file .* not found"):
        dict(iter_full_targets(short))


def test_a_rank_file_of_another_conversion_is_refused_by_its_header(converted, checkpoint_cache, tmp_path):
    _, out = converted
    other = tmp_path / "other"
    convert(checkpoint_cache("llama", layers=4), other, 3, preset="llama", layers="2-")  # other layers: other header
    mixed = copy_of(out, tmp_path / "mixed")
    rel = load_manifest(out).rank_files[0]
    shutil.copyfile(other / load_manifest(other).rank_files[0], mixed / rel)
    with pytest.raises(IntegrityError, match=f"{rel}: its safetensors header is not the one the manifest implies"):
        dict(iter_full_targets(mixed, verify=False))
