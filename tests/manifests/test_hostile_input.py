"""Hostile input: whatever is on disk, one line, the right exit code, a ShardprepError, never a traceback.

The contract, for every file shardprep reads (manifest, index files, safetensors headers, config.json,
presets): the Python API raises a ShardprepError subclass or succeeds; `validate` reports problems
(exit 1) rather than raising; `convert` exits 2 with one line. Property-based tests mutate real files
at random; the named cases below are the ones a fuzzer might take long to find.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.errors import ManifestError, ShardprepError
from shardprep.loader import open_rank
from shardprep.manifests import Manifest, load_manifest
from shardprep.manifests.manifest import MAX_MANIFEST_BYTES, seal
from shardprep.manifests.paths import is_safe_relpath
from shardprep.manifests.safetensors_header import read_safetensors_header
from shardprep.prep.convert import convert
from shardprep.prep.selection import load_preset
from shardprep.prep.validate import ValidationReport, validate

runner = CliRunner()
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])

# Values a hostile file puts where something else belongs: wrong types, floats and bools where integers
# belong, integers too large for anything, strings with NUL bytes, lone surrogates and path tricks.
SPECIAL = st.sampled_from([
    None, True, False, 0, -1, 1.0, 2.5, float("1e308"), 10**23, -(10**23), 2**64, "", ".", "..", "/etc/passwd",
    "a\x00b", "\ud800", "../x.safetensors", "C:x", "shards/../x", [], {}, [[[]]], {"a": None}, "F8_E4M3",
])
LEAF = st.one_of(SPECIAL, st.integers(), st.floats(allow_nan=False), st.text(max_size=20), st.booleans(), st.none())
JSON_VALUE = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=8)


def paths_of(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a node of a JSON document."""
    out = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += paths_of(v, (*prefix, i))
    return out


def fresh_value(draw: st.DrawFn) -> Any:
    """A JSON_VALUE that no other node shares. sampled_from hands out the same SPECIAL objects (`{}`, `[[[]]]`)
    every time: put into the document and then given a key by a later mutation, one would change every later
    draw, or hold itself (seen: a dict added into itself, RecursionError in paths_of, and a flaky replay)."""
    return copy.deepcopy(draw(JSON_VALUE))


@st.composite
def mutated(draw: st.DrawFn, original: Any) -> Any:
    """`original` with one to three nodes replaced, deleted, or given an extra key."""
    data = json.loads(json.dumps(original))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths_of(data)))
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if not path:
            if action == "replace":
                data = fresh_value(draw)
            continue
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        if action == "replace":
            parent[path[-1]] = fresh_value(draw)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent[path[-1]], dict):
            parent[path[-1]][draw(st.text(max_size=8))] = fresh_value(draw)
    return data


@st.composite
def corrupted_text(draw: st.DrawFn, text: bytes) -> bytes:
    """Raw byte damage: a flipped byte, a cut, or inserted bytes."""
    data = bytearray(text)
    at = draw(st.integers(0, max(0, len(data) - 1)))
    action = draw(st.sampled_from(["flip", "cut", "insert"]))
    if action == "flip" and data:
        data[at] ^= draw(st.integers(1, 255))
    elif action == "cut":
        del data[at:]
    else:
        data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@pytest.fixture(scope="module")
