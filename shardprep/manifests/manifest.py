"""The shard manifest: dataclasses, JSON (de)serialization, schema and invariants.

A manifest is validated once, when it is parsed (`Manifest.from_dict` / `load_manifest`): after that,
every offset in it can be trusted by the loader and the runtime. Format version 2 is written; version 1
(rank files without a header, no checksums of the replicated part) is still read.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, ManifestError
from .checksums import digest, joined_digest
from .draft_layers import DraftLayers, draft_problems, parse_draft, serving_draft
from .dtypes import tensor_nbytes
from .exact_read import pread_exact
from .layout import (
    ENTRY_ALIGNMENT,
    FILE_ALIGNMENT,
    NO_CHUNK_ALIGNMENT,
    Entry,
    FusedView,
    LayerLayout,
    file_alignment_for,
    is_chunk_alignment,
)
from .paths import is_safe_relpath
from .problems import Problem, quoted
from .rank_file import header_json_bytes, plan_rank_file, rank_file_header, rank_file_name
from .strict_json import is_int, parse_json, read_capped

FORMAT = "shardprep/weight-shard"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "shard_manifest.json"
REPLICATED_INDEX = "model.safetensors.index.json"
# A manifest is a few MB even for thousands of ranks; a larger file is refused unread.
MAX_MANIFEST_BYTES = 256 << 20
# Rank file names have five digits; the manifest's checksums grow with layers × N.
MAX_WORLD_SIZE = 65536
# The manifest's checksum of itself (format version 2), and its value while the text is being hashed.
SELF_DIGEST_KEY = "manifest_xxh3_128"
UNSEALED = "0" * 32

__all__ = ["FORMAT", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "MAX_WORLD_SIZE", "READABLE_VERSIONS",
           "REPLICATED_INDEX", "SELF_DIGEST_KEY", "VERSION", "FileRecord", "LayerRecord", "Manifest",
           "check_invariants", "check_seal", "is_safe_relpath", "load_manifest", "manifest_schema", "rank_file_name",
           "read_manifest_at", "read_manifest_file", "seal"]


@dataclass(frozen=True)
class LayerRecord:
    """One layer of the manifest: its packed layout, where its chunk sits in every rank file, and checksums."""

    layer: int
    file_offset: int
    chunk_bytes: int
    total_bytes: int
    entries: tuple[Entry, ...]
    views: tuple[FusedView, ...] = ()
    checksums: tuple[str, ...] = ()

    @classmethod
    def from_layout(cls, layout: LayerLayout, file_offset: int, checksums: tuple[str, ...] = ()) -> LayerRecord:
        return cls(layout.layer, file_offset, layout.chunk_bytes, layout.total_bytes, layout.entries,
                   layout.views, checksums)

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)


def read_chunk(fd: int, path: str | Path, record: LayerRecord, rank: int, dest: memoryview, *,
               verify: bool = True) -> None:
    """Read `rank`'s chunk of `record`'s layer from its open rank file `fd` into `dest` (chunk_bytes long)
    and, with `verify`, check it against the manifest's checksum: IntegrityError naming `path` otherwise.

    >>> read_chunk(fd, "out/shards/rank-00001-of-00002.safetensors", record, 1, buffer)  # doctest: +SKIP
    """
    pread_exact(fd, dest, record.file_offset, path)
    if verify and (got := digest(dest)) != record.checksums[rank]:
        end = record.file_offset + record.chunk_bytes
        raise IntegrityError(
            f"{path}: layer {record.layer}'s chunk (bytes {record.file_offset}..{end}) has checksum {got}, the "
            f"manifest says {record.checksums[rank]}; the file is corrupt, copy it again",
            code="checksum_mismatch", file=str(path), layer=record.layer)


@dataclass(frozen=True)
class FileRecord:
    """A file of the output other than the manifest and the rank files: its path, size and XXH3-128."""

    path: str
    size: int
    xxh3_128: str


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to find and check every byte of an output directory. See docs/format.md."""

    world_size: int
    rank_files: tuple[str, ...]
    layers: tuple[LayerRecord, ...]
    source: dict[str, Any] = field(default_factory=lambda: {"files": []})
    quantization: dict[str, Any] | None = None
    replicated_index: str = REPLICATED_INDEX
    created_by: str = "shardprep"
    entry_alignment: int = ENTRY_ALIGNMENT
    file_alignment: int = FILE_ALIGNMENT
    chunk_alignment: int = NO_CHUNK_ALIGNMENT
    replicated_files: tuple[FileRecord, ...] = ()
    selection: dict[str, Any] | None = None
    requant_options: dict[str, Any] | None = None
    resharded_from: dict[str, Any] | None = None
    version: int = VERSION
    draft: DraftLayers | None = None
    """The layers that belong to a draft model (an MTP layer inside the checkpoint), None: every layer is the
    target model's. Written only when there is one, so every manifest without a draft keeps its bytes."""

    @property
    def max_total_bytes(self) -> int:
        """max |T| over layers: the size of one gather slot."""
        return max(r.total_bytes for r in self.layers)

    @property
    def rank_file_bytes(self) -> int:
        """Size of every rank file (and of one rank's device buffer)."""
        last = self.layers[-1]
        return last.file_offset + last.chunk_bytes

    @cached_property
    def rank_header(self) -> bytes:
        """The bytes every rank file starts with, up to the first chunk (empty for version 1 files)."""
        if self.version == 1:
            return b""
        return rank_file_header([(r.layer, r.file_offset, r.chunk_bytes) for r in self.layers], self.world_size)

    @property
    def rank_header_json_bytes(self) -> int:
        """8 + the length of the rank files' JSON header: the bytes before the first chunk that are not padding.

        0 for version 1 files, which have no header.
        """
        return header_json_bytes(self.rank_header)

    @property
    def target_records(self) -> tuple[LayerRecord, ...]:
        """The target model's layers: every layer but the draft's."""
        drafted = set(self.draft.layers) if self.draft else set()
        return tuple(r for r in self.layers if r.layer not in drafted)

    @property
    def draft_records(self) -> tuple[LayerRecord, ...]:
        """The draft model's layers (none without a draft); they come after every target layer in the rank files."""
        drafted = set(self.draft.layers) if self.draft else set()
        return tuple(r for r in self.layers if r.layer in drafted)

    def without_draft(self) -> Manifest:
        """This manifest as a reader of the target alone sees it: the target's layers, no draft.

        Its rank files are a prefix of the real ones (the draft's chunks come last), so `rank_file_bytes` is the
        bytes that reader maps; never write it (its header would not be the files').

        >>> Manifest(1, ("shards/r.bin",), (), version=1).without_draft().draft is None
        True
        """
        if self.draft is None:
            return self
        return replace(self, layers=self.target_records, draft=None)

    def with_serving_draft(self, config: dict[str, Any] | None, where: str = "DIR") -> Manifest:
        """This manifest with its draft as a server must treat it (`draft_layers.serving_draft`): its record,
        checked against config.json, or for a manifest written before drafts were recorded, the config's MTP
        layers it holds.

        >>> draft = load_manifest("out/").with_serving_draft(config).draft  # doctest: +SKIP
        """
        return replace(self, draft=serving_draft(self.draft, [r.layer for r in self.layers], config, where))

    def layer(self, index: int) -> LayerRecord:
        for r in self.layers:
            if r.layer == index:
                return r
        raise KeyError(f"layer {index} is not in the manifest")

    def target_names(self) -> list[str]:
        return [e.name for r in self.layers for e in r.entries]

    def file_record(self, path: str) -> FileRecord | None:
        """The checksum record of a replicated file, or None when the manifest lists none for it."""
        return self._files.get(path)

    @cached_property
    def _files(self) -> dict[str, FileRecord]:
        return {f.path: f for f in self.replicated_files}

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The manifest as JSON data, in the form of its version (2, or 1 for a manifest read from a v1 file)."""
        data: dict[str, Any] = {
            "format": FORMAT,
            "version": self.version,
            "world_size": self.world_size,
            "entry_alignment": self.entry_alignment,
        }
        if self.version >= 2:
            data["chunk_alignment"] = self.chunk_alignment
        data["file_alignment"] = self.file_alignment
        data["rank_files"] = list(self.rank_files)
        data["layers"] = [_layer_dict(r) for r in self.layers]
        data["replicated_index"] = self.replicated_index
        if self.version >= 2:
            data["replicated_files"] = [{"path": f.path, "size": f.size, "xxh3_128": f.xxh3_128}
                                        for f in self.replicated_files]
        data["quantization"] = self.quantization
        data["source"] = self.source
        if self.version >= 2:
            data["selection"] = self.selection
            data["requant_options"] = self.requant_options
            if self.resharded_from is not None:  # only outputs of `reshard` carry it
                data["resharded_from"] = self.resharded_from
            if self.draft is not None:  # only manifests with a draft's layers carry it
                data["draft"] = self.draft.record()
        data["created_by"] = self.created_by
        if self.version >= 2:
            data[SELF_DIGEST_KEY] = UNSEALED
        return data

    def to_json(self) -> str:
        """The manifest file's text, sealed: `manifest_xxh3_128` is the digest of the text itself (see `seal`)."""
        text = json.dumps(self.to_dict(), indent=1) + "\n"
        return seal(text) if self.version >= 2 else text

    @classmethod
    def from_dict(cls, data: Any, *, where: str = MANIFEST_NAME, check: bool = True) -> Manifest:
        """Parse and validate a manifest (schema, then every layout invariant unless `check=False`).

        Raises ManifestError naming the first problem. Unknown keys are ignored (the forward-compatibility
        rule within a major version).

        >>> from shardprep.manifests.layout import plan_layer, TensorSpec
        >>> lay = plan_layer(1, [TensorSpec("layers.1.w", "BF16", (4, 4))], world_size=2)
        >>> (offset,), _ = plan_rank_file([(1, lay.chunk_bytes)], 2, 4096)
        >>> m = Manifest(2, (rank_file_name(0, 2), rank_file_name(1, 2)),
        ...              (LayerRecord.from_layout(lay, offset, ("0" * 32,) * 2),),
        ...              replicated_files=(FileRecord(REPLICATED_INDEX, 2, "0" * 32),),
        ...              selection={"preset": None, "preset_targets": [], "targets": ["*"], "layers": "1-",
        ...                         "layer_pattern": "x"},
        ...              requant_options={"mode": "none", "scope": "all", "recipe": "sglang", "scale_format": "f32",
        ...                               "allow_nonfinite": False},
        ...              source={"path": "/m", "repo_id": None, "revision": None, "commit": None, "files": []})
        >>> Manifest.from_dict(m.to_dict()).layers[0].chunk_bytes
        16
        """
        version = _validate_schema(data, where)
        layers = tuple(
            LayerRecord(
                layer=r["layer"],
                file_offset=r["file_offset"],
                chunk_bytes=r["chunk_bytes"],
                total_bytes=r["total_bytes"],
                entries=tuple(Entry(e["name"], e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"])
                              for e in r["entries"]),
                views=tuple(FusedView(v["name"], v["dtype"], tuple(v["shape"]), v["offset"], tuple(v["members"]),
                                      v.get("pad_rows", 0))
                            for v in r["views"]),
                checksums=tuple(r["checksums"]),
            )
            for r in data["layers"]
        )
        m = cls(
            world_size=data["world_size"],
            rank_files=tuple(data["rank_files"]),
            layers=layers,
            source=data["source"],
            quantization=data["quantization"],
            replicated_index=data["replicated_index"],
            created_by=data["created_by"],
            entry_alignment=data["entry_alignment"],
            file_alignment=data["file_alignment"],
            chunk_alignment=data.get("chunk_alignment", NO_CHUNK_ALIGNMENT),
            replicated_files=tuple(FileRecord(f["path"], f["size"], f["xxh3_128"])
                                   for f in data.get("replicated_files", ())),
            selection=data.get("selection"),
            requant_options=data.get("requant_options"),
            resharded_from=data.get("resharded_from"),
            version=version,
            draft=parse_draft(data.get("draft")),
        )
        problems = check_invariants(m) if check else []
        if problems:
            more = f" (and {len(problems) - 1} more)" if problems[1:] else ""
            raise ManifestError(f"{where}: {problems[0]}{more}", code=problems[0].code)
        return m


def seal(text: str) -> str:
    """Put the manifest's own checksum into its text: XXH3-128 of the text with the digest's 32 hex digits
    as zeros, written in their place. Every byte of the file is then covered, the manifest included.

    >>> sealed = seal('{"a": 1, "manifest_xxh3_128": "' + UNSEALED + '"}')
    >>> check_seal(sealed.encode(), json.loads(sealed)) is None
    True
    """
    raw = text.encode()
    spans = _seal_spans(raw)
    if len(spans) != 1:
        raise ValueError(f"a manifest text must hold one {SELF_DIGEST_KEY}, found {len(spans)}")
    a, b = spans[0]
    return (raw[:a] + _self_digest(raw, a, b).encode() + raw[b:]).decode()


def check_seal(raw: bytes, data: Any) -> str | None:
    """Why the manifest file `raw` (parsed: `data`) fails its own checksum, or None when it holds."""
    want = data.get(SELF_DIGEST_KEY) if isinstance(data, dict) else None
    spans = _seal_spans(raw)
    if len(spans) != 1 or not isinstance(want, str):
        return f"the file must hold exactly one {SELF_DIGEST_KEY} (found {len(spans)})"
    a, b = spans[0]
    got = _self_digest(raw, a, b)
    if raw[a:b].decode() != want or got != want:
        return (f"{SELF_DIGEST_KEY} is {raw[a:b].decode()} but the file's checksum is {got} (the manifest was "
                "modified or damaged; re-run convert)")
    return None


def _self_digest(raw: bytes, a: int, b: int) -> str:
    # The checksum of the text with its own digest, at raw[a:b], written as zeros.
    view = memoryview(raw)
    return joined_digest((view[:a], UNSEALED.encode(), view[b:]))


def _seal_spans(raw: bytes) -> list[tuple[int, int]]:
    return [m.span(1) for m in _SEAL.finditer(raw)]


_SEAL = re.compile(rb'"manifest_xxh3_128"\s*:\s*"([0-9a-f]{32})"')


def _layer_dict(r: LayerRecord) -> dict[str, Any]:
    return {
        "layer": r.layer,
        "file_offset": r.file_offset,
        "chunk_bytes": r.chunk_bytes,
        "total_bytes": r.total_bytes,
        "entries": [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset,
                     "nbytes": e.nbytes} for e in r.entries],
        # `pad_rows` only where there are some: every manifest without them keeps its bytes (and checksum).
        "views": [{"name": v.name, "dtype": v.dtype, "shape": list(v.shape), "offset": v.offset,
                   "members": list(v.members), **({"pad_rows": v.pad_rows} if v.pad_rows else {})} for v in r.views],
        "checksums": list(r.checksums),
    }


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


