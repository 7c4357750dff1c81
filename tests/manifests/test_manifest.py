"""The manifest is validated once, when parsed: schema, version, and every layout invariant."""

import copy
import json
import os

import jsonschema
import pytest

from shardprep.errors import ManifestError
from shardprep.manifests import (
    FileRecord,
    FusedGroup,
    LayerRecord,
    Manifest,
    TensorSpec,
    plan_layer,
    plan_rank_file,
    rank_file_name,
)
from shardprep.manifests.manifest import manifest_schema


def small_manifest(world_size=2) -> dict:
    """A valid format-2 manifest of two layers (checksums are placeholders: no files are read here)."""
    layouts = [
        plan_layer(i, [TensorSpec(f"m.layers.{i}.w", "BF16", (5, 3)), TensorSpec(f"m.layers.{i}.b", "F32", (3,))],
                   world_size)
        for i in (1, 2)
    ]
    offsets, _ = plan_rank_file([(lay.layer, lay.chunk_bytes) for lay in layouts], world_size, 4096)
    records = tuple(LayerRecord.from_layout(lay, off, ("0" * 32,) * world_size) for lay, off in zip(layouts, offsets))
    m = Manifest(world_size, tuple(rank_file_name(r, world_size) for r in range(world_size)), records,
                 source={"path": "/models/m", "repo_id": None, "revision": None, "commit": None, "files": []},
                 replicated_files=(FileRecord("model.safetensors.index.json", 10, "1" * 32),),
                 selection={"preset": None, "preset_targets": [], "targets": ["*"], "layers": "1-",
                            "layer_pattern": "x"},
                 requant_options={"mode": "auto", "scope": "all", "recipe": "sglang", "scale_format": "f32",
                                  "allow_nonfinite": False})
    return m.to_dict()


def test_round_trip_and_schema_files_are_valid_json_schema():
    data = small_manifest()
    jsonschema.Draft202012Validator.check_schema(manifest_schema())
    jsonschema.Draft202012Validator.check_schema(manifest_schema(1))
    assert Manifest.from_dict(json.loads(json.dumps(data))).to_dict() == data


def test_unknown_keys_are_ignored_within_the_major_version():
    data = small_manifest()
    data["added_in_2_1"] = {"anything": [1, 2]}
    data["layers"][0]["future_field"] = "x"
    data["layers"][0]["entries"][0]["hint"] = 3
    m = Manifest.from_dict(data)
    assert m.layers[0].entries[0].name == data["layers"][0]["entries"][0]["name"]


def mutate(path, value):
    data = small_manifest()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    "path,value,message",
    [
        (("version",), 3, "version 3 is not supported"),
        (("version",), 2.0, "version 2.0 is not supported"),
        (("world_size",), 2.0, "schema violation"),
        (("world_size",), True, "schema violation"),
        (("layers", 0, "checksums"), [], "schema violation"),
        (("chunk_alignment",), 24, "not a power of two"),
        (("file_alignment",), 8192, "max\\(4096, chunk_alignment\\)"),
        (("rank_files", 0), "shards/rank-00000-of-00002.bin", "not 'shards/rank-00000-of-00002.safetensors'"),
        (("rank_files", 0), "shards/./x", "schema violation"),
        (("replicated_files",), [], "schema violation"),
        (("format",), "other", "schema violation"),
        (("entry_alignment",), 8, "schema violation"),
        (("rank_files", 0), "/etc/passwd", "schema violation"),
        (("rank_files", 1), "shards/../../x.bin", "schema violation"),
        (("layers", 0, "entries", 0, "offset"), 8, "not 16-aligned"),
        (("layers", 0, "entries", 1, "offset"), 0, "overlaps"),
        (("layers", 0, "entries", 0, "nbytes"), 31, "does not match"),
        (("layers", 1, "file_offset"), 100, "not 4096-aligned"),
        (("layers", 0, "chunk_bytes"), 16, "!= total_bytes"),
        (("layers", 0, "total_bytes"), 40, "multiple of 16"),
        (("layers", 0, "checksums"), ["0" * 32], "checksums for 2 ranks"),
        (("world_size",), 3, "rank_files lists 2"),
        (("layers", 0, "entries", 0, "dtype"), "Q4", "schema violation"),
    ],
)
def test_broken_manifest_is_refused_with_a_named_problem(path, value, message):
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict(mutate(path, value))


def test_overlapping_layers_in_file_are_refused():
    data = small_manifest()
    data["layers"][1]["file_offset"] = 0
    with pytest.raises(ManifestError, match="overlaps the previous layer"):
        Manifest.from_dict(data)


