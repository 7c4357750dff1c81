"""Bad input: one line naming the file or tensor, exit code 2, no traceback, nothing written."""

import json
import os
import shutil
import struct
import subprocess

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from shardprep.cli import app

runner = CliRunner()


def run_cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_failure(result, fragment, out_parent):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output
    leftovers = [p.name for p in out_parent.iterdir() if p.name.startswith(".out")]
    assert not leftovers and not (out_parent / "out").exists()


@pytest.fixture
def llama_copy(checkpoint_cache, tmp_path):
    """A private copy of a sharded tiny llama that a test may damage."""
    src = tmp_path / "src"
    shutil.copytree(checkpoint_cache("llama", sharded=True), src)
    return src


def first_shard(src):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return src / sorted(set(index["weight_map"].values()))[0]


def test_missing_source_directory(tmp_path):
    result = run_cli("convert", tmp_path / "nope", tmp_path / "out", "--ranks", 2, "--preset", "llama")
    assert_clean_failure(result, "nope: no such directory", tmp_path)


def test_index_naming_a_missing_shard(llama_copy, tmp_path):
    victim = first_shard(llama_copy)
    victim.unlink()
    result = run_cli("convert", llama_copy, tmp_path / "out", "--ranks", 2, "--preset", "llama")
    assert_clean_failure(result, f"names shard '{victim.name}', which is missing", tmp_path)


def test_truncated_safetensors_file(llama_copy, tmp_path):
    victim = first_shard(llama_copy)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    result = run_cli("convert", llama_copy, tmp_path / "out", "--ranks", 2, "--preset", "llama")
    assert_clean_failure(result, f"{victim}: truncated file", tmp_path)


def test_corrupt_safetensors_header(llama_copy, tmp_path):
    victim = first_shard(llama_copy)
    data = bytearray(victim.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    victim.write_bytes(bytes(data))
    result = run_cli("convert", llama_copy, tmp_path / "out", "--ranks", 2, "--preset", "llama")
    assert_clean_failure(result, f"{victim}: corrupt safetensors header", tmp_path)


def test_header_length_past_end_of_file(llama_copy, tmp_path):
    victim = first_shard(llama_copy)
    data = bytearray(victim.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    victim.write_bytes(bytes(data))
    result = run_cli("convert", llama_copy, tmp_path / "out", "--ranks", 2, "--preset", "llama")
    assert_clean_failure(result, "corrupt or truncated safetensors header", tmp_path)


def test_unsupported_dtype(llama_copy, tmp_path):
    victim = first_shard(llama_copy)
    data = victim.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "Q4_K"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    victim.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    result = run_cli("convert", llama_copy, tmp_path / "out", "--ranks", 2, "--preset", "llama")
    assert_clean_failure(result, "unsupported dtype 'Q4_K'", tmp_path)
    assert name in result.stderr


@pytest.mark.parametrize("ranks", [0, -3])
def test_ranks_below_one(checkpoint_cache, tmp_path, ranks):
    result = run_cli("convert", checkpoint_cache("llama"), tmp_path / "out", "--ranks", ranks, "--preset", "llama")
    assert_clean_failure(result, "--ranks must be >= 1", tmp_path)


def test_glob_matching_nothing(checkpoint_cache, tmp_path):
    result = run_cli("convert", checkpoint_cache("llama"), tmp_path / "out", "--ranks", 2,
                     "--target", "*.no_such_proj.weight")
    assert_clean_failure(result, "'*.no_such_proj.weight' matches no tensor", tmp_path)


def test_fused_members_with_incompatible_shapes(checkpoint_cache, tmp_path):
    preset = tmp_path / "bad-preset.json"
    preset.write_text(json.dumps({
        "targets": ["*.self_attn.q_proj.weight", "*.mlp.down_proj.weight"],
        "fused": [{"name": "qdown.weight", "members": ["self_attn.q_proj.weight", "mlp.down_proj.weight"]}],
    }))
    # q_proj ends with "self_attn.q_proj.weight"; its sibling "mlp.down_proj.weight" is not, so no group forms.
    # A suffix rule whose members share a prefix but not a shape is the real failure:
    preset.write_text(json.dumps({
        "targets": ["*.mlp.up_proj.weight", "*.mlp.down_proj.weight"],
        "fused": [{"name": "mlp.updown.weight", "members": ["mlp.up_proj.weight", "mlp.down_proj.weight"]}],
    }))
    result = run_cli("convert", checkpoint_cache("llama"), tmp_path / "out", "--ranks", 2, "--preset", preset)
    assert_clean_failure(result, "cannot be concatenated on dim 0", tmp_path)


def test_fused_members_with_different_dtypes(llama_copy, tmp_path):
    index = json.loads((llama_copy / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.k_proj.weight"
    path = llama_copy / index["weight_map"][name]
    tensors = load_file(path)
    tensors[name] = tensors[name].float()
    save_file(tensors, path, metadata={"format": "pt"})
    result = run_cli("convert", llama_copy, tmp_path / "out", "--ranks", 2, "--preset", "llama")
    assert_clean_failure(result, f"member '{name}' is F32", tmp_path)


def test_output_inside_source(llama_copy, tmp_path):
    result = run_cli("convert", llama_copy, llama_copy / "out", "--ranks", 2, "--preset", "llama")
    assert result.exit_code == 2 and "inside the source" in result.stderr
    assert not (llama_copy / "out").exists()


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody, root included, can create entries in (chmod, or chattr +i as root)."""
    parent = tmp_path / "ro"
    parent.mkdir()
    if os.geteuid() != 0:
        parent.chmod(0o555)
        yield parent
        parent.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(parent)]).returncode != 0:
        pytest.skip("running as root on a filesystem without immutable directories")
    try:
        yield parent
    finally:
        subprocess.run(["chattr", "-i", str(parent)], check=True)


def test_no_write_permission(checkpoint_cache, read_only_dir):
    result = run_cli("convert", checkpoint_cache("llama"), read_only_dir / "out", "--ranks", 2, "--preset", "llama")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and "no write permission" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert list(read_only_dir.iterdir()) == []


def test_debug_flag_shows_the_traceback(tmp_path):
    result = run_cli("--debug", "convert", tmp_path / "nope", tmp_path / "out", "--ranks", 2, "--preset", "llama")
    assert result.exit_code != 0 and result.exception is not None
    os.environ.pop("SHARDPREP_DEBUG", None)