def _validate_schema(data: Any, where: str) -> int:
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

    tests/test_schema_fast_path.py holds them against jsonschema itself.
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


def check_invariants(m: Manifest) -> list[Problem]:
    """Every layout rule of docs/format.md that the schema cannot express; returns the problems found.

    >>> [p.message for p in check_invariants(Manifest(1, ("shards/r.bin",), (), version=1))]
    ['manifest has no layers']
    """
    problems: list[Problem] = []

    def bad(message: str, code: str = "manifest_invariant", *, layer: int | None = None,
            tensor: str | None = None, file: str | None = None) -> None:
        problems.append(Problem(code, message, file=file, layer=layer, tensor=tensor))

    n = m.world_size
    if len(m.rank_files) != n:
        bad(f"world_size is {n} but rank_files lists {len(m.rank_files)} files")
    if len(set(m.rank_files)) != len(m.rank_files):
        bad("rank_files lists the same file twice")
    listed = [f.path for f in m.replicated_files]
    for p in (*m.rank_files, m.replicated_index, *listed):
        if not is_safe_relpath(p):
            bad(f"path {quoted(p)} is absolute or leaves the output directory", "unsafe_path", file=str(p))
    if m.version >= 2:
        _check_v2_files(m, listed, bad)
    if not m.layers:
        bad("manifest has no layers")
        return problems
    seen_layers: set[int] = set()
    seen_names: set[str] = set()
    prev_end = 0
    for r in m.layers:
        tag = f"layer {r.layer}"
        if r.layer in seen_layers:
            bad(f"{tag} appears twice", layer=r.layer)
        seen_layers.add(r.layer)
        if r.file_offset % m.file_alignment:
            bad(f"{tag}: file_offset {r.file_offset} is not {m.file_alignment}-aligned", layer=r.layer)
        if r.file_offset < prev_end:
            bad(f"{tag}: file_offset {r.file_offset} overlaps the previous layer's chunk", layer=r.layer)
        prev_end = r.file_offset + r.chunk_bytes
        if r.total_bytes % (m.entry_alignment * n):
            bad(f"{tag}: total_bytes {r.total_bytes} is not a multiple of 16·world_size", layer=r.layer)
        if r.chunk_bytes * n != r.total_bytes:
            bad(f"{tag}: chunk_bytes·world_size {r.chunk_bytes * n} != total_bytes {r.total_bytes}", layer=r.layer)
        if r.chunk_bytes % m.chunk_alignment:
            bad(f"{tag}: chunk_bytes {r.chunk_bytes} is not a multiple of chunk_alignment {m.chunk_alignment}",
                layer=r.layer)
        if len(r.checksums) != n:
            bad(f"{tag}: {len(r.checksums)} checksums for {n} ranks (every chunk needs one)", "checksum_count",
                layer=r.layer)
        _check_entries(r, m.entry_alignment, seen_names, bad)
    if m.draft is not None:
        for problem in draft_problems(m.draft, [r.layer for r in m.layers]):
            bad(problem, "draft_layers")
    if m.version >= 2 and not problems:
        _check_v2_offsets(m, bad)
    return problems


