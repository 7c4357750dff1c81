"""`shardprep validate`: check an output directory against its manifest, and optionally against the source."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from ..errors import ManifestError, ShardprepError, SourceError
from ..manifests.layout import chunk_range
from ..manifests.manifest import MANIFEST_NAME, Manifest, check_invariants, is_safe_relpath, load_manifest
from .output_dir import is_staging_dir
from .source import open_source, read_safetensors_header

MAX_PROBLEMS = 200


@dataclass
class ValidationReport:
    """The outcome: `ok` is True when `problems` is empty. `checked` counts what was looked at."""

    directory: str
    problems: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


def validate(directory: str | Path, source: str | Path | None = None) -> ValidationReport:
    """Check every invariant of an output directory; with `source`, compare every target byte with it.

    Raises ShardprepError only when validation cannot run at all (the directory or the source is
    missing); everything wrong with the directory itself is reported in `problems`.

    >>> report = validate("out/", source="my-model/")  # doctest: +SKIP
    >>> assert report.ok, report.problems  # doctest: +SKIP
    """
    root = Path(directory)
    if not root.is_dir():
        raise ShardprepError(f"{root}: no such directory")
    report = ValidationReport(str(root))
    if is_staging_dir(root):
        report.add(f"{root}: a staging directory of an interrupted or unfinished convert, not an output; "
                   "the next convert into its parent removes it")
        return report
    try:
        manifest = load_manifest(root, check=False)
    except ManifestError as exc:
        report.add(str(exc))
        return report
    for problem in check_invariants(manifest):
        report.add(f"{MANIFEST_NAME}: {problem}")
    if not report.ok:
        return report  # offsets cannot be trusted: reading files by them would only add noise
    _check_rank_files(root, manifest, report)
    weight_map = _check_replicated(root, manifest, report)
    if source is not None:
        _check_against_source(root, manifest, weight_map, source, report)
    return report


def _inside(root: Path, rel: str, report: ValidationReport) -> Path | None:
    path = root / rel
    if not is_safe_relpath(rel) or not path.resolve().is_relative_to(root.resolve()):
        report.add(f"{rel}: path leaves the output directory")
        return None
    return path


def _check_rank_files(root: Path, m: Manifest, report: ValidationReport) -> None:
    size = m.rank_file_bytes
    for rank, rel in enumerate(m.rank_files):
        path = _inside(root, rel, report)
        if path is None:
            continue
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            report.add(f"{rel}: rank {rank} file is missing")
            continue
        if actual != size:
            report.add(f"{rel}: size is {actual} bytes, manifest says {size}")
            continue
        with open(path, "rb") as f:
            at = 0
            for r in m.layers:
                if r.file_offset > at:
                    gap = os.pread(f.fileno(), r.file_offset - at, at)
                    if gap.count(0) != len(gap):
                        report.add(f"{rel}: non-zero bytes in the file padding before layer {r.layer}")
                chunk = os.pread(f.fileno(), r.chunk_bytes, r.file_offset)
                at = r.file_offset + r.chunk_bytes
                if r.checksums and xxhash.xxh3_128_hexdigest(chunk) != r.checksums[rank]:
                    report.add(f"{rel}: layer {r.layer} chunk checksum mismatch (file corrupt or modified)")
                report.count("chunks")
                report.count("bytes", len(chunk))
                c0, c1 = chunk_range(rank, r.chunk_bytes)
                for lo, hi in _padding_ranges(r):
                    a, b = max(lo, c0), min(hi, c1)
                    if a < b:
                        piece = chunk[a - c0:b - c0]
                        if piece.count(0) != len(piece):
                            report.add(f"{rel}: layer {r.layer} padding bytes [{a}, {b}) of T are not zero")


def _padding_ranges(r) -> list[tuple[int, int]]:
    """Byte ranges of T that belong to no entry: alignment gaps and the tail."""
    ranges, at = [], 0
    for e in sorted(r.entries, key=lambda e: e.offset):
        if e.offset > at:
            ranges.append((at, e.offset))
        at = e.offset + e.nbytes
    if at < r.total_bytes:
        ranges.append((at, r.total_bytes))
    return ranges


def _check_replicated(root: Path, m: Manifest, report: ValidationReport) -> dict[str, str]:
    index_path = _inside(root, m.replicated_index, report)
    if index_path is None:
        return {}
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except FileNotFoundError:
        report.add(f"{m.replicated_index}: replicated index is missing")
        return {}
    except (json.JSONDecodeError, KeyError, TypeError):
        report.add(f"{m.replicated_index}: not a valid safetensors index")
        return {}
    targets = set(m.target_names())
    for name in sorted(targets & set(weight_map)):
        report.add(f"tensor {name!r} is both a target and in {m.replicated_index}")
    for fname in sorted(set(weight_map.values())):
        path = _inside(root, fname, report)
        if path is None:
            continue
        try:
            header, _, _ = read_safetensors_header(path)
        except SourceError as exc:
            report.add(str(exc))
            continue
        expected = {t for t, f in weight_map.items() if f == fname}
        for t in sorted(expected - set(header)):
            report.add(f"{fname}: does not hold {t!r}, which {m.replicated_index} maps to it")
        for t in sorted(set(header) - expected):
            report.add(f"{fname}: holds {t!r}, which {m.replicated_index} does not list")
        report.count("replicated_files")
    report.count("replicated_tensors", len(weight_map))
    return weight_map


def _check_against_source(root: Path, m: Manifest, weight_map: dict[str, str], source, report: ValidationReport):
    ckpt = open_source(source)
    src_names = set(ckpt.tensors)
    targets = set(m.target_names())
    for name in sorted(src_names - targets - set(weight_map)):
        report.add(f"source tensor {name!r} is neither a target nor in {m.replicated_index}")
    for name in sorted((targets | set(weight_map)) - src_names):
        report.add(f"tensor {name!r} is not in the source {source}")
    from .requant_jobs import reference_runner

    runner = reference_runner(ckpt, m)
    overrides = {name: runner.producer(name) for name in runner.plan.specs()} if runner else {}
    fds = [os.open(root / rel, os.O_RDONLY) for rel in m.rank_files]
    try:
        for r in m.layers:
            flat = b"".join(os.pread(fd, r.chunk_bytes, r.file_offset) for fd in fds)
            for e in r.entries:
                if e.name not in ckpt.tensors:
                    continue
                got = flat[e.offset:e.offset + e.nbytes]
                report.count("target_tensors_compared")
                t = ckpt.tensors[e.name]
                if e.name not in overrides and (t.dtype, tuple(t.shape)) != (e.dtype, tuple(e.shape)):
                    report.add(f"tensor {e.name!r}: manifest says {e.dtype}{list(e.shape)}, "
                               f"source has {t.dtype}{list(t.shape)}")
                    continue
                if got != _expected_bytes(ckpt, overrides, e.name):
                    report.add(f"tensor {e.name!r}: bytes rebuilt from the rank files differ from the source")
    finally:
        for fd in fds:
            os.close(fd)
    _check_replicated_bytes(root, weight_map, ckpt, overrides, report)


def _check_replicated_bytes(root: Path, weight_map: dict[str, str], ckpt, overrides, report: ValidationReport):
    headers: dict[str, tuple[dict, int]] = {}
    for name, fname in weight_map.items():
        if name not in ckpt.tensors:
            continue
        if fname not in headers:
            try:
                header, _, start = read_safetensors_header(root / fname)
            except SourceError:
                continue  # already reported by _check_replicated
            headers[fname] = (header, start)
        header, start = headers[fname]
        if name not in header:
            continue
        b, e = header[name]["data_offsets"]
        with open(root / fname, "rb") as f:
            got = os.pread(f.fileno(), e - b, start + b)
        report.count("replicated_tensors_compared")
        if got != _expected_bytes(ckpt, overrides, name):
            report.add(f"{fname}: tensor {name!r} differs from the source")


def _expected_bytes(ckpt, overrides, name: str) -> bytes:
    """What the output must hold for a source tensor: its recomputed requant, or its source bytes."""
    return bytes(overrides[name]()) if name in overrides else ckpt.read_tensor(name)
