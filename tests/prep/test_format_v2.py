"""Format version 2 on disk: rank files are safetensors files, plain loaders fail loudly, v1 still reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shardprep.loader import open_rank
from shardprep.manifests import load_manifest
from shardprep.manifests.layout import TensorSpec
from shardprep.manifests.replicated import NOTICE_FILE, NOTICE_TENSOR, SHARDED_SENTINEL
from shardprep.prep.convert import convert
from shardprep.prep.convert_plan import AUTO_CHUNK_ALIGNMENT, choose_rank_layout
from shardprep.prep.selection import TargetPlan
from shardprep.prep.validate import validate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def out3(checkpoint_cache, conversion_cache):
    """A single-file llama converted for 3 ranks (chunks split tensors mid-row)."""
    return conversion_cache(checkpoint_cache("llama", layers=4), 3, preset="llama")


def test_safe_open_reads_every_rank_file_and_each_layer_is_its_chunk(out3):
    m = load_manifest(out3)
    assert m.version == 2 and all(rel.endswith(".safetensors") for rel in m.rank_files)
    for rel in m.rank_files:
        data = (out3 / rel).read_bytes()
        with safe_open(out3 / rel, framework="pt") as f:
            layers = sorted(k for k in f.keys() if k.startswith("layer."))
            assert layers == sorted(f"layer.{r.layer}" for r in m.layers)
            for r in m.layers:
                chunk = f.get_tensor(f"layer.{r.layer}")
                assert chunk.dtype == torch.uint8 and chunk.numel() == r.chunk_bytes
                assert bytes(chunk.numpy()) == data[r.file_offset:r.file_offset + r.chunk_bytes]
            for pad in (k for k in f.keys() if k.startswith("pad.")):
                assert not f.get_tensor(pad).any(), pad


def test_header_is_byte_identical_on_every_rank_and_chunks_sit_at_file_offset(out3):
    m = load_manifest(out3)
    header = m.rank_header
    assert len(header) == m.layers[0].file_offset and header[8:9] == b"{" and header.endswith(b" ")
    for rel in m.rank_files:
        data = (out3 / rel).read_bytes()
        assert data[:len(header)] == header
        assert len(data) == m.rank_file_bytes
    for r in m.layers:
        assert r.file_offset % 4096 == 0


def test_open_rank_buffer_is_the_whole_file_header_included(out3):
    m = load_manifest(out3)
    shards = open_rank(out3, 2, 3, verify=True)
    assert bytes(shards.buffer.numpy()) == (out3 / m.rank_files[2]).read_bytes()
    r = m.layers[0]
    assert shards.chunk(r.layer).data_ptr() == shards.buffer.data_ptr() + r.file_offset


def test_transformers_from_pretrained_fails_naming_the_sentinel(out3):
    import transformers

    index = json.loads((out3 / "model.safetensors.index.json").read_text())
    targets = set(load_manifest(out3).target_names())
    assert {t for t, f in index["weight_map"].items() if f == SHARDED_SENTINEL} == targets
    assert not (out3 / SHARDED_SENTINEL).exists() and not (out3 / "model.safetensors").exists()
    with pytest.raises(OSError) as exc:
        transformers.AutoModelForCausalLM.from_pretrained(out3)
    assert SHARDED_SENTINEL in str(exc.value)
    assert "shardprep" in SHARDED_SENTINEL and "shard_manifest.json" in SHARDED_SENTINEL


def test_loaders_that_glob_safetensors_meet_the_notice_tensor(out3):
    # vLLM and SGLang glob OUT/*.safetensors and keep the files the index names: the notice file is one of
    # them, and its one tensor (a name no model has) is what their weight loaders then fail on.
    index = json.loads((out3 / "model.safetensors.index.json").read_text())
    top = {p.name for p in out3.glob("*.safetensors")}
    kept = top & set(index["weight_map"].values())
    assert NOTICE_FILE in kept and not any(name.startswith("rank-") for name in top)
    with safe_open(out3 / NOTICE_FILE, framework="pt") as f:
        assert list(f.keys()) == [NOTICE_TENSOR] and "shardprep" in f.metadata()["shardprep"]
    assert "." not in NOTICE_TENSOR  # loaders split names on dots; the whole sentence reaches their error


def test_shardprep_readers_skip_the_sentinel_and_the_notice(out3, checkpoint_cache):
    from support.checkpoints import read_state_dict

    rest = open_rank(out3, 0).load_replicated()
    source = read_state_dict(checkpoint_cache("llama", layers=4))
    assert set(rest) == set(source) - set(load_manifest(out3).target_names())
    assert NOTICE_TENSOR not in rest


def test_manifest_records_provenance(out3, checkpoint_cache):
    m = load_manifest(out3)
    src = checkpoint_cache("llama", layers=4)
    assert m.source["path"] == str(src.resolve()) and m.source["repo_id"] is None and m.source["commit"] is None
    assert m.selection == {"preset": "llama", "preset_targets": m.selection["preset_targets"], "targets": [],
                           "layers": "1-", "layer_pattern": m.selection["layer_pattern"]}
    assert m.selection["preset_targets"] and m.selection["layer_pattern"]
    assert m.requant_options == {"mode": "auto", "scope": "all", "recipe": "sglang", "scale_format": "f32",
                                 "allow_nonfinite": False}
    assert m.created_by.startswith("shardprep ")
    listed = {f.path for f in m.replicated_files}
    assert {"model.safetensors.index.json", "config.json", NOTICE_FILE} <= listed
    assert not listed & {"shard_manifest.json", *m.rank_files}


def test_explicit_chunk_alignment_pads_chunks_and_aligns_offsets(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    summary = convert(checkpoint_cache("llama"), out, 2, preset="llama", chunk_alignment="64KiB")
    m = load_manifest(out)
    assert m.chunk_alignment == 65536 and m.file_alignment == 65536 and summary.chunk_alignment == 65536
    for r in m.layers:
        assert r.chunk_bytes % 65536 == 0 and r.file_offset % 65536 == 0
    # Per rank: the file less the JSON header and each layer's ⌈used/N⌉.
    used = [max(e.offset + e.nbytes for e in r.entries) for r in m.layers]
    assert summary.alignment_padding_bytes == m.rank_file_bytes - m.rank_header_json_bytes - sum(
        -(-u // 2) for u in used)
    assert validate(out, source=checkpoint_cache("llama")).ok
    with safe_open(out / m.rank_files[1], framework="pt") as f:
        assert f.get_tensor(f"layer.{m.layers[1].layer}").numel() == m.layers[1].chunk_bytes


def test_auto_alignment_is_2mib_only_when_its_padding_costs_at_most_one_percent():
    def layers(nbytes: int) -> list[tuple[int, list[TensorSpec]]]:
        return [(i, [TensorSpec(f"layers.{i}.w", "U8", (nbytes,))]) for i in range(1, 5)]

    plan = TargetPlan(layers={}, groups={})
    # 4 layers of 1 GiB + 1 byte over 8 ranks: under 8 MiB of padding per rank against 4 GiB of Σ|T|.
    big = choose_rank_layout(layers((1 << 30) + 1), plan, 8)
    assert big.chunk_alignment == AUTO_CHUNK_ALIGNMENT
    # 4 layers of 100 KiB: 2 MiB chunks would be mostly padding.
    small = choose_rank_layout(layers(100 << 10), plan, 8)
    assert small.chunk_alignment == 16


def test_thousands_of_ranks_convert_with_few_open_files(checkpoint_cache, tmp_path):
    # 2000 rank files under a limit of 64 open files: the writer holds one rank file at a time. fsync is
    # skipped to keep the test fast (durability is not what it checks).
    src = checkpoint_cache("llama", layers=2)
    out = tmp_path / "out"
    code = f"""