def _check_v2_files(m: Manifest, listed: list[str], bad: Any) -> None:
    if not is_chunk_alignment(m.chunk_alignment):
        bad(f"chunk_alignment {m.chunk_alignment} is not a power of two from 16 bytes to 64 MiB")
    elif m.file_alignment != file_alignment_for(m.chunk_alignment):
        bad(f"file_alignment {m.file_alignment} is not max(4096, chunk_alignment) = "
            f"{file_alignment_for(m.chunk_alignment)}")
    for r, name in enumerate(m.rank_files):
        if name != rank_file_name(r, m.world_size):
            bad(f"rank_files[{r}] is {quoted(name)}, not {rank_file_name(r, m.world_size)!r}", file=str(name))
            break
    if len(set(listed)) != len(listed):
        bad("replicated_files lists the same path twice")
    own = {MANIFEST_NAME, *m.rank_files}
    for p in listed:
        if p in own:
            bad(f"replicated_files lists {quoted(p)}, which is the manifest or a rank file", file=p)
    if m.replicated_index not in listed:
        bad(f"replicated_files has no checksum of the index {quoted(m.replicated_index)}",
            file=m.replicated_index)


def _check_v2_offsets(m: Manifest, bad: Any) -> None:
    # In version 2 the rank file's layout follows from the layers alone (docs/format.md), which is what
    # makes its header the same bytes on every rank and rebuildable by any reader.
    try:
        expected, _ = plan_rank_file([(r.layer, r.chunk_bytes) for r in m.layers], m.world_size,
                                     m.file_alignment)
    except (ValueError, ZeroDivisionError):
        bad("the layers' sizes do not give a rank file layout")
        return
    for r, want in zip(m.layers, expected):
        if r.file_offset != want:
            bad(f"layer {r.layer}: file_offset {r.file_offset} is not {want}, where the rank file layout puts it",
                layer=r.layer)
            return


