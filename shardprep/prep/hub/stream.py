"""`convert` of a hub repo id with bounded disk: the shard files are fetched as the writer needs them, each dropped
once no layer still to be written reads it, so the disk holds the output plus the files of a layer or two, not the
whole source beside the output.

The writer writes the layers in order (`writer.write_plan`). Before each layer, `HubFeed.before_layer` drops the
files that no later layer reads (after writing each one's replicated part: its non-target tensors, or the whole file
hard-linked) and fetches the files this layer reads. Files that no layer reads are fetched, written and dropped one
at a time before the first layer. config.json, the tokenizer and the other small files are fetched first and kept.

Every file comes through `http.py`'s bounded client, at the commit the headers were read at, into a `.part` file
that takes its name only once its size and checksum are right: the sha256 the hub lists for an LFS file
(`lfs.oid` in the hub's file list), the git blob id for any other. A mismatch is one SourceError naming the file;
the fetch directory and the staging directory are removed, and OUT is untouched.

[Note: why not hf_hub_download] It writes into the HF cache (or a `local_dir` with its own metadata), retries and
waits as its session does (see `http.py`), and does not check what it fetched against the sha256 it is given. The
bounded client already reads this hub for `plan`; a whole-file download is one more kind of read for it, with its
time bound scaled by the file's size.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import IntegrityError, SourceError
from ...manifests.checksums import digest
from ...manifests.layout import chunk_range
from ...manifests.manifest import rank_file_name
from ...manifests.paths import is_safe_relpath
from ...manifests.records import LayerRecord
from ...manifests.strict_json import parse_json
from ..convert_plan import ConvertPlan, ReplicatedFile
from ..header_source import open_hub_headers
from ..output.writer import disk_bytes
from ..source import INDEX_NAME, SourceCheckpoint
from .cache import SNAPSHOT_PATTERNS
from .http import HubReader

FETCH_SUFFIX = ".shardprep-source"
"""The fetch directory is OUT's hidden sibling, `.OUT.shardprep-source`: on OUT's filesystem, so that a file taken
over whole is hard-linked into the output and costs no second copy."""
MAX_LIST_BYTES = 64 << 20
MAX_LIST_PAGES = 100
"""The hub pages a long file list (a `Link` header names the next page); a model repo has a few hundred files."""


@dataclass(frozen=True)
class RepoFile:
    """One file in the hub's list of a repo at a commit: its size and the checksum it must have."""

    path: str
    size: int
    sha256: str | None
    """An LFS file's sha256 (the hub's `lfs.oid`); None for a file kept in git."""
    git_oid: str
    """The git blob id, sha1 of `blob <size>\\0` + the bytes: what a file kept in git is checked against."""

    def new_hasher(self) -> Any:
        """A hash of what the file's checksum is of, fed nothing yet: sha256, or git's sha1 after its blob header."""
        return hashlib.sha256() if self.sha256 else hashlib.sha1(b"blob %d\0" % self.size)


def fetch_dir_for(out: Path) -> Path:
    """Where a hub conversion into `out` keeps the source files it has fetched.

    >>> fetch_dir_for(Path("models/out"))
    PosixPath('models/.out.shardprep-source')
    """
    return out.parent / f".{out.name}{FETCH_SUFFIX}"


def list_repo_files(reader: HubReader, commit: str) -> dict[str, RepoFile]:
    """Every file of the repo at `commit`, from the hub's file list (`/api/models/REPO/tree/COMMIT`).

    >>> files = list_repo_files(HubReader("deepseek-ai/DeepSeek-V3"), commit)  # doctest: +SKIP
    >>> files["model-00001-of-000163.safetensors"].sha256  # doctest: +SKIP
    """
    where = f"{reader.repo_id} (the hub's file list at {commit})"
    repo = urllib.parse.quote(reader.repo_id, safe="/")
    page: str | None = f"models/{repo}/tree/{commit}?recursive=true"
    files: dict[str, RepoFile] = {}
    for _ in range(MAX_LIST_PAGES):
        if page is None:
            return files
        body = reader.fetch_api(page, MAX_LIST_BYTES)
        if body is None:
            raise SourceError(f"{where}: the hub has no file list for it; is HF_ENDPOINT a Hugging Face hub?")
        try:
            entries = parse_json(body.data, where)
        except IntegrityError as exc:
            raise SourceError(str(exc)) from None
        if not isinstance(entries, list):
            raise SourceError(f"{where}: not a list of files")
        for entry in entries:
            if not (isinstance(entry, dict) and entry.get("type") == "directory"):
                files[_checked_entry(entry, where)] = _repo_file(entry)
        page = body.next_page
    raise SourceError(f"{where}: more than {MAX_LIST_PAGES} pages; is it a model repository?")


