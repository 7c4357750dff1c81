"""The shard manifest: dataclasses, JSON (de)serialization, schema and invariants.

A manifest is validated once, when it is parsed (`Manifest.from_dict` / `load_manifest`): after that,
every offset in it can be trusted by the loader and the runtime.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import ManifestError
from .dtypes import tensor_nbytes
from .layout import ENTRY_ALIGNMENT, FILE_ALIGNMENT, Entry, FusedView, LayerLayout

FORMAT = "shardprep/weight-shard"
VERSION = 1
MANIFEST_NAME = "shard_manifest.json"
REPLICATED_INDEX = "model.safetensors.index.json"


def rank_file_name(rank: int, world_size: int) -> str:
    """Relative path of a rank's file inside an output directory.

    >>> rank_file_name(0, 8)
    'shards/rank-00000-of-00008.bin'
    """
    return f"shards/rank-{rank:05d}-of-{world_size:05d}.bin"


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


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to find every target byte of every rank. See docs/format.md."""

    world_size: int
    rank_files: tuple[str, ...]
    layers: tuple[LayerRecord, ...]
    source: dict[str, Any] = field(default_factory=lambda: {"files": []})
    quantization: dict[str, Any] | None = None
    replicated_index: str = REPLICATED_INDEX
    created_by: str = "shardprep"
    entry_alignment: int = ENTRY_ALIGNMENT
    file_alignment: int = FILE_ALIGNMENT

    @property
    def max_total_bytes(self) -> int:
        """max |T| over layers: the size of one gather slot."""
        return max(r.total_bytes for r in self.layers)

    @property
    def rank_file_bytes(self) -> int:
        """Size of every rank file (and of one rank's device buffer)."""
        last = self.layers[-1]
        return last.file_offset + last.chunk_bytes

    def layer(self, index: int) -> LayerRecord:
        for r in self.layers:
            if r.layer == index:
                return r
        raise KeyError(f"layer {index} is not in the manifest")

    def target_names(self) -> list[str]:
        return [e.name for r in self.layers for e in r.entries]

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.world_size,
            "entry_alignment": self.entry_alignment,
            "file_alignment": self.file_alignment,
            "rank_files": list(self.rank_files),
            "layers": [
                {
                    "layer": r.layer,
                    "file_offset": r.file_offset,
                    "chunk_bytes": r.chunk_bytes,
                    "total_bytes": r.total_bytes,
                    "entries": [
                        {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset,
                         "nbytes": e.nbytes}
                        for e in r.entries
                    ],
                    "views": [
                        {"name": v.name, "dtype": v.dtype, "shape": list(v.shape), "offset": v.offset,
                         "members": list(v.members)}
                        for v in r.views
                    ],
                    "checksums": list(r.checksums),
                }
                for r in self.layers
            ],
            "replicated_index": self.replicated_index,
            "quantization": self.quantization,
            "source": self.source,
            "created_by": self.created_by,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: Any, *, where: str = MANIFEST_NAME, check: bool = True) -> Manifest:
        """Parse and validate a manifest (schema, then every layout invariant unless `check=False`).

        >>> from shardprep.manifests.layout import plan_layer, TensorSpec
        >>> lay = plan_layer(1, [TensorSpec("layers.1.w", "BF16", (4, 4))], world_size=2)
        >>> m = Manifest(2, ("shards/a.bin", "shards/b.bin"), (LayerRecord.from_layout(lay, 0),))
        >>> Manifest.from_dict(m.to_dict()).layers[0].chunk_bytes
        16
        """
        _validate_schema(data, where)
        layers = tuple(
            LayerRecord(
                layer=r["layer"],
                file_offset=r["file_offset"],
                chunk_bytes=r["chunk_bytes"],
                total_bytes=r["total_bytes"],
                entries=tuple(Entry(e["name"], e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"])
                              for e in r["entries"]),
                views=tuple(FusedView(v["name"], v["dtype"], tuple(v["shape"]), v["offset"], tuple(v["members"]))
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
        )
        problems = check_invariants(m) if check else []
        if problems:
            more = f" (and {len(problems) - 1} more)" if problems[1:] else ""
            raise ManifestError(f"{where}: {problems[0]}{more}")
        return m


@cache
def manifest_schema() -> dict[str, Any]:
    """The JSON Schema shipped with the package (shardprep/manifests/schema.json)."""
    return json.loads(resources.files(__package__).joinpath("schema.json").read_text())


def _validate_schema(data: Any, where: str) -> None:
    import jsonschema

    if isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") != VERSION:
        raise ManifestError(f"{where}: manifest version {data.get('version')!r} is not supported "
                            f"(this shardprep reads version {VERSION}); upgrade shardprep or re-run convert")
    validator = jsonschema.Draft202012Validator(manifest_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise ManifestError(f"{where}: schema violation at {path}: {error.message}")


def check_invariants(m: Manifest) -> list[str]:
    """Every layout rule of docs/format.md that the schema cannot express; returns the problems found.

    >>> check_invariants(Manifest(1, ("shards/r.bin",), ()))
    ['manifest has no layers']
    """
    problems: list[str] = []
    n = m.world_size
    if len(m.rank_files) != n:
        problems.append(f"world_size is {n} but rank_files lists {len(m.rank_files)} files")
    if len(set(m.rank_files)) != len(m.rank_files):
        problems.append("rank_files lists the same file twice")
    for p in (*m.rank_files, m.replicated_index):
        if not is_safe_relpath(p):
            problems.append(f"path {p!r} is absolute or leaves the output directory")
    if not m.layers:
        return [*problems, "manifest has no layers"]
    seen_layers: set[int] = set()
    seen_names: set[str] = set()
    prev_end = 0
    for r in m.layers:
        tag = f"layer {r.layer}"
        if r.layer in seen_layers:
            problems.append(f"{tag} appears twice")
        seen_layers.add(r.layer)
        if r.file_offset % m.file_alignment:
            problems.append(f"{tag}: file_offset {r.file_offset} is not {m.file_alignment}-aligned")
        if r.file_offset < prev_end:
            problems.append(f"{tag}: file_offset {r.file_offset} overlaps the previous layer's chunk")
        prev_end = r.file_offset + r.chunk_bytes
        if r.total_bytes % (m.entry_alignment * n):
            problems.append(f"{tag}: total_bytes {r.total_bytes} is not a multiple of 16·world_size")
        if r.chunk_bytes * n != r.total_bytes:
            problems.append(f"{tag}: chunk_bytes·world_size {r.chunk_bytes * n} != total_bytes {r.total_bytes}")
        if r.checksums and len(r.checksums) != n:
            problems.append(f"{tag}: {len(r.checksums)} checksums for {n} ranks")
        end = 0
        by_name = {}
        for e in sorted(r.entries, key=lambda e: e.offset):
            if e.name in seen_names:
                problems.append(f"tensor {e.name!r} appears twice in the manifest")
            seen_names.add(e.name)
            by_name[e.name] = e
            if e.offset % m.entry_alignment:
                problems.append(f"tensor {e.name!r}: offset {e.offset} is not {m.entry_alignment}-aligned")
            if e.offset < end:
                problems.append(f"tensor {e.name!r}: offset {e.offset} overlaps the previous entry")
            try:
                expected = tensor_nbytes(e.dtype, e.shape, tensor=e.name)
            except Exception as exc:  # unsupported dtype; schema normally catches it
                problems.append(str(exc))
                expected = e.nbytes
            if e.nbytes != expected:
                problems.append(f"tensor {e.name!r}: nbytes {e.nbytes} does not match {e.dtype}{list(e.shape)}")
            end = e.offset + e.nbytes
        if end > r.total_bytes:
            problems.append(f"{tag}: entries end at byte {end}, past total_bytes {r.total_bytes}")
        for v in r.views:
            problem = _check_view(v, by_name, tag)
            if problem:
                problems.append(problem)
    return problems


def _check_view(v: FusedView, entries: dict[str, Entry], tag: str) -> str | None:
    missing = [name for name in v.members if name not in entries]
    if missing:
        return f"{tag}: fused view {v.name!r} names unknown member {missing[0]!r}"
    at = v.offset
    rows = 0
    for name in v.members:
        e = entries[name]
        if e.offset != at or e.dtype != v.dtype or tuple(e.shape[1:]) != tuple(v.shape[1:]):
            return f"{tag}: fused view {v.name!r} does not cover member {name!r} contiguously"
        at += e.nbytes
        rows += e.shape[0]
    if rows != v.shape[0]:
        return f"{tag}: fused view {v.name!r} has {v.shape[0]} rows but its members have {rows}"
    return None


def is_safe_relpath(p: str) -> bool:
    """True for a relative POSIX path that stays inside its directory.

    >>> is_safe_relpath("shards/rank-00000-of-00002.bin"), is_safe_relpath("../x"), is_safe_relpath("/etc/x")
    (True, False, False)
    """
    pp = PurePosixPath(p)
    return bool(p) and not pp.is_absolute() and "\\" not in p and ".." not in pp.parts and ":" not in pp.parts[0]


def load_manifest(directory: str | Path, *, check: bool = True) -> Manifest:
    """Read and validate `DIR/shard_manifest.json`.

    >>> load_manifest("out/")  # doctest: +SKIP
    """
    path = Path(directory) / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ManifestError(f"{path}: not found; is {directory} an output directory of `shardprep convert`?") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return Manifest.from_dict(data, where=str(path), check=check)