def pristine(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("llama", sharded=True)
    return src, conversion_cache(src, 2, preset="llama", copy_mode="copy")


@pytest.fixture
def out(pristine, tmp_path):
    return shutil.copytree(pristine[1], tmp_path / "out")


@pytest.fixture
def src(pristine, tmp_path):
    return shutil.copytree(pristine[0], tmp_path / "src")


def check_output_contract(out: Path) -> ValidationReport:
    """Readers of OUT: a ShardprepError or success; validate never raises for a damaged OUT."""
    try:
        load_manifest(out)
    except ManifestError as exc:
        assert "\n" not in str(exc)
    report = validate(out)
    assert all("\n" not in p.message for p in report.problems)
    try:
        shards = open_rank(out, 0)
        shards.load_replicated()
    except ShardprepError as exc:
        assert "\n" not in str(exc)
    return report


def check_convert_contract(src: Path, tmp: Path) -> None:
    try:
        convert(src, tmp / "never", 2, preset="llama", dry_run=True)
    except ShardprepError as exc:
        assert "\n" not in str(exc)


# -- property-based ------------------------------------------------------------------------------


@FAST
@given(data=st.data())
def test_any_mutation_of_the_manifest_is_refused_or_reported(pristine, out, data):
    # Originals come from the untouched output: each example damages one file of the copy afresh.
    original = json.loads((pristine[1] / "shard_manifest.json").read_text())
    doc = data.draw(mutated(original))
    sealed = isinstance(doc, dict) and isinstance(doc.get("manifest_xxh3_128"), str) and data.draw(st.booleans())
    if sealed:  # as if the edit were made by someone who re-seals it: every layout rule must still hold
        doc["manifest_xxh3_128"] = "0" * 32
        (out / "shard_manifest.json").write_text(seal(json.dumps(doc, indent=1)))
    else:
        (out / "shard_manifest.json").write_text(json.dumps(doc))
    report = check_output_contract(out)
    if not sealed and doc != original:
        assert not report.ok  # the manifest's checksum of itself
    if report.ok:
        # A sealed edit may stay valid (provenance is free text, unknown keys are ignored), but then it
        # must put every byte where the original did, with the same checksums.
        m, before = load_manifest(out), Manifest.from_dict(original)
        assert (m.world_size, m.rank_files, byte_layout(m), m.replicated_files, m.replicated_index) == (
            before.world_size, before.rank_files, byte_layout(before), before.replicated_files,
            before.replicated_index)


def byte_layout(m: Manifest) -> list[tuple]:
    return [(r.layer, r.file_offset, r.chunk_bytes, r.total_bytes, r.checksums) for r in m.layers]


@FAST
@given(data=st.data())
def test_any_byte_damage_to_the_manifest_is_refused_or_reported(pristine, out, data):
    text = (pristine[1] / "shard_manifest.json").read_bytes()
    (out / "shard_manifest.json").write_bytes(data.draw(corrupted_text(text)))
    check_output_contract(out)


@FAST
@given(data=st.data())
def test_any_mutation_of_the_output_index_is_reported(pristine, out, data):
    path = out / "model.safetensors.index.json"
    original = json.loads((pristine[1] / "model.safetensors.index.json").read_text())
    doc = data.draw(mutated(original))
    path.write_text(json.dumps(doc))
    report = check_output_contract(out)
    if doc != original:
        assert not report.ok  # the index's checksum is in the manifest


@FAST
@given(data=st.data())
def test_any_mutation_of_a_safetensors_header_is_refused_or_harmless(pristine, src, tmp_path, data):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = sorted(set(index["weight_map"].values()))[data.draw(st.integers(0, 3))]
    victim = src / name
    raw = (pristine[0] / name).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    doc = data.draw(mutated(header))
    text = json.dumps(doc).encode()
    victim.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    try:
        read_safetensors_header(victim)
    except ShardprepError as exc:
        assert "\n" not in str(exc)
    check_convert_contract(src, tmp_path)


@FAST
@given(data=st.data())
def test_any_byte_damage_to_a_safetensors_file_start_is_refused_or_harmless(pristine, src, tmp_path, data):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = sorted(set(index["weight_map"].values()))[0]
    victim = src / name
    raw = (pristine[0] / name).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    victim.write_bytes(data.draw(corrupted_text(raw[:8 + n])) + raw[8 + n:])
    check_convert_contract(src, tmp_path)


@FAST
@given(data=st.data())
def test_any_mutation_of_source_index_or_config_is_refused(pristine, src, tmp_path, data):
    name = data.draw(st.sampled_from(["model.safetensors.index.json", "config.json"]))
    original = json.loads((pristine[0] / name).read_text())
    for other in ("model.safetensors.index.json", "config.json"):
        shutil.copyfile(pristine[0] / other, src / other)
    (src / name).write_text(json.dumps(data.draw(mutated(original))))
    check_convert_contract(src, tmp_path)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=JSON_VALUE)