import os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
os.fsync = lambda fd: None
from shardprep.prep.convert import convert
convert({str(src)!r}, {str(out)!r}, 2000, preset="llama")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = load_manifest(out)
    assert len(m.rank_files) == 2000 and len(list((out / "shards").iterdir())) == 2000
    assert all(len(r.checksums) == 2000 for r in m.layers)
    shards = open_rank(out, 1999, 2000, verify=True)
    assert shards.nbytes == m.rank_file_bytes


def test_ranks_above_the_maximum_are_refused_with_one_line(checkpoint_cache, tmp_path):
    from shardprep.errors import ShardprepError

    with pytest.raises(ShardprepError, match="above the maximum of 65536 ranks"):
        convert(checkpoint_cache("llama"), tmp_path / "out", 65537, preset="llama")
    assert not (tmp_path / "out").exists()


# -- format version 1 ----------------------------------------------------------------------------


def downgrade_to_v1(out: Path) -> None:
    """Rewrite a version-2 output in place as version 1 wrote it: headerless `.bin` rank files with the first
    chunk at byte 0, no sentinel or notice, no replicated checksums or provenance fields."""
    m = json.loads((out / "shard_manifest.json").read_text())
    first = m["layers"][0]["file_offset"]
    assert m["chunk_alignment"] == 16, "v1 had 16-byte chunks only"
    rank_files = []
    for rel in m["rank_files"]:
        data = (out / rel).read_bytes()[first:]
        (out / rel).unlink()
        new = rel.replace(".safetensors", ".bin")
        (out / new).write_bytes(data)
        rank_files.append(new)
    for layer in m["layers"]:
        layer["file_offset"] -= first
    for key in ("chunk_alignment", "replicated_files", "selection", "requant_options", "manifest_xxh3_128"):
        del m[key]
    m["version"], m["rank_files"] = 1, rank_files
    m["source"] = {k: m["source"][k] for k in ("path", "repo_id", "revision", "files")}
    if m["quantization"]:
        del m["quantization"]["allow_nonfinite"]
    (out / "shard_manifest.json").write_text(json.dumps(m))
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {t: f for t, f in index["weight_map"].items() if f not in (SHARDED_SENTINEL, NOTICE_FILE)}
    index_path.write_text(json.dumps(index))
    (out / NOTICE_FILE).unlink()


