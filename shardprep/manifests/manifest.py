"""The shard manifest: the `Manifest` dataclass, its JSON, and reading it from a directory.

A manifest is validated once, when it is parsed (`Manifest.from_dict` / `load_manifest`): its schema
(schema.py), then every layout rule the schema cannot express (invariants.py), then its own checksum
(sealing.py). After that every offset in it can be trusted by the loader and the runtime. Its records are in
records.py; a manifest read again with the same bytes comes from recent_reads.py. Format version 2 is written;
version 1 (rank files without a header, no checksums of the replicated part) is still read.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, ManifestError
from .draft_layers import DraftLayers, parse_draft, serving_draft
from .invariants import MANIFEST_NAME, check_invariants
from .layout import ENTRY_ALIGNMENT, FILE_ALIGNMENT, NO_CHUNK_ALIGNMENT, Entry, FusedView
from .paths import is_safe_relpath
from .rank_file import header_json_bytes, rank_file_header, rank_file_name
from .recent_reads import RecentReads, collector_paused
from .records import FileRecord, LayerRecord, read_chunk
from .schema import FORMAT, READABLE_VERSIONS, VERSION, manifest_schema, validate_schema
from .sealing import SELF_DIGEST_KEY, UNSEALED, check_seal, seal
from .strict_json import parse_json, read_capped

REPLICATED_INDEX = "model.safetensors.index.json"
# A manifest is a few MB even for thousands of ranks; a larger file is refused unread.
MAX_MANIFEST_BYTES = 256 << 20
# Rank file names have five digits; the manifest's checksums grow with layers × N.
MAX_WORLD_SIZE = 65536

# What other modules import from here (the records, sealing, the schema and the invariants have files of their own).
__all__ = ["FORMAT", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "MAX_WORLD_SIZE", "READABLE_VERSIONS",
           "REPLICATED_INDEX", "SELF_DIGEST_KEY", "VERSION", "FileRecord", "LayerRecord", "Manifest",
           "check_invariants", "check_seal", "is_safe_relpath", "load_manifest", "manifest_schema", "rank_file_name",
           "read_chunk", "read_manifest_at", "read_manifest_file", "seal"]


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
        >>> from shardprep.manifests.rank_file import plan_rank_file
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
        version = validate_schema(data, where)
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
    with collector_paused():
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


def _with_own_dicts(m: Manifest) -> Manifest:
    return replace(m, source=copy.deepcopy(m.source), quantization=copy.deepcopy(m.quantization),
                   selection=copy.deepcopy(m.selection), requant_options=copy.deepcopy(m.requant_options),
                   resharded_from=copy.deepcopy(m.resharded_from))


def _own_result(result: tuple[Manifest, str | None]) -> tuple[Manifest, str | None]:
    return _with_own_dicts(result[0]), result[1]


_recent: RecentReads[tuple[Manifest, str | None]] = RecentReads(_own_result)