def test_any_preset_file_is_loaded_or_refused_with_a_selection_error(tmp_path, doc):
    path = tmp_path / "preset.json"
    path.write_text(json.dumps(doc))
    try:
        load_preset(str(path))
    except ShardprepError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=200, deadline=None)
@given(p=st.one_of(st.text(max_size=12), SPECIAL))
def test_is_safe_relpath_answers_for_anything(p):
    ok = is_safe_relpath(p)
    if ok:
        assert isinstance(p, str) and not p.startswith("/") and ".." not in p.split("/") and "\x00" not in p


# -- named cases ---------------------------------------------------------------------------------


HOSTILE_MANIFESTS = {
    "5000-digit integer": lambda text: text.replace(b'"world_size": 2', b'"world_size": 1' + b"0" * 5000),
    "30000-deep nesting": lambda text: text.replace(b'"created_by"', b'"deep": ' + b"[" * 30000 + b"]" * 30000
                                                    + b', "created_by"'),
    "invalid UTF-8": lambda text: text.replace(b"shardprep", b"shard\xff\xfeprep", 1),
    "NUL byte in a path": lambda text: text.replace(b'"shards/rank-00000', b'"shards/\\u0000rank-00000'),
    "lone surrogate in a path": lambda text: text.replace(b'"shards/rank-00000', b'"shards/\\ud800rank-00000'),
    "float for an integer": lambda text: text.replace(b'"world_size": 2', b'"world_size": 2.0'),
    "bool for an integer": lambda text: text.replace(b'"world_size": 2', b'"world_size": true'),
    "NaN": lambda text: text.replace(b'"world_size": 2', b'"world_size": NaN'),
    "duplicate key": lambda text: text.replace(b'"world_size": 2', b'"world_size": 2, "world_size": 3'),
    "not an object": lambda text: b"[1, 2, 3]",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFESTS))
def test_hostile_manifest_is_one_line_everywhere(out, case):
    path = out / "shard_manifest.json"
    text = path.read_bytes()
    damaged = HOSTILE_MANIFESTS[case](text)
    assert damaged != text
    path.write_bytes(damaged)
    with pytest.raises(ManifestError) as exc:
        load_manifest(out)
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 600
    with pytest.raises(ShardprepError):
        open_rank(out, 0)
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1, result.output
    assert result.stderr.startswith("invalid: ") and "Traceback" not in result.output
    result = runner.invoke(app, ["inspect", str(out)])
    assert result.exit_code == 2 and result.stderr.startswith("error: "), result.output


def test_a_1gib_manifest_is_refused_unread(out):
    path = out / "shard_manifest.json"
    with open(path, "r+b") as f:
        f.truncate(1 << 30)  # sparse: costs no disk
    with pytest.raises(ManifestError, match=f"more than a manifest may be \\({MAX_MANIFEST_BYTES}\\)"):
        load_manifest(out)
    report = validate(out)
    assert [p.code for p in report.problems] == ["manifest_unreadable"]


HOSTILE_SOURCES = {
    "config.json is a list": ("config.json", lambda text: b"[]", "not a JSON object"),
    "quantization_config is a number": ("config.json",
                                        lambda text: text.replace(b"{", b'{"quantization_config": 5,', 1),
                                        "quantization_config is a int"),
    "index weight_map of numbers": ("model.safetensors.index.json",
                                    lambda text: b'{"weight_map": {"a": 1}}', "needs a 'weight_map'"),
    "index shard path with NUL": ("model.safetensors.index.json",
                                  lambda text: b'{"weight_map": {"a": "x\\u0000.safetensors"}}', "outside the model"),
    "index shard path absolute": ("model.safetensors.index.json",
                                  lambda text: b'{"weight_map": {"a": "/etc/passwd"}}', "outside the model"),
    "index 30000-deep": ("model.safetensors.index.json", lambda text: b"[" * 30000, "nested more than 64"),
    "index invalid UTF-8": ("model.safetensors.index.json", lambda text: b'{"\xff": 1}', "not valid UTF-8"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_SOURCES))