def _check_entries(r: LayerRecord, entry_alignment: int, seen_names: set[str], bad: Any) -> None:
    tag = f"layer {r.layer}"
    end = 0
    by_name = {}
    for e in sorted(r.entries, key=lambda e: e.offset):
        if e.name in seen_names:
            bad(f"tensor {quoted(e.name)} appears twice in the manifest", layer=r.layer, tensor=e.name)
        seen_names.add(e.name)
        by_name[e.name] = e
        if e.offset % entry_alignment:
            bad(f"tensor {quoted(e.name)}: offset {e.offset} is not {entry_alignment}-aligned", layer=r.layer,
                tensor=e.name)
        if e.offset < end:
            bad(f"tensor {quoted(e.name)}: offset {e.offset} overlaps the previous entry", layer=r.layer,
                tensor=e.name)
        if e.nbytes != tensor_nbytes(e.dtype, e.shape, tensor=e.name):
            bad(f"tensor {quoted(e.name)}: nbytes {e.nbytes} does not match {e.dtype}{list(e.shape)}",
                layer=r.layer, tensor=e.name)
        end = e.offset + e.nbytes
    if end > r.total_bytes:
        bad(f"{tag}: entries end at byte {end}, past total_bytes {r.total_bytes}", layer=r.layer)
    for v in r.views:
        problem = _check_view(v, by_name, tag) or _check_pad_rows(v, by_name, r, tag)
        if problem:
            bad(problem, layer=r.layer, tensor=v.name)


