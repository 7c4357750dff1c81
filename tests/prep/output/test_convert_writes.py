"""How convert moves bytes: kernel copies of adjacent tensors in one call, writes from memory through a
pipe or pwrite with the same result, the disk write of every data byte started while convert runs, and a
failed copy leaving nothing behind."""

from __future__ import annotations

import errno
import json
import os
import threading

import numpy as np
import pytest
import torch
from safetensors import safe_open

import shardprep.prep.output.file_ranges as file_ranges
import shardprep.prep.output.safetensors_writer as safetensors_writer
import shardprep.prep.output.writeback as writeback_module
from shardprep.errors import OutputError
from shardprep.manifests.checksums import file_digest, file_hasher
from shardprep.prep.convert import convert
from shardprep.prep.output.safetensors_writer import FileRange, OutTensor, write_safetensors
from shardprep.prep.source import open_source
from shardprep.prep.validate import validate


def test_adjacent_tensors_of_a_file_are_copied_in_one_kernel_call(checkpoint_cache, tmp_path, monkeypatch):
    ckpt = open_source(checkpoint_cache("llama"))
    (sf,) = ckpt.files.values()
    by_offset = sorted((ckpt.tensors[n] for n in sf.tensors), key=lambda t: t.start)
    kept = by_offset[:3] + by_offset[4:6]  # two runs of adjacent tensors, split where one was dropped
    calls = []
    real = safetensors_writer.copy_range
    monkeypatch.setattr(safetensors_writer, "copy_range", lambda *a: calls.append(a[4]) or real(*a))
    out = [OutTensor(t.name, t.dtype, t.shape, FileRange(sf.path, t.start, t.nbytes)) for t in kept]
    out.insert(3, OutTensor("in.memory", "U8", (5,), b"\x01\x02\x03\x04\x05"))
    write_safetensors(tmp_path / "x.safetensors", out)
    assert calls == [sum(t.nbytes for t in kept[:3]), sum(t.nbytes for t in kept[3:])]
    with safe_open(tmp_path / "x.safetensors", "pt") as f, safe_open(sf.path, "pt") as g:
        for t in kept:
            assert torch.equal(f.get_tensor(t.name).view(torch.uint8), g.get_tensor(t.name).view(torch.uint8))
        assert f.get_tensor("in.memory").tolist() == [1, 2, 3, 4, 5]


def test_the_checksum_taken_while_writing_is_the_written_files(checkpoint_cache, tmp_path, monkeypatch):
    # Ranges copied by the kernel are read back in blocks smaller than the runs; memory is hashed in place.
    monkeypatch.setattr(safetensors_writer, "COPY_PIECE", 4096)
    ckpt = open_source(checkpoint_cache("llama"))
    (sf,) = ckpt.files.values()
    by_offset = sorted((ckpt.tensors[n] for n in sf.tensors), key=lambda t: t.start)
    out = [OutTensor(t.name, t.dtype, t.shape, FileRange(sf.path, t.start, t.nbytes)) for t in by_offset[:4]]
    out.insert(2, OutTensor("in.memory", "U8", (5,), lambda: np.arange(5, dtype=np.uint8)))
    hasher = file_hasher()
    write_safetensors(tmp_path / "x.safetensors", out, {"format": "pt"}, hasher=hasher)
    assert hasher.hexdigest() == file_digest(tmp_path / "x.safetensors")[1]


def written_through(tmp_path, monkeypatch, vmsplice) -> bytes:
    """A file written with pwrite_all from writable, read-only and sliced buffers of several sizes."""
    monkeypatch.setattr(file_ranges, "_vmsplice", vmsplice)
    rng = np.random.default_rng(0)
    path = tmp_path / f"out-{vmsplice is None}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    at = 3
    for size in (1, file_ranges.SPLICE_MIN - 1, file_ranges.SPLICE_MIN, (3 << 20) + 7):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        for buffer in (data, data.tobytes(), memoryview(bytearray(data.tobytes()))[1:]):
            file_ranges.pwrite_all(fd, buffer, at)
            at += len(memoryview(buffer))
    os.close(fd)
    return path.read_bytes()


