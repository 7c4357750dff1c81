"""The manifest's JSON Schema (schema.json, schema_v1.json) and its validation, with the fast path that lets
jsonschema see one item of each list that grows with the model when every item passes the same rules in code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from ..errors import ManifestError
from .paths import is_safe_relpath
from .problems import quoted
from .strict_json import is_int

FORMAT = "shardprep/weight-shard"
VERSION = 2
READABLE_VERSIONS = (1, 2)


@cache
def manifest_schema(version: int = VERSION) -> dict[str, Any]:
    """The JSON Schema shipped with the package: schema.json (version 2) or schema_v1.json."""
    name = "schema.json" if version == VERSION else f"schema_v{version}.json"
    result: dict[str, Any] = json.loads(resources.files(__package__).joinpath(name).read_text())
    return result


@cache
def _validator(version: int) -> Any:
    import jsonschema
    from jsonschema import validators

    # JSON Schema counts 1.0 as an integer, and Python counts True as one: neither is a byte count here.
    def is_integer(_checker: Any, instance: object) -> bool:
        return is_int(instance)

    base = jsonschema.Draft202012Validator
    strict = validators.extend(base, type_checker=base.TYPE_CHECKER.redefine("integer", is_integer))
    return strict(manifest_schema(version))


def validate_schema(data: Any, where: str) -> int:
    """Check `data` against its version's schema; its version, or a ManifestError naming the first violation."""
    import jsonschema

    version = data.get("version") if isinstance(data, dict) else None
    readable = is_int(version) and version in READABLE_VERSIONS  # 2.0 and True are not versions
    if isinstance(data, dict) and data.get("format") == FORMAT and not readable:
        raise ManifestError(f"{where}: manifest version {quoted(version)} is not supported (this shardprep reads "
                            f"versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade shardprep or re-run "
                            "convert", code="manifest_version")
    schema_version = version if readable and isinstance(version, int) else VERSION
    try:
        validator = _validator(schema_version)
        error = jsonschema.exceptions.best_match(validator.iter_errors(_for_schema(data, schema_version)))
    except RecursionError:
        raise ManifestError(f"{where}: nested too deeply to be a manifest", code="manifest_schema") from None
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        message = " ".join(error.message.split())
        if len(message) > 300:
            message = message[:300] + "…"
        raise ManifestError(f"{where}: schema violation at {path[:200]}: {message}", code="manifest_schema")
    assert isinstance(version, int)
    return version


def _for_schema(data: Any, version: int) -> Any:
    """`data` as jsonschema needs to see it: each list that grows with the model cut to its first item when
    every item passes the checks of `_ItemRules`, which accept an item only where the schema would.

    jsonschema spends about 0.3 ms per entry (a second per call for 10,000 entries, on every rank at
    startup); these checks, a few µs. Refusal is left to jsonschema, which sees every item that failed
    here, at its index, so its message is the same as for the whole document.
    """
    if type(data) is not dict:
        return data
    rules = _item_rules(version)
    out = dict(data)
    _cut_into(out, "rank_files", rules.relpath, rules.max_list)
    _cut_into(out, "replicated_files", rules.file)
    source = data.get("source")
    if type(source) is dict:
        out["source"] = dict(source)
        _cut_into(out["source"], "files", rules.source_file)
    layers = data.get("layers")
    if type(layers) is list:
        cut = [_cut_layer(layer, rules) for layer in layers]
        every_layer_passes = bool(cut) and all(passed for _, passed in cut)
        out["layers"] = [layer for layer, _ in cut[:1 if every_layer_passes else len(cut)]]
    return out


def _cut_into(obj: dict[str, Any], key: str, passes: Callable[[Any], bool], max_items: int | None = None) -> bool:
    """Cut `obj[key]` to its first item when it is a non-empty list (of at most `max_items`) whose every item
    passes; True when it was."""
    items = obj.get(key)
    if (type(items) is list and items and (max_items is None or len(items) <= max_items)
            and all(map(passes, items))):
        obj[key] = items[:1]
        return True
    return False


def _cut_layer(layer: Any, rules: _ItemRules) -> tuple[Any, bool]:
    """The layer with its lists cut where all their items pass, and whether the whole layer passes."""
    if type(layer) is not dict:
        return layer, False
    out = dict(layer)
    passes = rules.layer_fields(layer)
    passes = _cut_into(out, "entries", rules.entry) and passes
    passes = (out.get("views") == [] or _cut_into(out, "views", rules.view)) and passes
    passes = _cut_into(out, "checksums", rules.digest, rules.max_list) and passes
    return out, passes


