"""`shardprep validate`: check an output directory against its manifest, and optionally against the source.

Every file is read through the strict readers of `shardprep.manifests` (exact reads, safe paths, hostile
JSON, safetensors headers), the same ones the runtime uses, and every safetensors file is also opened
with the safetensors library itself. Everything wrong is a `Problem` with a stable code in the report;
an exception means validation could not run at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, ManifestError, RequantError, ShardprepError
from ..manifests.checksums import HASH_SEED
from ..manifests.exact_read import iter_blocks, pread_exact, read_exact
from ..manifests.layout import chunk_range
from ..manifests.manifest import MANIFEST_NAME, LayerRecord, Manifest, check_invariants, read_manifest_file
from ..manifests.paths import files_under, resolve_inside
from ..manifests.problems import Problem, quoted
from ..manifests.replicated import NOTICE_TENSOR, ReplicatedIndex, check_replicated_file, read_replicated_index
from ..manifests.safetensors_header import SafetensorsHeader, read_safetensors_header
from ..manifests.swap_lock import reads_output
from .output.output_dir import is_staging_dir
from .source import SourceCheckpoint, open_source

REPORT_SCHEMA = "shardprep/validate-report/1"
MAX_PROBLEMS = 200


@dataclass
class ValidationReport:
    """The outcome: `ok` is True when `problems` is empty. `warnings` never make a directory invalid but
    say what could not be verified; `checked` counts what was looked at."""

    directory: str
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)
    format_version: int | None = None
    problem_count: int = 0
    """Every problem found, also those past the MAX_PROBLEMS that `problems` keeps."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def messages(self) -> list[str]:
        """The problems as one-line messages."""
        return [p.message for p in self.problems]

    def add(self, problem: Problem) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    def to_dict(self) -> dict[str, Any]:
        """The `--json` report (schema "shardprep/validate-report/1"; codes in docs/reliability.md)."""
        return {
            "schema": REPORT_SCHEMA,
            "ok": self.ok,
            "directory": self.directory,
            "format_version": self.format_version,
            "problems": [p.to_dict() for p in self.problems],
            "warnings": [w.to_dict() for w in self.warnings],
            "checked": dict(self.checked),
            "problem_count": self.problem_count,
        }


@dataclass
class ByteMeter:
    """Bytes validate has read against the bytes it will read, for a progress bar (`report(done, total)`)."""

    report: Callable[[int, int], None] | None
    total: int = 0
    done: int = 0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.report is not None:
            self.report(self.done, max(self.total, self.done))


@reads_output  # the old output or the new one, never half of each, while --overwrite replaces it
def validate(directory: str | Path, source: str | Path | None = None,
             revision: str | None = None, progress: Callable[[int, int], None] | None = None) -> ValidationReport:
    """Check every invariant and every byte of an output directory; with `source`, compare every target
    and replicated tensor with it.

    A hub repo id as `source` is resolved at the commit the manifest records (`revision` overrides); a
    `source` other than the one the manifest records is named in a `source_not_recorded` warning. Raises
    ShardprepError only when validation cannot run at all (the directory or the source is missing or
    unreadable, or the directory holds no manifest: not an output); everything wrong with the directory
    itself is reported in `problems`. `progress(done, total)` follows the bytes read.

    >>> report = validate("out/", source="my-model/")  # doctest: +SKIP
    >>> assert report.ok, report.messages  # doctest: +SKIP
    """
    root = Path(directory)
    if "\x00" in str(root):
        raise ShardprepError(f"{quoted(str(root))}: a path cannot contain a NUL byte")
    if root.is_file():
        raise ShardprepError(f"{root}: is a file, not an output directory; to check a manifest alone, run "
                             f"`shardprep validate --manifest-only {root}`")
    if not root.is_dir():
        raise ShardprepError(f"{root}: no such directory")
    report = ValidationReport(str(root))
    if is_staging_dir(root):
        report.add(staging_problem(root))
        return report
    if not os.path.lexists(root / MANIFEST_NAME):
        raise ShardprepError(not_an_output(root))
    manifest = checked_manifest(lambda: read_manifest_file(root, check=False), MANIFEST_NAME, report)
    if manifest is None:
        return report
    if manifest.version < 2:
        report.warnings.append(Problem(
            "unverified_replicated_files", "format version 1: the replicated files (index, safetensors, config, "
            "tokenizer) have no checksums, so only their structure was checked; re-run convert for version 2"))
    meter = ByteMeter(progress, manifest.world_size * sum(r.chunk_bytes for r in manifest.layers)
                      + sum(f.size for f in manifest.replicated_files))
    usable = _check_rank_files(root, manifest, report, meter)
    index = _check_replicated(root, manifest, report, meter)
    if source is not None:
        other = other_source(manifest, source)
        if other is not None:
            report.warnings.append(Problem("source_not_recorded", other))
        _check_against_source(root, manifest, index, usable, source, revision, report, meter)
    return report