def _check_view(v: FusedView, entries: dict[str, Entry], tag: str) -> str | None:
    missing = [name for name in v.members if name not in entries]
    if missing:
        return f"{tag}: fused view {quoted(v.name)} names unknown member {quoted(missing[0])}"
    at = v.offset
    rows = 0
    for name in v.members:
        e = entries[name]
        if e.offset != at or e.dtype != v.dtype or not e.shape or tuple(e.shape[1:]) != tuple(v.shape[1:]):
            return f"{tag}: fused view {quoted(v.name)} does not cover member {quoted(name)} contiguously"
        at += e.nbytes
        rows += e.shape[0]
    if not v.shape or rows + v.pad_rows != v.shape[0]:
        pad = f" and {v.pad_rows} pad rows" if v.pad_rows else ""
        return f"{tag}: fused view {quoted(v.name)} has shape {list(v.shape)} but its members have {rows} rows{pad}"
    return None


def _check_pad_rows(v: FusedView, entries: dict[str, Entry], r: LayerRecord, tag: str) -> str | None:
    """A view's pad rows must be bytes of T that no entry holds (so they are zero padding, which validate checks)."""
    if not v.pad_rows:
        return None
    last = entries[v.members[-1]]
    start, end = last.offset + last.nbytes, v.offset + v.nbytes
    if end > r.total_bytes:
        return f"{tag}: fused view {quoted(v.name)}'s {v.pad_rows} pad rows end at byte {end}, past total_bytes"
    inside = next((e.name for e in r.entries if e.offset < end and e.offset + e.nbytes > start), None)
    if inside is not None:
        return f"{tag}: fused view {quoted(v.name)}'s {v.pad_rows} pad rows overlap tensor {quoted(inside)}"
    return None