def test_writes_from_memory_give_the_same_bytes_through_the_pipe_and_through_pwrite(tmp_path, monkeypatch):
    vmsplice = file_ranges._vmsplice
    if vmsplice is None:
        pytest.skip("no vmsplice here: pwrite_all always uses pwrite")
    spliced = written_through(tmp_path, monkeypatch, vmsplice)
    plain = written_through(tmp_path, monkeypatch, None)
    assert spliced == plain


def test_a_refused_splice_falls_back_to_pwrite_without_losing_bytes(tmp_path, monkeypatch):
    vmsplice = file_ranges._vmsplice
    if vmsplice is None:
        pytest.skip("no vmsplice here")
    real_splice = os.splice
    moved = []

    def splice_then_refuse(*args, **kwargs):  # the first piece goes through, then the filesystem refuses
        if moved:
            raise OSError(errno.EINVAL, "splice refused")
        moved.append(real_splice(*args, **kwargs))
        return moved[-1]

    plain = written_through(tmp_path, monkeypatch, None)
    monkeypatch.setattr(file_ranges.os, "splice", splice_then_refuse)
    file_ranges._drop_pipe()
    refused = written_through(tmp_path, monkeypatch, vmsplice)
    assert moved and refused == plain


def test_the_disk_write_of_every_data_byte_starts_during_convert(checkpoint_cache, tmp_path, monkeypatch):
    # What convert asks for is recorded at Writeback.start: the thread that passes requests on to the
    # kernel drops what is still queued at finish() (the fsyncs write it anyway), so on a busy machine
    # the kernel sees a timing-dependent subset, every call of which must be one convert asked for.
    src = checkpoint_cache("llama", sharded=True)
    requested: dict[str, list[tuple[int, int]]] = {}
    passed_on: list[tuple[str, int, int]] = []
    real_start = writeback_module.Writeback.start

    def start(self, path, offset, nbytes):
        requested.setdefault(os.path.basename(path), []).append((offset, offset + nbytes))
        real_start(self, path, offset, nbytes)

    def record(fd, offset, nbytes, flags):
        passed_on.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, offset + nbytes))
        return 0

    monkeypatch.setattr(writeback_module.Writeback, "start", start)
    monkeypatch.setattr(writeback_module, "_sync_file_range", record)
    fds_before = len(os.listdir("/proc/self/fd"))
    out = tmp_path / "out"
    summary = convert(src, out, 2, preset="llama", copy_mode="copy")
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no descriptor kept for the writeback
    m = json.loads((out / "shard_manifest.json").read_text())
    for rank_file in m["rank_files"]:  # every layer's chunk of every rank
        chunks = {(lay["file_offset"], lay["file_offset"] + lay["chunk_bytes"]) for lay in m["layers"]}
        assert set(requested[os.path.basename(rank_file)]) == chunks
    for name in summary.copied_files:  # every byte of every rewritten or copied file
        ranges = sorted(requested[os.path.basename(name)])
        assert ranges[0][0] == 0 and ranges[-1][1] == (out / name).stat().st_size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all((start, end) in requested[name] for name, start, end in passed_on)


def test_writeback_passes_a_request_to_the_kernel_and_fsyncs_its_file(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    passed_on = threading.Event()
    calls = []

    def record(fd, offset, nbytes, flags):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, nbytes, flags))
        passed_on.set()
        return 0

    fsynced = []
    monkeypatch.setattr(writeback_module, "_sync_file_range", record)
    monkeypatch.setattr(writeback_module.os, "fsync", lambda fd: fsynced.append(os.readlink(f"/proc/self/fd/{fd}")))
    with writeback_module.Writeback() as writeback:
        writeback.start(path, 4096, 4096)
        assert passed_on.wait(10)
        writeback.finish()
    assert calls == [(str(path), 4096, 4096, writeback_module.SYNC_FILE_RANGE_WRITE)]
    assert fsynced == [str(path)]


def test_a_failed_replicated_copy_leaves_nothing_behind(checkpoint_cache, tmp_path, monkeypatch):
    src = checkpoint_cache("llama", sharded=True)

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors_writer, "copy_range", no_space)
    out = tmp_path / "out"
    with pytest.raises(OutputError, match=r"model-0000\d-of-0000\d\.safetensors: no space left on device"):
        convert(src, out, 2, preset="llama", copy_mode="copy")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    convert(src, out, 2, preset="llama", copy_mode="copy")
    assert validate(out, source=src).ok