@dataclass(frozen=True)
class _ItemRules:
    """The schema's rules for the items that repeat, in code: each check accepts only what every readable
    version's schema accepts (its limits are read from schema.json; `closed`: version 1 forbids other keys).

    tests/manifests/test_schema_fast_path.py holds them against jsonschema itself.
    """

    dtypes: frozenset[str]
    max_bytes: int
    max_name: int
    max_dims: int
    max_path: int
    max_layer: int
    max_list: int
    closed: bool

    def entry(self, e: Any) -> bool:
        # Written out, not shared with `view`: this runs once per entry, and a call (or a generator, in all())
        # costs more than the checks themselves.
        if type(e) is not dict or (self.closed and len(e) != 5):
            return False
        try:
            name, dtype, shape, offset, nbytes = e["name"], e["dtype"], e["shape"], e["offset"], e["nbytes"]
        except KeyError:
            return False
        top = self.max_bytes
        if not (type(name) is str and 0 < len(name) <= self.max_name and type(dtype) is str and dtype in self.dtypes
                and type(offset) is int and 0 <= offset <= top and type(nbytes) is int and 0 <= nbytes <= top
                and type(shape) is list and len(shape) <= self.max_dims):
            return False
        for d in shape:
            if type(d) is not int or not 0 <= d <= top:
                return False
        return True

    def view(self, v: Any) -> bool:
        if type(v) is not dict or (self.closed and len(v) != 5):
            return False
        try:
            name, dtype, shape, offset, members = v["name"], v["dtype"], v["shape"], v["offset"], v["members"]
        except KeyError:
            return False
        top, longest = self.max_bytes, self.max_name
        if not (type(name) is str and 0 < len(name) <= longest and type(dtype) is str and dtype in self.dtypes
                and type(offset) is int and 0 <= offset <= top and type(shape) is list and len(shape) <= self.max_dims
                and type(members) is list and len(members) >= 2):
            return False
        for d in shape:
            if type(d) is not int or not 0 <= d <= top:
                return False
        for m in members:
            if type(m) is not str or not 0 < len(m) <= longest:
                return False
        pad = v.get("pad_rows", 1)
        return type(pad) is int and 1 <= pad <= top

    def layer_fields(self, r: dict[str, Any]) -> bool:
        """Every field of a layer but its lists' items (`_cut_layer` checks those)."""
        if self.closed and len(r) != 7:
            return False
        try:
            layer, offset, chunk, total = r["layer"], r["file_offset"], r["chunk_bytes"], r["total_bytes"]
            lists = (r["entries"], r["views"], r["checksums"])
        except KeyError:
            return False
        top = self.max_bytes
        return (type(layer) is int and 0 <= layer <= self.max_layer and type(offset) is int and 0 <= offset <= top
                and type(chunk) is int and 0 < chunk <= top and type(total) is int and 0 < total <= top
                and all(type(items) is list for items in lists))

    def digest(self, c: Any) -> bool:
        return type(c) is str and _DIGEST.fullmatch(c) is not None

    def relpath(self, p: Any) -> bool:
        # A final newline: the schema's `$` matches before one, so "a/\n" is refused there but safe here.
        return type(p) is str and len(p) <= self.max_path and is_safe_relpath(p) and not p.endswith("\n")

    def file(self, f: Any) -> bool:
        if type(f) is not dict:
            return False
        path, size, checksum = f.get("path"), f.get("size"), f.get("xxh3_128")
        return self.relpath(path) and type(size) is int and 0 <= size <= self.max_bytes and self.digest(checksum)

    def source_file(self, f: Any) -> bool:
        if type(f) is not dict:
            return False
        name, size = f.get("name"), f.get("size")
        return type(name) is str and type(size) is int and 0 <= size <= self.max_bytes


@cache
def _item_rules(version: int) -> _ItemRules:
    # The limits of the current schema, which are the tighter ones: version 1 set no maxima.
    defs = manifest_schema(VERSION)["$defs"]
    layer = defs["layer"]["properties"]
    return _ItemRules(dtypes=frozenset(defs["dtype"]["enum"]), max_bytes=defs["bytes"]["maximum"],
                      max_name=defs["name"]["maxLength"], max_dims=defs["shape"]["maxItems"],
                      max_path=defs["relpath"]["maxLength"], max_layer=layer["layer"]["maximum"],
                      max_list=layer["checksums"]["maxItems"], closed=version == 1)


_DIGEST = re.compile(r"[0-9a-f]{32}")