def _checked_entry(entry: Any, where: str) -> str:
    ok = (isinstance(entry, dict) and isinstance(entry.get("path"), str) and _is_size(entry.get("size"))
          and isinstance(entry.get("oid"), str))
    lfs = entry.get("lfs") if ok else None
    if ok and lfs is not None:
        ok = isinstance(lfs, dict) and isinstance(lfs.get("oid"), str) and lfs.get("size") == entry["size"]
    if not ok:
        raise SourceError(f"{where}: an entry that is not a file with a path, a size and a checksum: "
                          f"{json.dumps(entry)[:200]}")
    if not is_safe_relpath(entry["path"]):
        raise SourceError(f"{where}: file {entry['path']!r} is outside the model directory")
    return str(entry["path"])


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _repo_file(entry: dict[str, Any]) -> RepoFile:
    lfs = entry.get("lfs")
    return RepoFile(entry["path"], entry["size"], lfs["oid"].lower() if lfs else None, entry["oid"].lower())


@dataclass
class HubSource:
    """A hub repo opened for a streamed convert: its checkpoint (headers read by range, every file's path in
    `fetch_dir`, where none is yet) and the hub's list of its files."""

    reader: HubReader
    checkpoint: SourceCheckpoint
    files: dict[str, RepoFile]
    fetch_dir: Path

    def disk_bytes_needed(self, plan: ConvertPlan) -> int:
        """What the output needs on disk (every file carried whole counted: its fetched copy becomes the output's)
        plus the largest set of source files that one layer keeps on disk at once.

        >>> source.disk_bytes_needed(plan)  # doctest: +SKIP
        """
        ckpt = plan.source
        total = plan.world_size * disk_bytes(plan.rank_file_bytes)
        for f in plan.replicated:
            sf = ckpt.files[f.name]
            if f.tensors is None:
                total += disk_bytes(sf.size)
            elif f.tensors:
                header = min(ckpt.tensors[name].start for name in sf.tensors)
                total += disk_bytes(header + sum(t.nbytes for t in f.tensors))
        total += sum(disk_bytes(self.files[rel].size) for rel in plan.other_files)
        total += disk_bytes(1024 * (len(ckpt.tensors) + 16))  # the index and the manifest
        live = _LiveFiles(plan)
        return total + max((sum(disk_bytes(ckpt.files[n].size) for n in live.needed_at(i))
                            for i in range(len(plan.layouts))), default=0)

    def feed(self, plan: ConvertPlan) -> HubFeed:
        """What `write_plan` calls to have each file on disk while a layer reads it. An interrupted conversion of
        the same plan at the same commit is resumed from `fetch_dir`; anything else there is removed first."""
        state = _ResumeState.load(self.fetch_dir, plan)
        if state is None:
            if self.fetch_dir.exists():  # another plan's, or a run's from before it recorded anything
                shutil.rmtree(self.fetch_dir)
            self.fetch_dir.mkdir()
            state = _ResumeState(self.fetch_dir, plan, [], {})
        for part in self.fetch_dir.rglob("*.part"):  # a killed run's half-fetched file: fetched again
            part.unlink()
        return HubFeed(self, plan, state)

    def fetch(self, name: str) -> int:
        """Fetch file `name` into `fetch_dir`, checked against the hub's checksum; its size."""
        entry = self.files[name]
        dest = self.fetch_dir / name
        part = dest.with_name(dest.name + ".part")
        dest.parent.mkdir(parents=True, exist_ok=True)
        hasher = entry.new_hasher()
        with open(part, "wb") as f:
            def restart() -> None:
                nonlocal hasher
                hasher = entry.new_hasher()
                f.seek(0)
                f.truncate()

            def sink(chunk: bytes) -> None:
                hasher.update(chunk)
                f.write(chunk)
            body = self.reader.download(name, self.checkpoint.commit or "", entry.size, sink, restart)
            f.flush()
            os.fsync(f.fileno())  # a file under its name is whole and checked, after a crash too: a resume uses it
        if body is None:
            part.unlink()
            raise SourceError(f"{self.reader.repo_id}/{name}: in the hub's file list, but the hub does not have it")
        expected = entry.sha256 or entry.git_oid
        if hasher.hexdigest() != expected:
            part.unlink()
            kind = "sha256" if entry.sha256 else "git blob id"
            raise SourceError(f"{self.reader.repo_id}/{name}: the fetched bytes' {kind} is {hasher.hexdigest()}, the "
                              f"hub lists {expected}; refused (corrupted in transit, or the file changed)")
        os.replace(part, dest)
        return entry.size

    def close(self, *, keep: bool) -> None:
        """Close the reader's connections; remove the fetch directory unless `keep` (what a failed run has
        converted, for the next run to resume from; a file half-fetched is never kept)."""
        self.reader.close()
        if not keep:
            shutil.rmtree(self.fetch_dir, ignore_errors=True)
        elif self.fetch_dir.is_dir():
            for part in self.fetch_dir.rglob("*.part"):
                part.unlink()