def not_an_output(root: Path) -> str:
    """Why a directory without a manifest cannot be validated, and, for a checkpoint, the convert to run first."""
    from .selection import presets_for
    from .source import read_config

    if not (root / "config.json").is_file() and not any(root.glob("*.safetensors")):
        return f"{root}: no {MANIFEST_NAME}: not an output directory of `shardprep convert`"
    try:
        model_type = (read_config(root) or {}).get("model_type")
    except ShardprepError:
        model_type = None
    presets = presets_for(model_type if isinstance(model_type, str) else None)
    preset = presets[0].name if len(presets) == 1 else "NAME"
    return (f"{root}: no {MANIFEST_NAME}: a checkpoint, not an output of `shardprep convert`; convert it first "
            f"(`shardprep convert {root} OUT --ranks N --preset {preset}`) and validate OUT")


def other_source(m: Manifest, source: str | Path) -> str | None:
    """A line naming the source the manifest records when `source` is another one (None when it is the same,
    or the manifest records none).

    >>> line = other_source(load_manifest("out/"), "elsewhere/")  # doctest: +SKIP
    """
    recorded = m.source if isinstance(m.source, dict) else {}
    repo_id, path = recorded.get("repo_id"), recorded.get("path")
    given = str(source)
    if repo_id is not None:
        same = given == repo_id
    elif path is not None:
        same = os.path.realpath(given) == os.path.realpath(path)
    else:
        return None
    if same:
        return None
    return f"--source {given} is not the source the manifest records ({repo_id or path})"


def staging_problem(root: Path) -> Problem:
    """What `validate` reports for a staging directory (see docs/reliability.md, "No data lost")."""
    return Problem("staging_directory", f"{root}: a staging directory of an interrupted or unfinished convert, "
                   "not an output; the next convert into its parent removes it")


def checked_manifest(read: Callable[[], tuple[Manifest, str | None]], name: str,
                     report: ValidationReport) -> Manifest | None:
    """Read a manifest with `read` (`read_manifest_file` or `read_manifest_at`, with check=False) and add what
    is wrong with it to `report`, each message starting with `name`.

    Returns the manifest; None when nothing more can be checked: it could not be read, or a problem other
    than its own checksum means its offsets cannot be trusted (reading files by them would only add noise).

    >>> m = checked_manifest(lambda: read_manifest_file("out", check=False), MANIFEST_NAME, report)  # doctest: +SKIP
    """
    try:
        manifest, unsealed = read()
    except ManifestError as exc:
        report.add(Problem(exc.code, str(exc), file=name))
        return None
    report.format_version = manifest.version
    if unsealed:
        report.add(Problem("manifest_checksum_mismatch", f"{name}: {unsealed}", file=name))
    for problem in check_invariants(manifest):
        report.add(Problem(problem.code, f"{name}: {problem.message}", problem.file, problem.layer, problem.tensor))
    if any(p.code != "manifest_checksum_mismatch" for p in report.problems):
        return None
    return manifest


def source_revision(m: Manifest, source: str | Path, revision: str | None) -> str | None:
    """The hub revision to read `source` at: `revision`, or, for the repo id the manifest records, the commit
    (else the revision) it records.

    >>> source_revision(load_manifest("out/"), "org/model", None)  # doctest: +SKIP
    """
    recorded = m.source if isinstance(m.source, dict) else {}
    if revision is None and recorded.get("repo_id") is not None and str(source) == recorded.get("repo_id"):
        return recorded.get("commit") or recorded.get("revision")
    return revision


# -- rank files ----------------------------------------------------------------------------------