def load_manifest(directory: str | Path, *, check: bool = True) -> Manifest:
    """Read and validate `DIR/shard_manifest.json` (format version 2, or 1).

    Raises ManifestError naming the problem: missing, larger than 256 MiB, not UTF-8 JSON, nested too
    deeply, a schema violation, a broken invariant, or (version 2) a file that fails its own checksum.

    >>> load_manifest("out/")  # doctest: +SKIP
    """
    return read_manifest_file(directory, check=check)[0]


def read_manifest_file(directory: str | Path, *, check: bool = True) -> tuple[Manifest, str | None]:
    """`load_manifest`, also returning why the file fails its own checksum (None when it holds).

    With `check` (what loaders use) a failed self-checksum is a ManifestError; `validate` passes
    `check=False` to report it next to every other problem.
    """
    return read_manifest_at(Path(directory) / MANIFEST_NAME, check=check,
                            missing=f"is {directory} an output directory of `shardprep convert`?")


def read_manifest_at(path: str | Path, *, check: bool = True,
                     missing: str = "give a manifest file, or the directory that holds shard_manifest.json"
                     ) -> tuple[Manifest, str | None]:
    """`read_manifest_file` for a manifest file of any name, anywhere (a CI repository's copy, say).

    `missing` ends the message when there is no file at `path`.

    >>> manifest, unsealed = read_manifest_at("deploy/llama-70b/shard_manifest.json")  # doctest: +SKIP
    """
    path = Path(path)
    with _collector_paused():
        try:
            raw = read_capped(path, max_bytes=MAX_MANIFEST_BYTES, what="manifest")
        except IntegrityError as exc:
            if exc.code == "missing_file":
                raise ManifestError(f"{path}: not found; {missing}", code="manifest_missing") from None
            raise ManifestError(str(exc), code="manifest_unreadable") from None
        key = (os.path.abspath(path), check)
        known = _recent.get(key, raw)
        if known is not None:
            return known
        try:
            data = parse_json(raw, str(path))
        except IntegrityError as exc:
            raise ManifestError(str(exc), code="manifest_unreadable") from None
        manifest = Manifest.from_dict(data, where=str(path), check=check)
    unsealed = check_seal(raw, data) if manifest.version >= 2 else None
    if unsealed and check:
        raise ManifestError(f"{path}: {unsealed}", code="manifest_checksum_mismatch")
    _recent.put(key, raw, (manifest, unsealed))
    return _with_own_dicts(manifest), unsealed  # the cached one's dicts stay as they were read


