"""convert end to end on checkpoints written by transformers' save_pretrained."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from support.checkpoints import read_state_dict
from support.reconstruct import rebuild_layers

from shardprep.errors import OutputError
from shardprep.manifests.replicated import NOTICE_FILE, SHARDED_SENTINEL
from shardprep.prep.convert import convert
from shardprep.prep.validate import validate


def read_replicated_part(out) -> dict[str, torch.Tensor]:
    """Every real file the output's index names, read by the safetensors library itself (not shardprep)."""
    from safetensors.torch import load_file

    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values()) - {SHARDED_SENTINEL, NOTICE_FILE}):
        tensors.update(load_file(out / name))
    return tensors


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


@pytest.mark.parametrize(
    "arch,preset,sharded,ranks",
    [
        ("llama", "llama", False, 1),
        ("llama", "llama", True, 3),
        ("qwen3-moe", "qwen3-moe", True, 2),
        ("qwen3-moe", "qwen3-moe", False, 8),
        ("deepseek-v3", "deepseek-v3", True, 8),
        ("deepseek-v3", "deepseek-v3", False, 3),
    ],
)
def test_reconstruction_is_bit_exact(checkpoint_cache, tmp_path, arch, preset, sharded, ranks):
    src = checkpoint_cache(arch, sharded=sharded)
    out = tmp_path / "out"
    summary = convert(src, out, ranks, preset=preset)
    original = read_state_dict(src)
    rebuilt = rebuild_layers(out)
    m = json.loads((out / "shard_manifest.json").read_text())
    assert summary.layers == [1, 2] and m["world_size"] == ranks
    for layer in m["layers"]:
        for e in layer["entries"]:
            assert same_bytes(rebuilt[e["name"]], original[e["name"]]), e["name"]
        for v in layer["views"]:
            fused = torch.cat([original[name] for name in v["members"]])
            assert same_bytes(rebuilt[v["name"]], fused), v["name"]
    # Every non-target tensor is in the replicated part, unchanged, readable by safetensors itself.
    replicated = read_replicated_part(out)
    assert set(replicated) | set(rebuilt) >= set(original)
    assert not set(replicated) & {e["name"] for layer in m["layers"] for e in layer["entries"]}
    for name, t in replicated.items():
        assert same_bytes(t, original[name]), name
    assert validate(out, source=src).ok


def test_rows_not_divisible_by_n_split_mid_tensor(checkpoint_cache, tmp_path):
    # o_proj of this llama is 64×64 bf16 = 8192 bytes; with N = 3 the chunk size is not a multiple of a row.
    src = checkpoint_cache("llama")
    out = tmp_path / "out"
    convert(src, out, 3, targets=["*.self_attn.o_proj.weight"])
    m = json.loads((out / "shard_manifest.json").read_text())
    chunk = m["layers"][0]["chunk_bytes"]
    row = 64 * 2
    assert chunk % row != 0
    rebuilt = rebuild_layers(out)
    assert same_bytes(rebuilt["model.layers.1.self_attn.o_proj.weight"],
                      read_state_dict(src)["model.layers.1.self_attn.o_proj.weight"])


def test_layer_offsets_identical_across_ranks_and_padding_is_zero(checkpoint_cache, tmp_path):
    src = checkpoint_cache("qwen3-moe")
    out = tmp_path / "out"
    convert(src, out, 8, preset="qwen3-moe", layers="all")
    m = json.loads((out / "shard_manifest.json").read_text())
    sizes = {os.path.getsize(out / rel) for rel in m["rank_files"]}
    assert len(sizes) == 1
    last = m["layers"][-1]
    assert sizes == {last["file_offset"] + last["chunk_bytes"]}
    assert [lay["layer"] for lay in m["layers"]] == [0, 1, 2]
    for lay in m["layers"]:
        assert lay["file_offset"] % 4096 == 0
        flat = b"".join((out / rel).read_bytes()[lay["file_offset"]:lay["file_offset"] + lay["chunk_bytes"]]
                        for rel in m["rank_files"])
        end = max(e["offset"] + e["nbytes"] for e in lay["entries"])
        assert flat[end:] == bytes(len(flat) - end)


def test_untouched_files_are_hard_linked_and_other_files_copied(checkpoint_cache, tmp_path):
    src = checkpoint_cache("llama", sharded=True)
    out = tmp_path / "out"
    summary = convert(src, out, 2, preset="llama")
    assert summary.linked_files, "sharded source has files without targets"
    for name in summary.linked_files:
        assert os.path.samefile(out / name, src / name)
    for name in summary.copied_files:
        assert not os.path.samefile(out / name, src / name)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    out2 = tmp_path / "out2"
    summary2 = convert(src, out2, 2, preset="llama", copy_mode="copy")
    assert not summary2.linked_files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for name, fname in index["weight_map"].items():
        if fname == SHARDED_SENTINEL:
            continue
        with safe_open(out / fname, "pt") as f:
            assert name in f.keys()


def test_previous_output_is_refused_then_replaced_with_overwrite(checkpoint_cache, tmp_path):
    src = checkpoint_cache("llama")
    out = tmp_path / "out"
    convert(src, out, 3, preset="llama")
    (out / "keep.txt").write_text("user data")
    with pytest.raises(OutputError, match="not empty"):
        convert(src, out, 2, preset="llama")
    assert (out / "keep.txt").read_text() == "user data"
    convert(src, out, 2, preset="llama", overwrite=True)
    assert not (out / "keep.txt").exists() and json.loads((out / "shard_manifest.json").read_text())["world_size"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "no temporary directories left behind"


def test_interrupted_convert_leaves_nothing_that_validates(checkpoint_cache, tmp_path, monkeypatch):
    import shardprep.prep.output.writer as writer_module

    src = checkpoint_cache("llama", sharded=True)
    out = tmp_path / "out"

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer_module, "_copy_other_files", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, 2, preset="llama")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_previous_output(checkpoint_cache, tmp_path, monkeypatch):
    import shardprep.prep.output.writer as writer_module

    src = checkpoint_cache("llama")
    out = tmp_path / "out"
    convert(src, out, 2, preset="llama")
    before = (out / "shard_manifest.json").read_text()

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module, "pwrite_all", boom)
    with pytest.raises(OutputError):
        convert(src, out, 4, preset="llama", overwrite=True)
    assert (out / "shard_manifest.json").read_text() == before
    assert validate(out).ok
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_bert_encoder_layers_with_target_globs(checkpoint_cache, tmp_path):
    src = checkpoint_cache("bert")
    out = tmp_path / "out"
    summary = convert(src, out, 2, targets=["*.attention.self.*.weight", "*.intermediate.dense.weight"],
                      layers="all")
    assert summary.layers == [0, 1, 2]
    assert validate(out, source=src).ok
