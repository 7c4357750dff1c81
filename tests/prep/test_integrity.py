"""Every byte a loader reads is checked: validate finds damage anywhere, with stable codes; reads are exact."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.errors import IntegrityError, ManifestError
from shardprep.loader import open_rank
from shardprep.manifests import load_manifest
from shardprep.manifests.checksums import file_digest
from shardprep.manifests.exact_read import MAX_READ_CALL, pread_exact
from shardprep.manifests.manifest import seal
from shardprep.manifests.replicated import NOTICE_FILE, NOTICE_TENSOR
from shardprep.prep.convert import convert
from shardprep.prep.validate import REPORT_SCHEMA, validate

runner = CliRunner()


@pytest.fixture(scope="module")
def pristine(checkpoint_cache, conversion_cache):
    # Copied, not hard-linked: the tests below damage files, which must not reach the shared checkpoints.
    src = checkpoint_cache("llama", sharded=True)
    return src, conversion_cache(src, 3, preset="llama", copy_mode="copy")


@pytest.fixture
def converted(pristine, tmp_path):
    src, out = pristine
    return src, shutil.copytree(out, tmp_path / "out")


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.unlink()  # a new inode, so nothing linked to the old one changes
    path.write_bytes(bytes(data))


def codes(report):
    return [(p.code, p.file) for p in report.problems]


def replicated_safetensors(out):
    index = json.loads((out / "model.safetensors.index.json").read_text())
    return sorted({f for f in index["weight_map"].values() if (out / f).exists() and f != NOTICE_FILE})


def test_fresh_output_is_valid_and_json_report_has_the_schema(converted):
    src, out = converted
    result = runner.invoke(app, ["validate", str(out), "--source", str(src), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["schema"] == REPORT_SCHEMA and report["ok"] is True and report["problems"] == []
    assert report["format_version"] == 2 and report["checked"]["other_files"] >= 3


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_in_a_replicated_safetensors_file_is_caught(converted, where):
    _, out = converted
    name = replicated_safetensors(out)[0]
    path = out / name
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    flip(path, 8 + n + 5 if where == "data" else 8 + n // 2)
    report = validate(out)
    assert ("checksum_mismatch", name) in codes(report), report.messages
    with pytest.raises(IntegrityError, match=f"{name}: checksum"):
        open_rank(out, 0).load_replicated()
    if where == "data":
        assert open_rank(out, 0).load_replicated(verify=False)  # without verify the bytes are taken as they are


def test_flipped_byte_in_config_json_is_caught(converted):
    _, out = converted
    flip(out / "config.json", 10)
    assert codes(validate(out)) == [("checksum_mismatch", "config.json")]


def test_flipped_byte_in_the_index_is_caught(converted):
    _, out = converted
    path = out / "model.safetensors.index.json"
    text = path.read_text().replace('"total_size": ', '"total_size": 1', 1)
    path.unlink()
    path.write_text(text)
    report = validate(out)
    assert report.problems[0].code in ("checksum_mismatch", "file_size"), report.messages
    with pytest.raises(IntegrityError):
        open_rank(out, 0).load_replicated()


def test_flipped_byte_in_a_rank_chunk_is_caught_with_its_layer(converted):
    _, out = converted
    m = load_manifest(out)
    flip(out / m.rank_files[2], m.layers[1].file_offset + 7)
    (problem,) = validate(out).problems
    assert (problem.code, problem.file, problem.layer) == ("checksum_mismatch", m.rank_files[2], m.layers[1].layer)


def test_rank_header_must_be_the_expected_bytes(converted):
    _, out = converted
    m = load_manifest(out)
    path = out / m.rank_files[1]
    data = bytearray(path.read_bytes())
    assert data[len(m.rank_header) - 1:len(m.rank_header)] == b" "
    data[len(m.rank_header) - 1] = ord("\t")  # still valid JSON whitespace: the library accepts it
    path.write_bytes(bytes(data))
    assert codes(validate(out)) == [("rank_header_mismatch", m.rank_files[1])]
    with pytest.raises(IntegrityError, match="header is not the one the manifest implies"):
        open_rank(out, 1)


def test_nonzero_bytes_between_chunks_are_caught(pristine, tmp_path):
    src, _ = pristine
    out = tmp_path / "out"
    convert(src, out, 5, preset="llama", copy_mode="copy")  # C = 4928 bytes: gaps up to the next 4 KiB
    m = load_manifest(out)
    gap_at = m.layers[0].file_offset + m.layers[0].chunk_bytes
    assert gap_at < m.layers[1].file_offset
    flip(out / m.rank_files[0], gap_at)
    # The safetensors library sees a changed pad tensor; the manifest's rule says zeros.
    assert ("nonzero_padding", m.rank_files[0]) in codes(validate(out))


def test_empty_checksums_are_invalid(converted):
    _, out = converted
    data = json.loads((out / "shard_manifest.json").read_text())
    data["layers"][0]["checksums"] = []
    (out / "shard_manifest.json").write_text(json.dumps(data))
    report = validate(out)
    assert [p.code for p in report.problems] == ["manifest_schema"] and "checksums" in report.messages[0]
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 1


def test_missing_rank_file_with_source_is_a_problem_not_an_exception(converted):
    src, out = converted
    m = load_manifest(out)
    (out / m.rank_files[1]).unlink()
    report = validate(out, source=src)
    assert ("rank_file_missing", m.rank_files[1]) in codes(report)
    assert "source_check_skipped" in [p.code for p in report.problems]
    assert report.checked["replicated_tensors_compared"] > 0
    result = runner.invoke(app, ["validate", str(out), "--source", str(src), "--json"])
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert all(set(p) == {"code", "file", "layer", "tensor", "message"} for p in problems)


def test_human_output_is_one_line_per_problem(converted):
    _, out = converted
    m = load_manifest(out)
    flip(out / m.rank_files[0], m.layers[0].file_offset)
    flip(out / "config.json", 3)
    result = runner.invoke(app, ["validate", str(out)])
    lines = result.stderr.splitlines()
    assert result.exit_code == 1 and len(lines) == 3 and all(line.startswith("invalid: ") for line in lines)
    assert lines[-1] == f"invalid: {out}: 2 problems (checksum_mismatch 2)"  # the summary after them


def test_a_file_the_manifest_does_not_list_is_reported(converted):
    _, out = converted
    (out / "extra.py").write_text("print('not checksummed')\n")
    assert codes(validate(out)) == [("unlisted_file", "extra.py")]


def test_a_file_the_safetensors_library_refuses_is_never_valid(converted):
    # A shape of 2^70 rows of nothing: Python's integers hold it, the library's usize does not. Checksums
    # are made to match, so the library's refusal is the only thing wrong.
    _, out = converted
    header = json.dumps({"__metadata__": {"format": "pt"},
                         NOTICE_TENSOR: {"dtype": "U8", "shape": [1 << 70, 0], "data_offsets": [0, 0]}}).encode()
    path = out / NOTICE_FILE
    path.unlink()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    data = json.loads((out / "shard_manifest.json").read_text())
    size, digest = file_digest(path)
    for f in data["replicated_files"]:
        if f["path"] == NOTICE_FILE:
            f["size"], f["xxh3_128"] = size, digest
    (out / "shard_manifest.json").write_text(seal(json.dumps(data, indent=1)))
    assert codes(validate(out)) == [("invalid_safetensors", NOTICE_FILE)]


def test_an_edited_manifest_fails_its_own_checksum(converted):
    # A self-consistent edit (here: dropping the fused qkv view) passes every layout rule; the manifest's
    # checksum of itself is what catches it, so every byte a loader reads is covered.
    _, out = converted
    path = out / "shard_manifest.json"
    data = json.loads(path.read_text())
    assert data["layers"][0]["views"]
    data["layers"][0]["views"] = []
    path.write_text(json.dumps(data, indent=1))
    assert codes(validate(out)) == [("manifest_checksum_mismatch", "shard_manifest.json")]
    with pytest.raises(ManifestError, match="manifest_xxh3_128 is .* but the file's checksum is"):
        open_rank(out, 0)
    path.write_text(seal(json.dumps(data, indent=1)))  # what convert writes: sealed
    assert validate(out).ok


def test_symlinks_out_of_the_directory_are_refused_by_every_reader(converted, tmp_path):
    _, out = converted
    m = load_manifest(out)
    name = replicated_safetensors(out)[0]
    outside = tmp_path / "outside.safetensors"
    shutil.move(out / name, outside)
    os.symlink(outside, out / name)
    with pytest.raises(IntegrityError, match="leaves the output directory"):
        open_rank(out, 0).load_replicated()
    assert ("unsafe_path", name) in codes(validate(out))
    rank = out / m.rank_files[0]
    shutil.move(rank, tmp_path / "rank0")
    os.symlink(tmp_path / "rank0", rank)
    with pytest.raises(IntegrityError, match="leaves the output directory"):
        open_rank(out, 0)


def test_every_read_loops_until_done_when_pread_returns_short(converted, monkeypatch):
    # One pread returns at most 2,147,479,552 bytes (and any call may return fewer): a reader that takes one
    # call's answer as the whole tensor would report corruption here. Every read goes through the helper.
    src, out = converted
    real_preadv, real_pread = os.preadv, os.pread

    def short_preadv(fd, buffers, offset):
        (buf,) = buffers
        return real_preadv(fd, [memoryview(buf)[:1000]], offset)

    monkeypatch.setattr(os, "preadv", short_preadv)
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: real_pread(fd, min(n, 1000), offset))
    report = validate(out, source=src)
    assert report.ok, report.messages
    assert report.checked["target_tensors_compared"] > 0


class FakeBuffer:
    """Stands in for a buffer larger than one read call can fill, without allocating it."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, s):
        return FakeBuffer(len(range(self.n)[s]))


def test_pread_exact_splits_reads_over_2gib_and_follows_short_reads():
    calls = []  # (offset, bytes asked for, bytes returned)

    def fake_preadinto(fd, dest, offset):
        got = min(len(dest), 123_456_789) if len(calls) % 2 else len(dest)  # every other call returns short
        calls.append((offset, len(dest), got))
        return got

    total = 5 << 30
    pread_exact(3, FakeBuffer(total), 1000, "big.safetensors", preadinto=fake_preadinto)
    assert max(asked for _, asked, _ in calls) == MAX_READ_CALL  # never more than one call can return
    at = 1000
    for offset, _, got in calls:
        assert offset == at
        at += got
    assert at == 1000 + total and any(got < asked for _, asked, got in calls)


def test_pread_exact_reports_a_file_that_ends_early():
    def ends_after_10(fd, dest, offset):
        return max(0, min(len(dest), 10 - offset))

    with pytest.raises(IntegrityError, match="big.bin: truncated") as exc:
        pread_exact(3, FakeBuffer(100), 0, "big.bin", preadinto=ends_after_10)
    assert exc.value.code == "truncated_file"