def _check_rank_files(root: Path, m: Manifest, report: ValidationReport, meter: ByteMeter) -> set[int]:
    """Check every rank file; returns the ranks whose files can be read by the manifest's offsets."""
    usable = set()
    header = m.rank_header
    for rank, rel in enumerate(m.rank_files):
        try:
            path = resolve_inside(root, rel, what=f"rank {rank}'s file")
        except IntegrityError as exc:
            report.add(Problem.of(exc))
            continue
        if not path.is_file():
            report.add(Problem("rank_file_missing", f"{rel}: rank {rank} file is missing", file=rel))
            continue
        actual = path.stat().st_size
        if actual != m.rank_file_bytes:
            report.add(Problem("rank_file_size", f"{rel}: size is {actual} bytes, manifest says {m.rank_file_bytes}",
                               file=rel))
            continue
        usable.add(rank)
        try:
            _check_one_rank_file(path, rel, rank, m, header, report, meter)
        except IntegrityError as exc:
            report.add(Problem.of(exc))
        except OSError as exc:
            report.add(Problem("unreadable_file", f"{rel}: cannot read ({exc.strerror or exc})", file=rel))
        if header:
            _check_with_library(path, rel, report)
    return usable


def _check_one_rank_file(path: Path, rel: str, rank: int, m: Manifest, header: bytes,
                         report: ValidationReport, meter: ByteMeter) -> None:
    import xxhash

    fd = os.open(path, os.O_RDONLY)
    try:
        if header and read_exact(fd, len(header), 0, rel) != header:
            report.add(Problem("rank_header_mismatch", f"{rel}: its safetensors header is not the one the manifest "
                               "implies (every rank file's header must be these exact bytes)", file=rel))
        at = len(header)
        for r in m.layers:
            if r.file_offset > at and _has_nonzero(fd, at, r.file_offset - at, rel):
                report.add(Problem("nonzero_padding", f"{rel}: non-zero bytes in the file padding before layer "
                                   f"{r.layer}", file=rel, layer=r.layer))
            hasher = xxhash.xxh3_128(seed=HASH_SEED)
            c0, _ = chunk_range(rank, r.chunk_bytes)
            padding = _padding_in_chunk(r, rank)
            bad_padding = None
            for start, piece in iter_blocks(fd, r.file_offset, r.chunk_bytes, rel):
                hasher.update(piece)
                meter.advance(len(piece))
                t0 = c0 + start - r.file_offset  # where this block starts in T
                bad_padding = bad_padding or _nonzero_padding(piece, t0, padding)
            if hasher.hexdigest() != r.checksums[rank]:
                report.add(Problem("checksum_mismatch", f"{rel}: layer {r.layer} chunk checksum mismatch (file "
                                   "corrupt or modified)", file=rel, layer=r.layer))
            if bad_padding:
                a, b = bad_padding
                report.add(Problem("nonzero_padding", f"{rel}: layer {r.layer} padding bytes [{a}, {b}) of T are "
                                   "not zero", file=rel, layer=r.layer))
            report.count("chunks")
            report.count("bytes", r.chunk_bytes)
            at = r.file_offset + r.chunk_bytes
    finally:
        os.close(fd)


def _padding_in_chunk(r: LayerRecord, rank: int) -> list[tuple[int, int]]:
    """Byte ranges of T that belong to no entry (alignment gaps and the tail), clipped to rank's chunk."""
    c0, c1 = chunk_range(rank, r.chunk_bytes)
    ranges, at = [], 0
    for e in sorted(r.entries, key=lambda e: e.offset):
        if e.offset > at:
            ranges.append((at, e.offset))
        at = max(at, e.offset + e.nbytes)
    if at < r.total_bytes:
        ranges.append((at, r.total_bytes))
    return [(max(a, c0), min(b, c1)) for a, b in ranges if max(a, c0) < min(b, c1)]


def _nonzero_padding(piece: memoryview, t0: int, padding: list[tuple[int, int]]) -> tuple[int, int] | None:
    import numpy as np

    t1 = t0 + len(piece)
    arr = np.frombuffer(piece, dtype=np.uint8)
    for a, b in padding:
        lo, hi = max(a, t0), min(b, t1)
        if lo < hi and np.count_nonzero(arr[lo - t0:hi - t0]):
            return a, b
    return None


def _has_nonzero(fd: int, offset: int, nbytes: int, rel: str) -> bool:
    import numpy as np

    return any(np.count_nonzero(np.frombuffer(piece, dtype=np.uint8)) for _, piece in
               iter_blocks(fd, offset, nbytes, rel))