def check_requant_pairs(plan: ConvertPlan) -> None:
    """Refuse, in one line, a requantized weight whose scale sits in another file: each file is on disk only while
    its own layers and replicated part are written, and the requant reads a weight and its scale together.

    >>> check_requant_pairs(plan)  # doctest: +SKIP
    """
    for name, job in (plan.requant.jobs.items() if plan.requant else ()):
        if job.weight.file != job.scale.file:
            raise SourceError(f"{plan.source.repo_id}: tensor {name!r} is in {job.weight.file} and its scale in "
                              f"{job.scale.file}; a conversion fetched a file at a time requantizes a weight only "
                              "beside its scale: add --keep-source (or --requant none)")


def open_hub_source(repo_id: str, revision: str | None, out: Path) -> HubSource:
    """The repo at `revision` opened for a streamed convert into `out`: headers by range, the file list, each
    shard's size checked against the list; nothing written yet.

    >>> source = open_hub_source("Qwen/Qwen3-30B-A3B", None, Path("out"))  # doctest: +SKIP
    """
    reader = HubReader(repo_id)
    try:
        ckpt = open_hub_headers(reader, revision)
        assert ckpt.commit is not None  # open_hub_headers refuses an answer without one
        files = list_repo_files(reader, ckpt.commit)
    except BaseException:
        reader.close()
        raise
    fetch_dir = fetch_dir_for(Path(os.path.abspath(out)))
    for name, sf in ckpt.files.items():
        listed = files.get(name)
        if listed is None or listed.size != sf.size:
            reader.close()
            said = "is not in" if listed is None else f"has {listed.size} bytes in"
            raise SourceError(f"{repo_id}/{name}: {sf.size} bytes by its header and the hub's answer, but it {said} "
                              "the hub's file list")
    other = sorted(p for p in files if p not in ckpt.files and p != INDEX_NAME and not p.endswith(".safetensors")
                   and any(fnmatch.fnmatch(p, pattern) for pattern in SNAPSHOT_PATTERNS))
    streamed = replace(ckpt, root=fetch_dir, other_files=other,
                       files={n: replace(sf, path=fetch_dir / n) for n, sf in ckpt.files.items()})
    return HubSource(reader, streamed, files, fetch_dir)


class _LiveFiles:
    """Which source files each layer reads, and the last layer that reads each (-1: none does)."""

    def __init__(self, plan: ConvertPlan) -> None:
        tensors = plan.source.tensors
        self.reads = [sorted({tensors[e.name].file for e in lay.entries}) for lay in plan.layouts]
        self.last = {name: -1 for name in plan.source.files}
        for i, names in enumerate(self.reads):
            for name in names:
                self.last[name] = i

    def needed_at(self, layer_index: int) -> set[str]:
        """The files on disk while layer `layer_index` is written: those it reads."""
        return set(self.reads[layer_index])