def test_fused_view_must_cover_members_contiguously():
    data = small_manifest()
    layer = data["layers"][0]
    names = [e["name"] for e in layer["entries"]]
    layer["views"] = [{"name": "fused", "dtype": "BF16", "shape": [8, 3], "offset": 0, "members": names}]
    with pytest.raises(ManifestError, match="fused view 'fused'"):
        Manifest.from_dict(copy.deepcopy(data))


def test_a_manifest_read_again_is_the_same_and_any_changed_byte_is_checked_again(tmp_path, monkeypatch):
    from shardprep.manifests import load_manifest
    from shardprep.manifests import manifest as manifest_module
    from shardprep.prep.output.writer import write_manifest

    write_manifest(tmp_path, Manifest.from_dict(small_manifest()))
    first = load_manifest(tmp_path)
    first.source["path"] = "changed by a caller"  # a caller's copy: the next read must not see it
    parsed = []
    real = manifest_module.parse_json
    monkeypatch.setattr(manifest_module, "parse_json", lambda *a, **k: parsed.append(1) or real(*a, **k))
    again = load_manifest(tmp_path)
    assert again == Manifest.from_dict(small_manifest()) and again.source["path"] == "/models/m"
    assert parsed == []  # the same bytes: not parsed again
    path = tmp_path / "shard_manifest.json"
    stat = path.stat()
    path.write_bytes(path.read_bytes().replace(b'"world_size": 2', b'"world_size": 3'))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same time: only the bytes differ
    with pytest.raises(ManifestError):
        load_manifest(tmp_path)
    assert parsed == [1]


def padded_view_manifest() -> dict:
    """small_manifest with layer 1 holding two members fused into a view with 3 zero pad rows, then a third tensor."""
    data = small_manifest()
    lay = plan_layer(1, [TensorSpec("m.layers.1.a", "BF16", (3, 8)), TensorSpec("m.layers.1.b", "BF16", (2, 8)),
                         TensorSpec("m.layers.1.c", "BF16", (1, 8))], 2,
                     groups=[FusedGroup("m.layers.1.ab", ("m.layers.1.a", "m.layers.1.b"), row_multiple=4)])
    record = LayerRecord.from_layout(lay, data["layers"][0]["file_offset"], ("0" * 32,) * 2)
    data["layers"][0] = Manifest.from_dict(data).to_dict()["layers"][0] | {
        "chunk_bytes": record.chunk_bytes, "total_bytes": record.total_bytes,
        "entries": [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes}
                    for e in record.entries],
        "views": [{"name": v.name, "dtype": v.dtype, "shape": list(v.shape), "offset": v.offset,
                   "members": list(v.members), "pad_rows": v.pad_rows} for v in record.views]}
    return data


def test_a_view_with_pad_rows_round_trips_and_a_view_without_writes_no_pad_rows_key():
    data = padded_view_manifest()
    m = Manifest.from_dict(copy.deepcopy(data))
    assert m.layers[0].views[0].pad_rows == 3 and m.to_dict() == data
    jsonschema.validate(data, manifest_schema())
    assert all("pad_rows" not in v for r in small_manifest()["layers"] for v in r["views"])


@pytest.mark.parametrize("pad_rows, message", [
    (2, r"has shape \[8, 8\] but its members have 5 rows and 2 pad rows"),
    (4, r"has shape \[8, 8\] but its members have 5 rows and 4 pad rows"),
])
def test_pad_rows_that_do_not_make_up_the_view_are_refused(pad_rows, message):
    data = padded_view_manifest()
    data["layers"][0]["views"][0]["pad_rows"] = pad_rows
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict(data)


def test_pad_rows_overlapping_a_tensor_are_refused_naming_it():
    data = padded_view_manifest()
    c = data["layers"][0]["entries"][2]
    assert c["name"] == "m.layers.1.c"
    c["offset"] = 80  # inside the view's pad rows [80, 128)
    with pytest.raises(ManifestError, match="pad rows overlap tensor 'm.layers.1.c'"):
        Manifest.from_dict(data)


@pytest.mark.parametrize("value", [0, -1, "3", 1.5, True])
def test_a_pad_rows_value_that_is_not_a_positive_integer_is_refused(value):
    data = padded_view_manifest()
    data["layers"][0]["views"][0]["pad_rows"] = value
    with pytest.raises(ManifestError):
        Manifest.from_dict(data)