def test_hostile_source_file_makes_convert_exit_2_with_one_line(src, tmp_path, case):
    name, damage, fragment = HOSTILE_SOURCES[case]
    (src / name).write_bytes(damage((src / name).read_bytes()))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--ranks", "2", "--preset", "llama"])
    lines = result.stderr.splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert fragment in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("header,fragment", [
    (b'{"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}', "invalid shape"),
    (b'{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', "invalid shape"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}', "invalid data_offsets"),
    (b'{"a": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}}', "unsupported dtype"),
    (b'{"__metadata__": {"format": 1}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
     "__metadata__ must map strings to strings"),
    (b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}', "leaves a hole"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', "'a' has data_offsets .4, 8. past the end"),
    (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}', "not JSON"),
    (b'{"a": ' + b"[" * 30000 + b"]" * 30000 + b"}", "not JSON"),
])
def test_hostile_safetensors_header_is_one_error_naming_the_file(tmp_path, header, fragment):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(ShardprepError, match=fragment) as exc:
        read_safetensors_header(path)
    assert str(exc.value).startswith(str(path)) and "\n" not in str(exc.value)


def move_past_the_end(path: Path) -> str:
    """Shift the data_offsets of a middle tensor of a source safetensors file past the file's end (its dtype and
    shape kept), which also leaves a hole where it was; returns its name."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    name = tensors[len(tensors) // 2]
    begin, end = header[name]["data_offsets"]
    data_size = len(raw) - 8 - n
    header[name]["data_offsets"] = [data_size, data_size + end - begin]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))  # the same header length, so every other offset stays valid
    assert len(text) == n
    path.write_bytes(raw[:8] + text + raw[8 + n:])
    return name


def test_a_tensor_past_the_end_of_its_file_is_named_not_its_neighbour(src, tmp_path):
    path = sorted(src.glob("model-*.safetensors"))[0]
    name = move_past_the_end(path)
    with pytest.raises(ShardprepError, match="past the end of the file") as exc:
        read_safetensors_header(path)
    assert str(exc.value).startswith(f"{path}: truncated file or corrupt header: tensor '{name}' has data_offsets [")
    assert "hole" not in str(exc.value)
    assert exc.value.tensor == name
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--ranks", "2", "--preset", "llama"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert f"tensor '{name}' has data_offsets [" in result.stderr and "hole" not in result.stderr


def test_hostile_preset_file_is_a_selection_error(tmp_path):
    path = tmp_path / "p.json"
    for doc in ({"targets": "x"}, {"targets": [1]}, {"targets": ["*"], "fused": [{"name": "f", "members": "ab"}]},
                [], {"targets": ["*"], "name": 3}):
        path.write_text(json.dumps(doc))
        with pytest.raises(ShardprepError, match="not a valid preset"):
            load_preset(str(path))


def test_is_safe_relpath_of_dot_is_false_not_an_index_error():
    assert not is_safe_relpath(".") and not is_safe_relpath("") and not is_safe_relpath("a/./b")
    assert not is_safe_relpath(None) and not is_safe_relpath(7)


def test_convert_refuses_an_output_directory_as_its_source(pristine, tmp_path):
    _, out = pristine
    result = runner.invoke(app, ["convert", str(out), str(tmp_path / "again"), "--ranks", "2", "--preset", "llama"])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.output
    assert os.path.basename(str(out)) in result.stderr
