"""open_rank: one rank file in, one buffer out, with the errors a deployment can hit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.checkpoints import read_state_dict

from shardprep.errors import IntegrityError, RuntimeShardError
from shardprep.loader import RankShards, iter_replicated, load_replicated, open_rank
from shardprep.loader.rank_shards import copy_through_staging
from shardprep.manifests import load_manifest
from shardprep.manifests.safetensors_header import read_safetensors_header
from shardprep.prep.convert import convert
from shardprep.runtime.views import layer_views

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def out3(checkpoint_cache, conversion_cache):
    """A llama checkpoint converted for 3 ranks (rows not divisible by 3: chunks split tensors)."""
    return conversion_cache(checkpoint_cache("llama", layers=4), 3, preset="llama")


def only_rank(out: Path, rank: int, dest: Path) -> Path:
    shutil.copytree(out, dest)
    keep = load_manifest(out).rank_files[rank]
    for f in (dest / "shards").iterdir():
        if f"shards/{f.name}" != keep:
            f.unlink()
    return dest


def test_buffer_is_the_rank_file_and_chunks_sit_at_file_offsets(out3):
    m = load_manifest(out3)
    for rank in range(3):
        shards = open_rank(out3, rank, 3)
        data = (out3 / m.rank_files[rank]).read_bytes()
        assert isinstance(shards, RankShards) and shards.device == torch.device("cpu")
        assert shards.nbytes == m.rank_file_bytes == len(data)
        assert bytes(shards.buffer.numpy()) == data
        for r in m.layers:
            chunk = shards.chunk(r.layer)
            assert chunk.data_ptr() == shards.buffer.data_ptr() + r.file_offset
            assert bytes(chunk.numpy()) == data[r.file_offset:r.file_offset + r.chunk_bytes]


def test_chunks_of_all_ranks_rebuild_the_source_through_views(out3, checkpoint_cache):
    src = read_state_dict(checkpoint_cache("llama", layers=4))
    ranks = [open_rank(out3, r) for r in range(3)]
    for record in ranks[0].manifest.layers:
        flat = torch.cat([s.chunk(record.layer) for s in ranks])
        views = layer_views(record, flat)
        for e in record.entries:
            assert torch.equal(views[e.name].view(torch.uint8), src[e.name].view(torch.uint8)), e.name
        for v in record.views:
            fused = torch.cat([src[name] for name in v.members])
            assert torch.equal(views[v.name].view(torch.uint8), fused.view(torch.uint8)), v.name


def test_loads_with_only_its_own_rank_file(out3, tmp_path):
    d = only_rank(out3, 1, tmp_path / "r1")
    shards = open_rank(d, 1, 3, verify=True)
    assert bytes(shards.buffer.numpy()) == (out3 / load_manifest(out3).rank_files[1]).read_bytes()
    with pytest.raises(RuntimeShardError, match=r"rank-00000-of-00003\.safetensors: rank 0's shard file is missing"):
        open_rank(d, 0, 3)


def test_world_size_mismatch_names_both_sizes_and_the_manifest(out3):
    with pytest.raises(RuntimeShardError) as exc:
        open_rank(out3, 0, world_size=4)
    msg = str(exc.value)
    assert "world size 3" in msg and "world size 4" in msg and "shard_manifest.json" in msg


def test_rank_out_of_range(out3):
    with pytest.raises(RuntimeShardError, match=r"rank 3 is out of range for world size 3"):
        open_rank(out3, 3)


def test_verify_catches_a_flipped_byte_and_names_the_layer(out3, tmp_path):
    d = shutil.copytree(out3, tmp_path / "bad")
    m = load_manifest(d)
    victim = m.layers[1]
    path = d / m.rank_files[2]
    data = bytearray(path.read_bytes())
    data[victim.file_offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    open_rank(d, 2)  # without verify the bytes are taken as they are
    with pytest.raises(RuntimeShardError, match=rf"layer {victim.layer}'s chunk .* the file is corrupt"):
        open_rank(d, 2, verify=True)
    open_rank(d, 1, verify=True)  # other ranks' files are untouched


def test_truncated_rank_file_is_refused(out3, tmp_path):
    d = shutil.copytree(out3, tmp_path / "short")
    path = d / load_manifest(d).rank_files[0]
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(RuntimeShardError, match="truncated"):
        open_rank(d, 0)


def test_load_replicated_is_every_non_target_bit_exact(out3, checkpoint_cache):
    src = read_state_dict(checkpoint_cache("llama", layers=4))
    shards = open_rank(out3, 0)
    rest = shards.load_replicated("cpu")
    assert set(rest) == set(src) - set(shards.manifest.target_names())
    for name, t in rest.items():
        assert t.dtype == src[name].dtype and torch.equal(t.view(torch.uint8), src[name].view(torch.uint8))


def test_iter_replicated_hands_out_load_replicated_one_tensor_at_a_time(out3):
    m = load_manifest(out3)
    whole = load_replicated(out3, m)
    seen = []
    for name, t in iter_replicated(out3, m):
        assert t.dtype == whole[name].dtype and torch.equal(t.view(torch.uint8), whole[name].view(torch.uint8))
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # memory of its own, not a file map
        seen.append(name)
    assert sorted(seen) == sorted(whole)


def test_iter_replicated_refuses_a_corrupt_file_before_handing_out_any_of_its_tensors(out3, tmp_path):
    d = shutil.copytree(out3, tmp_path / "bad")
    m = load_manifest(d)
    name = json.loads((d / m.replicated_index).read_text())["weight_map"]["model.embed_tokens.weight"]
    path = d / name
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    held = set(read_safetensors_header(path).tensors)
    got = []
    with pytest.raises(IntegrityError, match=f"{name}: checksum"):
        for tensor_name, _ in iter_replicated(d, m):
            got.append(tensor_name)
    assert not held & set(got)


def test_load_replicated_names_a_missing_index(out3, tmp_path):
    d = shutil.copytree(out3, tmp_path / "noindex")
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(IntegrityError, match="model.safetensors.index.json: safetensors index not found"):
        open_rank(d, 0).load_replicated()


@pytest.mark.parametrize("total,staging", [(0, 8), (1, 8), (9, 8), (64, 8), (1000, 64), (1000, 2000)])
def test_staged_copy_equals_the_source_for_any_size(total, staging):
    data = bytearray(i * 7 % 256 for i in range(total))
    dst = torch.full((total,), 0xAA, dtype=torch.uint8)
    copy_through_staging(dst, data, torch.empty(staging, dtype=torch.uint8))
    assert bytes(dst.numpy()) == data


def test_allocate_supplies_the_buffer(out3):
    given = []

    def allocate(nbytes):
        given.append(torch.empty(nbytes, dtype=torch.uint8))
        return given[-1]

    shards = open_rank(out3, 0, allocate=allocate)
    assert shards.loaded and shards.buffer is given[0]  # the caller chose the memory: read into it at once
    moved = []
    before = bytes(shards.buffer.numpy())
    shards.rehome(lambda n: moved.append(torch.empty(n, dtype=torch.uint8)) or moved[-1])
    assert shards.buffer is moved[0] and bytes(shards.buffer.numpy()) == before


def test_open_rank_reads_nothing_until_the_buffer_is_used(out3, monkeypatch):
    m = load_manifest(out3)
    data = (out3 / m.rank_files[1]).read_bytes()
    real, read = os.preadv, []

    def counting_preadv(fd, buffers, offset):
        got = real(fd, buffers, offset)
        read.append(got)
        return got

    monkeypatch.setattr(os, "preadv", counting_preadv)
    shards = open_rank(out3, 1, 3, manifest=m)
    assert not shards.loaded and sum(read) == len(m.rank_header)  # the header check alone
    assert shards.nbytes == len(data) and shards.device == torch.device("cpu")
    read.clear()
    first = m.layers[0]
    assert bytes(shards.chunk(first.layer).numpy()) == data[first.file_offset:first.file_offset + first.chunk_bytes]
    assert shards.loaded and sum(read) == len(data) and bytes(shards.buffer.numpy()) == data


def test_rehome_before_first_use_reads_the_file_straight_into_the_given_memory(out3):
    data = (out3 / load_manifest(out3).rank_files[2]).read_bytes()
    shards = open_rank(out3, 2, 3)
    home = torch.full((len(data),), 0xAA, dtype=torch.uint8)
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):
        copies.append(src.numel())
        return real_copy(self, src, *args, **kwargs)

    torch.Tensor.copy_ = counting_copy
    try:
        shards.rehome(lambda nbytes: home)
    finally:
        torch.Tensor.copy_ = real_copy
    assert copies == []  # no buffer in between: the file's bytes were read into `home` itself
    assert shards.buffer is home and bytes(home.numpy()) == data


def test_the_checked_file_is_read_even_if_the_directory_is_replaced_before_first_use(out3, tmp_path):
    d = shutil.copytree(out3, tmp_path / "out")
    rel = load_manifest(d).rank_files[0]
    data = (d / rel).read_bytes()
    shards = open_rank(d, 0, 3)
    (d / rel).unlink()  # as `convert --overwrite` swaps OUT: the checked file lives on while it is open
    (d / rel).write_bytes(bytes(len(data)))
    assert bytes(shards.buffer.numpy()) == data


def test_the_rank_file_is_closed_once_read_or_when_the_shards_are_dropped(out3):
    import gc

    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    shards = open_rank(out3, 0, 3)
    assert open_fds() == before + 1
    assert shards.buffer.numel() == shards.nbytes
    assert open_fds() == before
    shards = open_rank(out3, 0, 3)
    del shards
    gc.collect()
    assert open_fds() == before


def test_a_read_that_fails_after_the_checks_names_the_file_and_leaves_no_buffer(out3, tmp_path):
    d = shutil.copytree(out3, tmp_path / "out")
    path = d / load_manifest(d).rank_files[0]
    shards = open_rank(d, 0, 3)
    os.truncate(path, path.stat().st_size // 2)  # shrunk in place after open_rank checked it
    with pytest.raises(IntegrityError, match=r"rank-00000-of-00003\.safetensors: truncated"):
        shards.chunk(shards.manifest.layers[0].layer)
    assert not shards.loaded
    with pytest.raises(RuntimeShardError, match="rank 0's shard file could not be read"):
        shards.chunk(shards.manifest.layers[0].layer)


def test_host_anonymous_memory_grows_by_the_buffer_alone(checkpoint_cache, tmp_path):
    # A bigger model (about 6 MB of targets per layer), one rank: the file maps into page cache, so
    # anonymous memory may grow by the CPU buffer (the "device" memory here) and nothing else.
    out = tmp_path / "out"
    convert(checkpoint_cache("llama", layers=4, hidden=1024, tokenizer=False), out, 1, preset="llama")
    code = f"""