@pytest.fixture
def v1_out(out3, tmp_path):
    out = shutil.copytree(out3, tmp_path / "v1")
    downgrade_to_v1(out)
    return out


def test_v1_directory_still_opens_with_the_same_chunks(v1_out, out3):
    m1 = load_manifest(v1_out)
    assert m1.version == 1 and m1.rank_header == b"" and m1.layers[0].file_offset == 0
    for rank in range(3):
        old, new = open_rank(v1_out, rank, verify=True), open_rank(out3, rank)
        for r in m1.layers:
            assert torch.equal(old.chunk(r.layer), new.chunk(r.layer))
    assert set(open_rank(v1_out, 0).load_replicated()) == set(open_rank(out3, 0).load_replicated())


def test_v1_directory_validates_with_a_warning_not_as_verified(v1_out, checkpoint_cache):
    report = validate(v1_out, source=checkpoint_cache("llama", layers=4))
    assert report.ok, report.messages
    assert report.format_version == 1
    assert [w.code for w in report.warnings] == ["unverified_replicated_files"]
    assert report.checked["target_tensors_compared"] > 0


def test_v1_rank_file_corruption_is_still_caught(v1_out):
    m = load_manifest(v1_out)
    path = v1_out / m.rank_files[1]
    data = bytearray(path.read_bytes())
    data[m.layers[0].file_offset + 1] ^= 1
    path.write_bytes(bytes(data))
    assert [p.code for p in validate(v1_out).problems] == ["checksum_mismatch"]