class _RecentManifests:
    """The last few manifests read, by path, each with the exact bytes it was parsed from.

    Parsing is a pure function of the bytes: a file read again whose bytes are the same, compared in
    full, gives the same manifest without parsing and validating it again (a few ms instead of 40-120 for
    10,000 entries; a loader, vLLM's create_model then load_sharded, and validate each read it once). Any
    other byte, an edit or damage, is a miss, parsed and checked as ever. Each caller gets its own copy
    of the manifest's dicts; everything else in a Manifest is immutable.
    """

    SIZE = 4

    def __init__(self) -> None:
        self._items: OrderedDict[tuple[str, bool], tuple[bytes, tuple[Manifest, str | None]]] = OrderedDict()
        self._lock = threading.Lock()  # ranks of one process may open their files from several threads

    def get(self, key: tuple[str, bool], raw: bytes) -> tuple[Manifest, str | None] | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0] != raw:
                return None
            self._items.move_to_end(key)
        manifest, unsealed = item[1]
        return _with_own_dicts(manifest), unsealed

    def put(self, key: tuple[str, bool], raw: bytes, result: tuple[Manifest, str | None]) -> None:
        with self._lock:
            self._items[key] = (raw, result)
            self._items.move_to_end(key)
            while len(self._items) > self.SIZE:
                self._items.popitem(last=False)


_recent = _RecentManifests()


def _with_own_dicts(m: Manifest) -> Manifest:
    return replace(m, source=copy.deepcopy(m.source), quantization=copy.deepcopy(m.quantization),
                   selection=copy.deepcopy(m.selection), requant_options=copy.deepcopy(m.requant_options),
                   resharded_from=copy.deepcopy(m.resharded_from))


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a manifest is parsed and built.

    A 10,000-entry manifest allocates some 200,000 containers, none in a cycle, and every 700 of them set
    off a collection that walks the young ones again (`bench_manifest.py --fused-experts`, 3.4 MB: a later
    call took 64 ms with the collector on, 58 ms paused; docs/benchmarks.md).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