import json, threading, time, torch
from shardprep.loader import open_rank
def anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024
base = anon(); peak = [base]; stop = []
def sample():
    while not stop:
        peak[0] = max(peak[0], anon()); time.sleep(0.0005)
t = threading.Thread(target=sample); t.start()
shards = open_rank({str(out)!r}, 0, verify=True)
shards.buffer  # read on first use
stop.append(1); t.join(); peak[0] = max(peak[0], anon())
print(json.dumps({{"growth": peak[0] - base, "buffer": shards.nbytes}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["buffer"] > 16 << 20
    assert got["growth"] <= got["buffer"] + (4 << 20), got


def test_read_chunk_reads_one_layers_chunk_alone_and_equals_the_buffers(out3):
    for rank in range(3):
        unread = open_rank(out3, rank, world_size=3)
        chunks = {r.layer: unread.read_chunk(r.layer) for r in unread.manifest.layers}
        assert not unread.loaded  # each chunk read from the file alone, the buffer never filled
        whole = open_rank(out3, rank, world_size=3)
        for layer, chunk in chunks.items():
            assert torch.equal(chunk, whole.chunk(layer))
            into = torch.empty_like(chunk)
            assert whole.read_chunk(layer, into=into) is into and torch.equal(into, chunk)  # from the buffer now
    with pytest.raises(RuntimeShardError, match="layer 1's chunk needs"):
        unread.read_chunk(1, into=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(RuntimeShardError, match="layer 99 is not in the manifest"):
        unread.read_chunk(99)
