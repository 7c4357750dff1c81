"""The replicated part of an output directory, read strictly: the index, its sentinel, every file's checksum.

One reader for the runtime (`RankShards.load_replicated`) and for `validate`. The index
`model.safetensors.index.json` maps every non-target tensor to its safetensors file, and (version 2)
every target to `SHARDED_SENTINEL`, a file that does not exist: transformers' `from_pretrained(OUT)`
then fails naming it instead of silently initialising the targets at random. `NOTICE_FILE` exists and
holds one tensor, `NOTICE_TENSOR`, so a loader that globs `*.safetensors` (vLLM, SGLang) fails naming
it too. shardprep's readers skip both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import IntegrityError
from .checksums import digest, file_digest
from .manifest import Manifest
from .paths import is_safe_relpath, resolve_inside
from .problems import Problem, quoted
from .strict_json import parse_json, read_capped

SHARDED_SENTINEL = "TARGETS-ARE-SHARDED-see-shard_manifest.json-load-with-shardprep.safetensors"
NOTICE_FILE = "TARGETS-ARE-SHARDED-README.safetensors"
# No dots: loaders split tensor names on them, and the whole sentence should reach the error message.
NOTICE_TENSOR = "TARGETS-ARE-SHARDED-see-shard_manifest_json-load-this-directory-with-shardprep"
NOTICE_TEXT = (
    "Written by shardprep. The tensors that model.safetensors.index.json maps to "
    f"{SHARDED_SENTINEL} are sharded across shards/rank-*.safetensors (see shard_manifest.json and "
    "docs/format.md); a plain loader would leave them uninitialised. Load this directory with shardprep "
    "(shardprep.standalone.hf_model.build_model, or open_rank and LayerGatherer)."
)
# An index lists every tensor once: about 100 bytes each, so this allows millions of tensors.
MAX_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class ReplicatedIndex:
    """The index of the replicated part: tensor → file, for every non-target tensor and the notice tensor."""

    weight_map: dict[str, str]
    metadata: dict[str, Any]

    def files(self) -> list[str]:
        """Every safetensors file the index names (the notice file included, the sentinel not)."""
        return sorted(self._by_file)

    def tensors_of(self, file: str) -> set[str]:
        return set(self._by_file.get(file, ()))

    @cached_property
    def _by_file(self) -> dict[str, list[str]]:
        # Grouped once: a loader asks for every file's tensors, and a scan per file is files × tensors.
        by_file: dict[str, list[str]] = {}
        for tensor, file in self.weight_map.items():
            by_file.setdefault(file, []).append(tensor)
        return by_file


def read_replicated_index(root: str | Path, manifest: Manifest, *,
                          verify: bool = True) -> tuple[ReplicatedIndex, list[Problem]]:
    """Read the index strictly; return it with what is wrong with its mapping (empty when all is well).

    Raises IntegrityError when the index cannot be used at all: missing, unsafe path, too large, not JSON,
    no `weight_map` of strings, or (with `verify`, version 2) a checksum that does not match the manifest.
    The problems returned: a target listed as replicated, a target missing from the sentinel, a
    non-target mapped to the sentinel, a file path that leaves the directory, the notice missing.

    >>> index, problems = read_replicated_index("out/", load_manifest("out/"))  # doctest: +SKIP
    """
    rel = manifest.replicated_index
    path = resolve_inside(root, rel, what="index")
    raw = read_capped(path, max_bytes=MAX_INDEX_BYTES, what="safetensors index")
    record = manifest.file_record(rel)
    if manifest.version >= 2:
        if record is None:
            raise IntegrityError(f"{rel}: the manifest has no checksum for the index", code="unlisted_file",
                                 file=rel)
        if verify:
            _check_digest(rel, len(raw), digest(raw), record.size, record.xxh3_128)
    data = parse_json(raw, rel)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    metadata = data.get("metadata") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise IntegrityError(f"{rel}: not a safetensors index (needs a 'weight_map' of tensor name → file name)",
                             code="invalid_index", file=rel)
    if metadata is not None and not isinstance(metadata, dict):
        raise IntegrityError(f"{rel}: 'metadata' must be an object", code="invalid_index", file=rel)
    return _split_index(rel, weight_map, metadata or {}, manifest)


def _split_index(rel: str, weight_map: dict[str, str], metadata: dict[str, Any],
                 manifest: Manifest) -> tuple[ReplicatedIndex, list[Problem]]:
    problems: list[Problem] = []
    targets = set(manifest.target_names())
    v2 = manifest.version >= 2
    sharded = {t for t, f in weight_map.items() if f == SHARDED_SENTINEL} if v2 else set()
    real = {t: f for t, f in weight_map.items() if not (v2 and f == SHARDED_SENTINEL)}
    for name in sorted(targets & set(real)):
        problems.append(Problem("target_in_index", f"tensor {quoted(name)} is both a target and mapped to "
                                f"{quoted(real[name])} in {rel}", file=rel, tensor=name))
    if v2:
        for name in sorted(targets - sharded - set(real)):
            problems.append(Problem("index_mismatch", f"{rel}: target {quoted(name)} is not mapped to the "
                                    f"sentinel {SHARDED_SENTINEL}", file=rel, tensor=name))
        for name in sorted(sharded - targets):
            problems.append(Problem("index_mismatch", f"{rel}: tensor {quoted(name)} is mapped to the sentinel "
                                    "but is not a target", file=rel, tensor=name))
        if real.get(NOTICE_TENSOR) != NOTICE_FILE:
            problems.append(Problem("index_mismatch", f"{rel}: does not map {NOTICE_TENSOR} to {NOTICE_FILE}",
                                    file=rel))
    for file in sorted(set(real.values())):
        if not is_safe_relpath(file):
            problems.append(Problem("unsafe_path", f"{rel}: file {quoted(file)} is absolute or leaves the "
                                    "output directory", file=rel))
            real = {t: f for t, f in real.items() if f != file}
    return ReplicatedIndex(real, metadata), problems


def check_replicated_file(root: str | Path, manifest: Manifest, rel: str, *, verify: bool = True) -> Path:
    """The path of a replicated file after checking it: safe path, exists, listed in the manifest with its
    size (version 2), and with `verify` its XXH3-128. Raises IntegrityError naming the file otherwise.

    >>> check_replicated_file("out/", manifest, "model-00001-of-00002.safetensors")  # doctest: +SKIP
    """
    path = resolve_inside(root, rel)
    if not path.is_file():
        raise IntegrityError(f"{rel}: listed in the output but missing; copy the whole output directory",
                             code="missing_file", file=rel)
    if manifest.version < 2:
        return path
    record = manifest.file_record(rel)
    if record is None:
        raise IntegrityError(f"{rel}: not listed in the manifest's replicated_files (no checksum)",
                             code="unlisted_file", file=rel)
    try:
        size = path.stat().st_size
        if size != record.size:
            raise IntegrityError(f"{rel}: {size} bytes, the manifest says {record.size}", code="file_size",
                                 file=rel)
        if verify:
            size, got = file_digest(path)
            _check_digest(rel, size, got, record.size, record.xxh3_128)
    except OSError as exc:
        raise IntegrityError(f"{rel}: cannot read ({exc.strerror or exc})", code="unreadable_file",
                             file=rel) from None
    return path


def _check_digest(rel: str, size: int, got: str, want_size: int, want: str) -> None:
    if size != want_size:
        raise IntegrityError(f"{rel}: {size} bytes, the manifest says {want_size}", code="file_size", file=rel)
    if got != want:
        raise IntegrityError(f"{rel}: checksum {got} does not match the manifest's {want} (file corrupt or "
                             "modified; copy it again)", code="checksum_mismatch", file=rel)