class _ResumeState:
    """What a conversion has written so far, recorded in `fetch_dir` so that an interrupted run resumes: the
    rank files (hard links to the staging directory's, which the next run's staging takes back), each finished
    layer's chunk checksums, and the replicated files written. `progress.json`, replaced atomically after each
    layer, is the record; it counts only for the same plan at the same commit (`key`)."""

    RECORD = "progress.json"
    SAVED = "written"

    def __init__(self, fetch_dir: Path, plan: ConvertPlan, layers: list[tuple[str, ...]],
                 files: dict[str, tuple[bool, list[str]] | None]) -> None:
        self.fetch_dir, self.plan, self.layers, self.files = fetch_dir, plan, layers, files
        self.saved = fetch_dir / self.SAVED

    @staticmethod
    def key(plan: ConvertPlan) -> str:
        ckpt = plan.source
        facts = {"repo": ckpt.repo_id, "commit": ckpt.commit, "plan": plan.describe(),
                 "header": hashlib.sha256(plan.rank_header).hexdigest(), "offsets": list(plan.file_offsets)}
        return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()

    @classmethod
    def load(cls, fetch_dir: Path, plan: ConvertPlan) -> _ResumeState | None:
        """The record of an interrupted run of this plan, its layers checked against the rank files (the first
        whose chunks do not match, and every later one, are written again); None when there is none."""
        try:
            record = json.loads((fetch_dir / cls.RECORD).read_text())
            if record.get("key") != cls.key(plan):
                return None
            state = cls(fetch_dir, plan, [tuple(sums) for sums in record["layers"]],
                        {name: None if r is None else (bool(r[0]), list(r[1])) for name, r in record["files"].items()})
            state.layers = state.layers[:state.intact_layers()]
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):  # none, or not one of ours
            return None
        return state

    def intact_layers(self) -> int:
        """How many of the recorded layers the saved rank files hold, by their chunks' checksums."""
        ranks = self.plan.world_size
        for i, sums in enumerate(self.layers):
            lay, file_offset = self.plan.layouts[i], self.plan.file_offsets[i]
            for r in range(ranks):
                lo, hi = chunk_range(r, lay.chunk_bytes)
                try:
                    with open(self.saved / rank_file_name(r, ranks), "rb") as f:
                        f.seek(file_offset)
                        if digest(f.read(hi - lo)) != sums[r]:
                            return i
                except OSError:
                    return i
        return len(self.layers)

    def save(self, records: list[LayerRecord] | None = None) -> None:
        """Record the layers written so far (`records`; None: those recorded already) and the replicated files."""
        if records is not None:
            self.layers = [record.checksums for record in records]
        text = json.dumps({"key": self.key(self.plan), "layers": self.layers, "files": self.files})
        part = self.fetch_dir / (self.RECORD + ".part")
        with open(part, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, self.fetch_dir / self.RECORD)

    def record(self, layer: int) -> LayerRecord:
        return LayerRecord.from_layout(self.plan.layouts[layer], self.plan.file_offsets[layer], self.layers[layer])