def _check_with_library(path: Path, rel: str, report: ValidationReport) -> None:
    """The safetensors library is the judge of what a safetensors file is: what it refuses is invalid."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except Exception as exc:  # the library raises its own SafetensorError, and OSError
        report.add(Problem("invalid_safetensors", f"{rel}: the safetensors library refuses it "
                           f"({' '.join(str(exc).split())[:200]})", file=rel))
    report.count("safetensors_files_opened")


# -- the replicated part -------------------------------------------------------------------------


def _check_replicated(root: Path, m: Manifest, report: ValidationReport, meter: ByteMeter) -> ReplicatedIndex | None:
    sizes = {f.path: f.size for f in m.replicated_files}
    meter.advance(sizes.get(m.replicated_index, 0))
    readable = True
    try:
        check_replicated_file(root, m, m.replicated_index, verify=True)
    except IntegrityError as exc:
        report.add(Problem.of(exc))
        # Parsed even when its bytes are not the manifest's, so that what is wrong in it is named too; an
        # index that cannot be read at all (missing, unsafe path, unlisted) is reported once, here.
        readable = exc.code in ("checksum_mismatch", "file_size")
    index: ReplicatedIndex | None = None
    problems: list[Problem] = []
    if readable:
        try:
            index, problems = read_replicated_index(root, m, verify=False)
        except IntegrityError as exc:
            report.add(Problem.of(exc))
    for p in problems:
        report.add(p)
    checked: set[str] = {m.replicated_index}
    for name in index.files() if index else []:
        checked.add(name)
        header = _checked_safetensors(root, m, name, report)
        meter.advance(sizes.get(name, 0))
        if header is None:
            continue
        expected = index.tensors_of(name) if index else set()
        for t in sorted(expected - set(header.tensors)):
            report.add(Problem("index_mismatch", f"{name}: does not hold {quoted(t)}, which {m.replicated_index} "
                               "maps to it", file=name, tensor=t))
        for t in sorted(set(header.tensors) - expected):
            report.add(Problem("index_mismatch", f"{name}: holds {quoted(t)}, which {m.replicated_index} does not "
                               "list", file=name, tensor=t))
        report.count("replicated_files")
    if index:
        report.count("replicated_tensors", len(index.weight_map))
    if m.version >= 2:
        for record in m.replicated_files:
            if record.path in checked:
                continue
            if record.path.endswith(".safetensors"):
                _checked_safetensors(root, m, record.path, report)
            else:
                try:
                    check_replicated_file(root, m, record.path, verify=True)
                except IntegrityError as exc:
                    report.add(Problem.of(exc))
            meter.advance(record.size)
            report.count("other_files")
        _check_unlisted(root, m, report)
    return index


def _checked_safetensors(root: Path, m: Manifest, name: str, report: ValidationReport) -> SafetensorsHeader | None:
    try:
        path = check_replicated_file(root, m, name, verify=True)
        header = read_safetensors_header(path)
    except IntegrityError as exc:
        report.add(Problem.of(exc))
        return None
    _check_with_library(path, name, report)
    return header


def _check_unlisted(root: Path, m: Manifest, report: ValidationReport) -> None:
    """A file in OUT that the manifest does not list has no checksum: a loader could read unverified bytes."""
    listed = {MANIFEST_NAME, *m.rank_files, *(f.path for f in m.replicated_files)}
    for rel in files_under(root):
        if rel not in listed:
            report.add(Problem("unlisted_file", f"{rel}: not listed in the manifest (no checksum); remove it or "
                               "re-run convert", file=rel))


# -- against the source --------------------------------------------------------------------------


def _check_against_source(root: Path, m: Manifest, index: ReplicatedIndex | None, usable: set[int],
                          source: str | Path, revision: str | None, report: ValidationReport,
                          meter: ByteMeter) -> None:
    ckpt = open_source(source, source_revision(m, source, revision))
    for sf in ckpt.files.values():
        _check_with_library(sf.path, str(sf.path), report)
    weight_map = index.weight_map if index else {}
    src_names = set(ckpt.tensors)
    targets = set(m.target_names())
    for name in sorted(src_names - targets - set(weight_map)):
        report.add(Problem("source_tensor_missing", f"source tensor {quoted(name)} is neither a target nor in "
                           f"{m.replicated_index}", tensor=name))
    notice = {NOTICE_TENSOR} if m.version >= 2 else set()
    for name in sorted((targets | set(weight_map)) - src_names - notice):
        report.add(Problem("tensor_not_in_source", f"tensor {quoted(name)} is not in the source {source}",
                           tensor=name))
    from .requant_jobs import reference_runner

    try:
        runner = reference_runner(ckpt, m)
    except RequantError as exc:
        report.add(Problem("requant_mismatch", str(exc)))
        return
    overrides = {name: runner.producer(name) for name in runner.plan.specs()} if runner else {}
    # What is read below: every layer's T from the rank files and its targets from the source, then each
    # replicated tensor from OUT and from the source.
    meter.total += sum(r.total_bytes + sum(e.nbytes for e in r.entries) for r in m.layers)
    meter.total += 2 * sum(ckpt.tensors[name].nbytes for name in weight_map if name in ckpt.tensors)
    if usable == set(range(m.world_size)):
        _compare_targets(root, m, ckpt, overrides, report, meter)
    else:
        report.add(Problem("source_check_skipped", f"targets not compared with the source: "
                           f"{m.world_size - len(usable)} rank file(s) missing or of the wrong size"))
    _compare_replicated(root, weight_map, ckpt, overrides, report, meter)


def _compare_targets(root: Path, m: Manifest, ckpt: SourceCheckpoint, overrides: dict[str, Callable[[], Any]],
                     report: ValidationReport, meter: ByteMeter) -> None:
    for r in m.layers:
        flat = bytearray(r.total_bytes)
        view = memoryview(flat)
        try:
            # One rank file open at a time, whatever N.
            for rank, rel in enumerate(m.rank_files):
                fd = os.open(root / rel, os.O_RDONLY)
                try:
                    lo, hi = chunk_range(rank, r.chunk_bytes)
                    pread_exact(fd, view[lo:hi], r.file_offset, rel)
                finally:
                    os.close(fd)
        except IntegrityError as exc:
            report.add(Problem.of(exc))
            continue
        meter.advance(r.total_bytes)
        for e in r.entries:
            meter.advance(e.nbytes)
            if e.name not in ckpt.tensors:
                continue
            report.count("target_tensors_compared")
            t = ckpt.tensors[e.name]
            if e.name not in overrides and (t.dtype, tuple(t.shape)) != (e.dtype, tuple(e.shape)):
                report.add(Problem("tensor_mismatch", f"tensor {quoted(e.name)}: manifest says {e.dtype}"
                                   f"{list(e.shape)}, source has {t.dtype}{list(t.shape)}", layer=r.layer,
                                   tensor=e.name))
                continue
            expected = _expected_bytes(ckpt, overrides, e.name, report)
            if expected is not None and view[e.offset:e.offset + e.nbytes] != expected:
                report.add(Problem("target_bytes_differ", f"tensor {quoted(e.name)}: bytes rebuilt from the rank "
                                   "files differ from the source", layer=r.layer, tensor=e.name))


def _compare_replicated(root: Path, weight_map: dict[str, str], ckpt: SourceCheckpoint,
                        overrides: dict[str, Callable[[], Any]], report: ValidationReport, meter: ByteMeter) -> None:
    headers: dict[str, SafetensorsHeader | None] = {}
    for name, fname in sorted(weight_map.items(), key=lambda item: item[1]):
        if name not in ckpt.tensors:
            continue
        meter.advance(2 * ckpt.tensors[name].nbytes)
        if fname not in headers:
            try:
                headers[fname] = read_safetensors_header(resolve_inside(root, fname))
            except IntegrityError:
                headers[fname] = None  # already reported with the replicated part
        header = headers[fname]
        if header is None or name not in header.tensors:
            continue
        info = header.tensors[name]
        fd = os.open(root / fname, os.O_RDONLY)
        try:
            got = read_exact(fd, info.nbytes, header.data_start + info.begin, fname)
        finally:
            os.close(fd)
        report.count("replicated_tensors_compared")
        expected = _expected_bytes(ckpt, overrides, name, report)
        if expected is not None and got != expected:
            report.add(Problem("replicated_bytes_differ", f"{fname}: tensor {quoted(name)} differs from the source",
                               file=fname, tensor=name))


def _expected_bytes(ckpt: SourceCheckpoint, overrides: dict[str, Callable[[], Any]], name: str,
                    report: ValidationReport) -> bytes | None:
    """What the output must hold for a source tensor: its recomputed requant, or its source bytes.

    None (and a problem) when the requant the manifest records refuses the source tensor: then the output
    cannot have been made from this source with those options.
    """
    if name not in overrides:
        return ckpt.read_tensor(name)
    try:
        return bytes(overrides[name]())
    except RequantError as exc:
        report.add(Problem("requant_mismatch", f"{exc} (recomputing the requantization the manifest records)",
                           tensor=name))
        return None
