"""validate finds every kind of damage, names it, and exits 0 / 1 / 2."""

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.manifests.manifest import seal
from shardprep.prep.convert import convert
from shardprep.prep.validate import validate

runner = CliRunner()


@pytest.fixture
def converted(checkpoint_cache, tmp_path):
    src = checkpoint_cache("deepseek-v3", sharded=True)
    out = tmp_path / "out"
    convert(src, out, 3, preset="deepseek-v3")
    return src, out


def manifest(out):
    return json.loads((out / "shard_manifest.json").read_text())


def write_manifest(out, data):
    """A deliberate edit, sealed as convert seals a manifest, so only the edit itself is under test."""
    (out / "shard_manifest.json").write_text(seal(json.dumps(data, indent=1)))


def test_fresh_output_is_valid_with_and_without_source(converted):
    src, out = converted
    assert validate(out).ok
    report = validate(out, source=src)
    assert report.ok and report.checked["target_tensors_compared"] > 0
    result = runner.invoke(app, ["validate", str(out), "--source", str(src), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True


def test_flipped_byte_in_a_rank_file_fails_checksum(converted):
    _, out = converted
    m = manifest(out)
    path = out / m["rank_files"][1]
    data = bytearray(path.read_bytes())
    data[m["layers"][1]["file_offset"] + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    report = validate(out)
    assert not report.ok and any("layer 2 chunk checksum mismatch" in p for p in report.messages)
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 1 and "checksum mismatch" in result.stderr


def test_nonzero_padding_is_found_even_with_a_matching_checksum(converted):
    _, out = converted
    m = manifest(out)
    layer = m["layers"][0]
    n = m["world_size"]
    last_rank = n - 1
    path = out / m["rank_files"][last_rank]
    data = bytearray(path.read_bytes())
    data[layer["file_offset"] + layer["chunk_bytes"] - 1] = 7  # tail of T belongs to the last rank
    path.write_bytes(bytes(data))
    import xxhash

    chunk = bytes(data[layer["file_offset"]:layer["file_offset"] + layer["chunk_bytes"]])
    layer["checksums"][last_rank] = xxhash.xxh3_128_hexdigest(chunk)
    write_manifest(out, m)
    problems = validate(out).messages
    assert any("padding bytes" in p and "are not zero" in p for p in problems), problems


def test_wrong_size_and_missing_rank_file(converted):
    _, out = converted
    m = manifest(out)
    with open(out / m["rank_files"][0], "ab") as f:
        f.write(b"x")
    os.remove(out / m["rank_files"][2])
    problems = validate(out).messages
    assert any("size is" in p for p in problems) and any("rank 2 file is missing" in p for p in problems)


def test_paths_leaving_the_directory_are_refused(converted):
    _, out = converted
    m = manifest(out)
    m["rank_files"][0] = "../outside.bin"
    write_manifest(out, m)
    report = validate(out)
    assert not report.ok and "schema violation" in report.messages[0]


def test_symlink_escaping_the_directory_is_refused(converted, tmp_path):
    _, out = converted
    m = manifest(out)
    target = out / m["rank_files"][0]
    outside = tmp_path / "elsewhere.bin"
    shutil.move(target, outside)
    os.symlink(outside, target)
    assert any("leaves the output directory" in p for p in validate(out).messages)


def test_source_tensor_missing_from_output_is_reported(converted):
    src, out = converted
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = "model.embed_tokens.weight"
    del index["weight_map"][dropped]
    index_path.write_text(json.dumps(index))
    problems = validate(out, source=src).messages
    assert any(f"source tensor '{dropped}' is neither a target nor in" in p for p in problems)


def test_target_bytes_that_differ_from_source_are_reported(converted, checkpoint_cache, tmp_path):
    _, out = converted
    other = checkpoint_cache("deepseek-v3", sharded=True, seed=1)
    problems = validate(out, source=other).messages
    assert any("bytes rebuilt from the rank files differ from the source" in p for p in problems)


def test_a_directory_without_a_manifest_cannot_run_and_a_checkpoint_is_told_to_convert_first(converted):
    src, out = converted
    os.remove(out / "shard_manifest.json")
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 2, result.output  # 2: could not run (it is not an output); 1 is for invalid ones
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {out}: no shard_manifest.json")
    for args in (["validate", str(src)], ["validate", "--manifest-only", str(src)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == (
            f"error: {src}: no shard_manifest.json: a checkpoint, not an output of `shardprep convert`; convert it "
            f"first (`shardprep convert {src} OUT --ranks N --preset deepseek-v3`) and validate OUT")


def test_a_wrong_source_ends_with_a_summary_naming_the_recorded_source(converted, checkpoint_cache):
    src, out = converted
    other = checkpoint_cache("qwen3-moe")  # another model: nearly every tensor differs
    result = runner.invoke(app, ["validate", str(out), "--source", str(other)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    problems = validate(out, source=other).problem_count
    assert problems > 20 and len(lines) == 21, lines  # 20 problems shown, then one summary line
    assert all(line.startswith("invalid: ") for line in lines)
    assert lines[-1].startswith(f"invalid: {out}: {problems} problems (")
    assert lines[-1].endswith(f"; --source {other} is not the source the manifest records ({src}): was --source "
                              "the wrong checkpoint?")
    # The recorded source itself, at another path (a copy), validates with a warning naming the recorded one.
    report = json.loads(runner.invoke(app, ["validate", str(out), "--source", str(src), "--json"]).stdout)
    assert report["ok"] and report["warnings"] == []


def test_progress_follows_the_bytes_read_to_the_end(converted):
    src, out = converted
    for source in (None, src):
        calls: list[tuple[int, int]] = []

        def follow(done: int, total: int, calls: list = calls) -> None:
            calls.append((done, total))

        assert validate(out, source=source, progress=follow).ok
        assert calls and all(b[0] >= a[0] for a, b in zip(calls, calls[1:]))
        done, total = calls[-1]
        assert done == total > 0, calls[-3:]


def test_missing_directory_cannot_run(tmp_path):
    result = runner.invoke(app, ["validate", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ")


def test_inspect_totals_follow_the_formula(converted):
    _, out = converted
    result = runner.invoke(app, ["inspect", str(out), "--json"])
    assert result.exit_code == 0
    info = json.loads(result.stdout)
    m = manifest(out)
    n = m["world_size"]
    total = sum(lay["total_bytes"] for lay in m["layers"])
    biggest = max(lay["total_bytes"] for lay in m["layers"])
    t = info["totals"]
    assert t["sharded_bytes"] == total
    assert t["resident_bytes"] == total // n + 2 * biggest
    assert t["gather_recv_bytes_per_forward"] == total - total // n
    assert t["non_target_bytes"] > 0
    table = runner.invoke(app, ["inspect", str(out)])
    assert table.exit_code == 0 and "memory saved per rank" in table.stdout


def test_a_missing_index_is_one_problem_and_a_corrupt_one_is_still_read(converted):
    _, out = converted
    index = out / "model.safetensors.index.json"
    text = index.read_text()
    index.unlink()
    assert [p.code for p in validate(out).problems] == ["missing_file"]
    # The same length, other bytes: the checksum fails, and the index is still parsed for what it maps wrongly.
    data = json.loads(text)
    name = next(t for t, f in data["weight_map"].items() if f.startswith("model-"))
    data["weight_map"][name] = "model-99999-of-99999.safetensors"
    edited = json.dumps(data, indent=2) + "\n"
    index.write_text(edited)
    problems = validate(out).problems
    assert {"checksum_mismatch", "missing_file"} <= {p.code for p in problems}, problems
    assert any("model-99999-of-99999.safetensors" in p.message for p in problems)