class HubFeed:
    """Has each source file on disk while the writer reads it, and only then (see the module docstring); records
    what is written so that an interrupted run resumes (`_ResumeState`).

    `peak_bytes` is the most source bytes on disk at once, the small files kept to the end included; `fetched`
    the files fetched, in order.
    """

    def __init__(self, source: HubSource, plan: ConvertPlan, state: _ResumeState) -> None:
        self.source, self.plan, self.state = source, plan, state
        self.live = _LiveFiles(plan)
        self.replicated = {f.name: f for f in plan.replicated}
        # Files a previous run fetched and checked (a file takes its name only once checked) are used again.
        self.local = {name: (source.fetch_dir / name).stat().st_size for name in (*plan.source.files,
                      *plan.other_files) if (source.fetch_dir / name).is_file()}
        self.peak_bytes = sum(self.local.values())
        self.fetched: list[str] = []
        self._directory: Path | None = None
        self._write: Callable[[ReplicatedFile], tuple[bool, list[str]] | None] | None = None

    def write_order(self) -> list[str]:
        """The tensors the writer will consume, in order: each replicated file still to write where it is settled
        (files no layer reads first, each other file after the last layer that reads it) and the layers still to
        write. The requant runs ahead along this order only, so no job it starts reads a file after its drop.

        >>> order = feed.write_order()  # doctest: +SKIP
        """
        done, settled = len(self.state.layers), set(self.state.files)
        by_last: dict[int, list[str]] = {}
        for name, last in self.live.last.items():
            by_last.setdefault(last, []).append(name)

        def settling(last: int) -> list[str]:
            files = [self.replicated[n] for n in by_last.get(last, ()) if n not in settled and n in self.replicated]
            return [t.name for f in files for t in f.tensors or ()]

        order: list[str] = []
        for index, lay in enumerate(self.plan.layouts):
            order += settling(index - 1)  # before layer 0: the files no layer reads
            order += [e.name for e in lay.entries] if index >= done else []
        return order + settling(len(self.plan.layouts) - 1)

    def start(self, directory: Path, write_file: Callable[[ReplicatedFile], tuple[bool, list[str]] | None]) -> None:
        """Take back what a previous run wrote, fetch the small files, then each file no layer reads, one at a
        time, written with `write_file`."""
        self._directory, self._write = directory, write_file
        self._take_back(directory)
        for rel in self.plan.other_files:
            if rel not in self.local:
                self._fetch(rel)
        for name, last in self.live.last.items():
            if last == -1:
                self._settle(name)

    def before_layer(self, index: int, written: list[LayerRecord]) -> LayerRecord | None:
        """Record the layers written, settle the files no layer from `index` on reads, then fetch those layer
        `index` reads; the layer's record instead where a previous run wrote it."""
        if index == 0:
            self._save_rank_files()
        if len(written) > len(self.state.layers):
            self.state.save(written)
        for name in [n for n, last in self.live.last.items() if -1 < last < index]:
            self._settle(name)
        if index < len(self.state.layers):
            return self.state.record(index)
        for name in self.live.reads[index]:
            if name not in self.local:
                self._fetch(name)
        return None

    def finish(self) -> dict[str, tuple[bool, list[str]] | None]:
        """Settle the shard files still to be written; each replicated file's result, as the writer's index
        needs it."""
        for name in self.live.last:
            self._settle(name)
        return dict(self.state.files)

    def _take_back(self, directory: Path) -> None:
        """The saved rank files and replicated files, hard-linked into the staging `directory`."""
        saved = self.state.saved
        if saved.is_dir():
            for path in saved.rglob("*"):
                if path.is_file():
                    dest = directory / path.relative_to(saved)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    os.link(path, dest)

    def _save_rank_files(self) -> None:
        assert self._directory is not None
        for r in range(self.plan.world_size):
            path = self.state.saved / rank_file_name(r, self.plan.world_size)
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                os.link(self._directory / rank_file_name(r, self.plan.world_size), path)

    def _fetch(self, name: str) -> None:
        self.local[name] = self.source.fetch(name)
        self.fetched.append(name)
        self.peak_bytes = max(self.peak_bytes, sum(self.local.values()))

    def _settle(self, name: str) -> None:
        """Write file `name`'s replicated part unless written already (fetching it where a previous run dropped
        it before recording that), then drop it."""
        assert self._write is not None and self._directory is not None
        if name not in self.state.files:
            if name not in self.local:
                self._fetch(name)
            result = self._write(self.replicated[name]) if name in self.replicated else None
            out_name = self.replicated[name].out_name if name in self.replicated else ""
            if result is not None:  # saved, and on disk, before it is recorded: a record names only whole files
                (self.state.saved / out_name).parent.mkdir(parents=True, exist_ok=True)
                os.link(self._directory / out_name, self.state.saved / out_name)
                fd = os.open(self.state.saved / out_name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self.state.files[name] = result
            self.state.save()
        if name in self.local:
            path = self.source.fetch_dir / name
            if os.stat(path).st_nlink == 1:
                os.truncate(path, 0)  # frees the blocks now, though the writer may still hold the file open
            os.unlink(path)
            del self.local[name]
