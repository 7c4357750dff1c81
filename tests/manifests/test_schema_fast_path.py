"""The manifest's schema check in code: it accepts an item only where jsonschema would, and refuses as before.

`Manifest.from_dict` shows jsonschema each repeated list (layers, entries, views, checksums, rank files,
files) as its first item alone when every item passes `_ItemRules`; these tests hold those rules to the
schemas themselves, for both readable versions, and the whole check to jsonschema on the whole document.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import validators
from test_hostile_input import SPECIAL, mutated
from test_manifest import small_manifest

from shardprep.errors import ManifestError
from shardprep.manifests.manifest import Manifest
from shardprep.manifests.schema import _cut_layer, _for_schema, _item_rules, _validator, manifest_schema
from shardprep.manifests.strict_json import is_int, parse_json

ITEMS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def strict_validator(schema: dict) -> Any:
    """jsonschema's validator for `schema`, with shardprep's strict integers (not 1.0, not true)."""
    base = jsonschema.Draft202012Validator
    return validators.extend(base, type_checker=base.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: is_int(value)))(schema)


def validator_of(version: int, kind: str) -> Any:
    """The validator of one kind of repeated item in a version's schema."""
    schema = manifest_schema(version)
    if kind == "source_file":
        return strict_validator({"$defs": schema["$defs"],
                                 **schema["properties"]["source"]["properties"]["files"]["items"]})
    if kind == "checksum":
        checksums = schema["$defs"]["layer"]["properties"]["checksums"]
        return strict_validator({"$defs": schema["$defs"], **checksums["items"]})
    return strict_validator({"$defs": schema["$defs"], "$ref": f"#/$defs/{kind}"})


# Values near every limit the schemas set, besides the hostile ones.
EDGE = st.sampled_from([0, 1, 15, 16, 2**60, 2**60 + 1, 10**9, 10**9 + 1, 65536, -1, "BF16", "Q4", "x" * 4096,
                        "x" * 4097, "a/\n", "\n", "a\n", "shards/r.safetensors", "0" * 32, "0" * 31 + "\n",
                        "f" * 32, "F" * 32, [], [1, 2], [2**60 + 1], list(range(17)), list(range(16))])
VALUE = st.one_of(SPECIAL, EDGE, st.integers(-5, 2**61), st.text(max_size=6))


@st.composite
def item(draw: st.DrawFn, valid: dict) -> Any:
    """A valid item with some fields replaced, deleted or added (or something else altogether)."""
    if draw(st.integers(0, 9)) == 0:
        return draw(VALUE)
    out = json.loads(json.dumps(valid))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*out, "extra"]))
        action = draw(st.sampled_from(["replace", "delete", "list"]))
        if action == "delete":
            out.pop(key, None)
        elif action == "list" and isinstance(out.get(key), list):
            out[key] = draw(st.lists(VALUE, max_size=3)) if out[key] else []
        else:
            out[key] = draw(VALUE)
    return out


def a_valid(kind: str) -> dict:
    data = small_manifest()
    layer = data["layers"][0]
    names = [e["name"] for e in layer["entries"]]
    return {
        "entry": layer["entries"][0],
        "view": {"name": "fused", "dtype": "BF16", "shape": [8, 3], "offset": 0, "members": names},
        "layer": layer,
        "file": data["replicated_files"][0],
        "source_file": {"name": "model.safetensors", "size": 123},
    }[kind]


@pytest.mark.parametrize("version,kind", [(1, "entry"), (2, "entry"), (1, "view"), (2, "view"), (1, "source_file"),
                                          (2, "source_file"), (2, "file")])  # version 1 has no replicated_files
@ITEMS
@given(data=st.data())
def test_an_item_the_code_accepts_is_one_the_schema_accepts(version, kind, data):
    candidate = data.draw(item(a_valid(kind)))
    if getattr(_item_rules(version), kind)(candidate):
        assert validator_of(version, kind).is_valid(candidate), candidate


@pytest.mark.parametrize("version", [1, 2])
@ITEMS
@given(value=VALUE)
def test_a_path_or_digest_the_code_accepts_is_one_the_schema_accepts(version, value):
    rules = _item_rules(version)
    if rules.relpath(value):
        assert validator_of(version, "relpath").is_valid(value), value
    if rules.digest(value):
        assert validator_of(version, "checksum").is_valid(value), value


@pytest.mark.parametrize("version", [1, 2])
@ITEMS
@given(data=st.data())
def test_a_layer_the_code_passes_whole_is_one_the_schema_accepts(version, data):
    layer = data.draw(item(a_valid("layer")))
    if isinstance(layer, dict) and data.draw(st.booleans()):
        layer["entries"] = [data.draw(item(a_valid("entry"))) for _ in range(data.draw(st.integers(0, 2)))]
    _, passes = _cut_layer(layer, _item_rules(version))
    if passes:
        assert validator_of(version, "layer").is_valid(layer), layer


def whole_document_error(data: Any) -> str | None:
    """What jsonschema says about the whole document, uncut, worded as `Manifest.from_dict` words it."""
    version = data.get("version") if isinstance(data, dict) else None
    error = jsonschema.exceptions.best_match(
        _validator(version if is_int(version) and version in (1, 2) else 2).iter_errors(data))
    if error is None:
        return None
    path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
    message = " ".join(error.message.split())
    return f"schema violation at {path[:200]}: {message[:300] + '…' if len(message) > 300 else message}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_schema_refuses_what_jsonschema_refuses_in_the_whole_document_with_the_same_message(data):
    doc = data.draw(mutated(small_manifest(world_size=3)))
    try:
        Manifest.from_dict(doc, check=False)
    except ManifestError as exc:
        if exc.code != "manifest_version":  # refused for its version, before the schema
            assert exc.code == "manifest_schema" and str(exc) == f"shard_manifest.json: {whole_document_error(doc)}"
        return
    assert whole_document_error(doc) is None


def test_a_valid_manifest_reaches_jsonschema_as_one_item_of_each_list():
    data = small_manifest(world_size=4)  # two layers of two entries, four ranks
    cut = _for_schema(data, 2)
    assert len(cut["layers"]) == 1 and len(cut["rank_files"]) == 1 and len(cut["replicated_files"]) == 1
    layer = cut["layers"][0]
    assert len(layer["entries"]) == 1 and len(layer["checksums"]) == 1
    assert data["layers"][0]["entries"][1] and len(data["rank_files"]) == 4  # the document itself is untouched


def test_one_bad_entry_is_named_at_its_own_index_among_thousands():
    data = small_manifest()
    layer = data["layers"][1]
    template = layer["entries"][0]
    layer["entries"] = [{**template, "name": f"m.layers.2.e{i}"} for i in range(3000)]
    layer["entries"][2345]["offset"] = 1.0
    with pytest.raises(ManifestError, match="schema violation at layers/1/entries/2345/offset"):
        Manifest.from_dict(data)


def test_too_many_checksums_are_refused_though_each_is_a_digest():
    data = small_manifest()
    data["layers"][0]["checksums"] = ["0" * 32] * 65537
    with pytest.raises(ManifestError, match="schema violation at layers/0/checksums"):
        Manifest.from_dict(data, check=False)


@pytest.mark.parametrize("text,fragment", [
    (b'{"a": [1, 1234567890123456789012345]}', "an integer of 25 digits"),
    (b'{"a": -1234567890123456789012345}', "an integer of 25 digits"),
    (b'1234567890123456789012345', "an integer of 25 digits"),
    (b'{"a": ' + b"7" * 5000 + b"}", "an integer of 5000 digits"),
    (b'{"a": "\\udc00"}', "not valid UTF-8"),
    (b'{"\\ud800": 1}', "not valid UTF-8"),
    (b'"\\ud800"', "not valid UTF-8"),
    (b'{"a": 1, "b": 2, "a": 3}', "key 'a' appears twice"),
])
def test_hostile_json_is_refused_whatever_shortcut_the_parser_takes(text, fragment):
    with pytest.raises(Exception, match=fragment):
        parse_json(text, "x.json")


def test_digits_inside_strings_and_24_digit_integers_are_fine():
    text = b'{"sum": "' + b"1" * 100 + b'", "n": 999999999999999999999999, "pair": "\\ud83d\\ude00"}'
    assert parse_json(text, "x.json") == {"sum": "1" * 100, "n": 10**24 - 1, "pair": "\U0001f600"}
