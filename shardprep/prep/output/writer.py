"""Carry out a `ConvertPlan`: write the rank files, the replicated part and the manifest into a directory.

Streaming: one layer's targets are packed into a reusable buffer of max|T| bytes, checksummed and
written to the N rank files (safetensors files with one identical header); non-target tensors are copied
file-to-file by byte range, or the whole source file is hard-linked when nothing in it changes. Every
other file is then checksummed, and the manifest is written last.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from ..._version import __version__
from ...errors import OutputError
from ...manifests.checksums import digest, file_digest, file_hasher
from ...manifests.exact_read import pread_exact
from ...manifests.layout import chunk_range
from ...manifests.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    REPLICATED_INDEX,
    FileRecord,
    LayerRecord,
    Manifest,
    rank_file_name,
)
from ...manifests.paths import files_under
from ...manifests.replicated import NOTICE_FILE, NOTICE_TENSOR, NOTICE_TEXT, SHARDED_SENTINEL
from ..convert_plan import ConvertPlan, ReplicatedFile
from ..requant_jobs import RequantRunner
from ..source import SourceCheckpoint
from .file_ranges import pwrite_all
from .output_dir import writing
from .safetensors_writer import FileRange, OutTensor, write_safetensors
from .writeback import Writeback

# Threads copying replicated files while the rank files are written. Each copy runs in the kernel
# (copy_file_range), so one thread per core keeps every core copying; more would only queue on the disk.
COPY_THREADS = min(4, os.cpu_count() or 1)

CREATED_BY = f"shardprep {__version__}"  # the manifest's `created_by`

Progress = Callable[[int, int], None]
"""progress(bytes_done, bytes_total), called as work advances."""


class CopyMode(str, Enum):
    """How files taken over whole reach the output (convert's, reshard's, export's): auto (hard-link when
    possible, else copy), link, copy.

    >>> CopyMode("link").value
    'link'
    """

    AUTO = "auto"
    LINK = "link"
    COPY = "copy"


class SourceFeed(Protocol):
    """Has each source file on disk while the writer reads it (`hub/stream.py`: a hub id, a layer at a time); it
    writes each file's replicated part, with the function `start` gives it, before it drops the file. A feed
    that resumes an interrupted run has put its rank files into `directory/shards/` in `start`, and answers
    `before_layer` with the record of a layer they already hold (None: write the layer)."""

    def start(self, directory: Path, write_file: Callable[[ReplicatedFile], tuple[bool, list[str]] | None]) -> None:
        ...

    def before_layer(self, index: int, written: list[LayerRecord]) -> LayerRecord | None: ...
    def write_order(self) -> list[str]: ...
    def finish(self) -> dict[str, tuple[bool, list[str]] | None]: ...


@dataclass(frozen=True)
class WriteResult:
    """What the writer wrote besides the rank files."""

    manifest: Manifest
    linked_files: list[str]
    copied_files: list[str]
    replicated_tensors: int
    replicated_bytes: int


class _Tracker:
    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.progress = total, 0, progress
        self._lock = threading.Lock()  # the rank-file writer and the copy threads both report
        if progress:
            progress(0, total)

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.progress:
                self.progress(self.done, self.total)


def write_plan(plan: ConvertPlan, directory: Path, copy_mode: str = "auto",
               progress: Progress | None = None, feed: SourceFeed | None = None) -> WriteResult:
    """Write everything `plan` describes into the empty `directory`; the manifest goes last. With a `feed`, the
    source's files are on disk only while a layer reads them (see `SourceFeed`), and written one at a time.

    >>> write_plan(make_plan(ckpt, 8, selection), Path("staging/"))  # doctest: +SKIP
    """
    tracker = _Tracker(plan.target_bytes + plan.rewritten_bytes, progress)
    # With a feed, the requant runs ahead only along the feed's order and only on files on disk (RequantRunner).
    ahead = (feed.write_order(), os.path.isfile) if feed is not None else (plan.write_order(), None)
    runner = RequantRunner(plan.requant, *ahead) if plan.requant else None
    with Writeback() as writeback, runner or nullcontext(), ThreadPoolExecutor(COPY_THREADS) as pool:
        producers = {name: runner.producer(name) for name in plan.rewritten} if runner else {}
        replicated = _ReplicatedWriter(directory, plan, producers, copy_mode, tracker, writeback)
        try:
            # Files that take no requantized tensor are copied by the pool while this thread writes the
            # rank files; the others follow the rank files on this thread, in the order the requant
            # runner computes their tensors.
            early = {f.name: pool.submit(replicated.write, f) for f in plan.replicated
                     if not replicated.takes_producers(f) and feed is None}
            if feed is not None:
                feed.start(directory, replicated.write)
            records = _write_rank_files(directory, plan, producers, tracker, writeback, feed)
            results = (feed.finish() if feed is not None else
                       {f.name: replicated.write(f) for f in plan.replicated if f.name not in early})
            results.update({name: future.result() for name, future in early.items()})
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        writeback.finish()  # before the index: its fsync would otherwise wait for all of the data
        linked, copied, rep_tensors, rep_bytes = replicated.write_index(results)
    _copy_other_files(directory, plan)
    manifest = replace(plan.skeleton_manifest(), layers=tuple(records), created_by=CREATED_BY,
                       replicated_files=_digest_replicated_files(directory, plan.world_size, replicated.digests))
    write_manifest(directory, manifest)
    return WriteResult(manifest, linked, copied, rep_tensors, rep_bytes)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Run a reader's checks on `manifest`, then write it, sealed, as the directory's last file.

    >>> write_manifest(Path("staging/"), manifest)  # doctest: +SKIP
    """
    text = manifest.to_json()
    if len(text) > MAX_MANIFEST_BYTES:
        raise OutputError(f"{directory}: the manifest would be {len(text)} bytes, more than readers accept "
                          f"({MAX_MANIFEST_BYTES}); use fewer ranks")
    Manifest.from_dict(manifest.to_dict())  # the same checks a reader will run, before anything is visible
    write_atomically(directory / MANIFEST_NAME, text)


def _write_rank_files(directory: Path, plan: ConvertPlan, producers: dict[str, Callable[[], Any]],
                      tracker: _Tracker, writeback: Writeback, feed: SourceFeed | None) -> list[LayerRecord]:
    # At most one rank file and a few source files are open at any time, whatever N: each rank file is
    # opened for its chunk of a layer and closed again (N·layers opens, each far cheaper than its write).
    ckpt, ranks = plan.source, plan.world_size
    (directory / "shards").mkdir(exist_ok=feed is not None)
    paths = [directory / rank_file_name(r, ranks) for r in range(ranks)]
    buf = memoryview(bytearray(max(lay.total_bytes for lay in plan.layouts)))
    sources = _SourceFiles(ckpt)
    records: list[LayerRecord] = []
    try:
        for path in paths:
            if feed is None or not path.exists():  # a resumed feed's rank files are there already
                create_rank_file(path, plan.rank_header, plan.rank_file_bytes)
        for index, (lay, file_offset) in enumerate(zip(plan.layouts, plan.file_offsets)):
            done = feed.before_layer(index, records) if feed is not None else None
            if done is not None:
                records.append(done)
                tracker(sum(e.nbytes for e in lay.entries))
                continue
            flat = buf[: lay.total_bytes]
            at = 0
            for e in lay.entries:
                flat[at:e.offset] = bytes(e.offset - at)  # alignment gap: padding bytes are zero
                dest = flat[e.offset:e.offset + e.nbytes]
                if e.name in producers:
                    dest[:] = producers[e.name]()
                else:
                    t = ckpt.tensors[e.name]
                    pread_exact(sources.fd(t.file), dest, t.start, ckpt.files[t.file].path)
                at = e.offset + e.nbytes
                tracker(e.nbytes)
            flat[at:] = bytes(lay.total_bytes - at)
            sums = []
            for r, path in enumerate(paths):
                lo, hi = chunk_range(r, lay.chunk_bytes)
                chunk = flat[lo:hi]
                sums.append(digest(chunk))
                write_chunk(path, chunk, file_offset, writeback)
            records.append(LayerRecord.from_layout(lay, file_offset, tuple(sums)))
    except OSError as exc:
        raise OutputError(f"{directory.parent}: writing rank files failed ({exc.strerror or exc})") from None
    finally:
        sources.close()
    return records


def create_rank_file(path: Path, header: bytes, size: int) -> None:
    """Create a rank file of `size` bytes holding `header`; the rest is a hole until the chunks are written,
    and the gaps between chunks stay holes, which read as zeros.

    >>> create_rank_file(Path("staging/shards/rank-00000-of-00002.safetensors"), header, 1 << 20)  # doctest: +SKIP
    """
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pwrite_all(fd, memoryview(header), 0)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)


def write_chunk(path: Path, chunk: memoryview, file_offset: int, writeback: Writeback) -> None:
    """Write one rank's chunk of a layer into its rank file, opened for this write alone, and start its disk
    write (fsynced by `writeback.finish`, with the rest).

    >>> write_chunk(Path("staging/shards/rank-00000-of-00002.safetensors"), chunk, 4096, writeback)  # doctest: +SKIP
    """
    with writing(path):
        fd = os.open(path, os.O_WRONLY)
        try:
            pwrite_all(fd, chunk, file_offset)
        finally:
            os.close(fd)
    writeback.start(path, file_offset, len(chunk))


class _SourceFiles:
    """Open source files, at most MAX_OPEN at once (least recently used closed first)."""

    MAX_OPEN = 8

    def __init__(self, ckpt: SourceCheckpoint):
        self.ckpt = ckpt
        self.fds: OrderedDict[str, int] = OrderedDict()

    def fd(self, name: str) -> int:
        if name in self.fds:
            self.fds.move_to_end(name)
            return self.fds[name]
        if len(self.fds) >= self.MAX_OPEN:
            os.close(self.fds.popitem(last=False)[1])
        self.fds[name] = os.open(self.ckpt.files[name].path, os.O_RDONLY)
        return self.fds[name]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class _ReplicatedWriter:
    """Writes the replicated part, one file per call (from any thread), then the notice file and the index."""

    def __init__(self, directory: Path, plan: ConvertPlan, producers: dict[str, Callable[[], Any]], copy_mode: str,
                 tracker: _Tracker, writeback: Writeback):
        self.directory, self.plan, self.producers = directory, plan, producers
        self.copy_mode, self.tracker, self.writeback = copy_mode, tracker, writeback
        # Each file's size and checksum for the manifest, taken as soon as the file is written: in a copy
        # thread that runs beside the rank files rather than in one pass over all of them at the end.
        self.digests: dict[str, FileRecord] = {}

    def takes_producers(self, f: ReplicatedFile) -> bool:
        return any(t.name in self.producers for t in f.tensors or ())

    def write(self, f: ReplicatedFile) -> tuple[bool, list[str]] | None:
        """Link, copy or rewrite one file: (linked, the tensors it keeps), or None when it is dropped."""
        sf = self.plan.source.files[f.name]
        dest = self.directory / f.out_name
        if f.tensors is not None and not f.tensors:
            return None  # every tensor of this file became a target: drop the file
        dest.parent.mkdir(parents=True, exist_ok=True)
        if f.tensors is None:
            linked = link_or_copy(sf.path, dest, self.copy_mode)
            if not linked:
                self.writeback.start(dest, 0, sf.size)
            self._digest(f.out_name)
            return linked, list(sf.tensors)
        out = []
        for spec in f.tensors:
            if spec.name in self.producers:
                out.append(OutTensor(spec.name, spec.dtype, spec.shape, self.producers[spec.name]))
            else:
                st = self.plan.source.tensors[spec.name]
                out.append(OutTensor(spec.name, spec.dtype, spec.shape, FileRange(sf.path, st.start, st.nbytes)))
        # Hashed as it is written: the requantized tensors are hashed from memory, not read back.
        hasher = file_hasher()
        with writing(dest):
            write_safetensors(dest, out, sf.metadata, progress=self.tracker, writeback=self.writeback,
                              hasher=hasher)
            _keep_mode(sf.path, dest)
        self._record(f.out_name, os.stat(dest).st_size, hasher.hexdigest())
        return False, [spec.name for spec in f.tensors]

    def _digest(self, rel: str) -> None:
        self._record(rel, *file_digest(self.directory / rel))

    def _record(self, rel: str, size: int, hexdigest: str) -> None:
        self.digests[Path(rel).as_posix()] = FileRecord(Path(rel).as_posix(), size, hexdigest)

    def write_index(self, results: dict[str, tuple[bool, list[str]] | None]) -> tuple[list[str], list[str], int, int]:
        """The notice file and the replicated index, from every file's result: (linked files, copied files,
        tensors, bytes)."""
        ckpt, directory = self.plan.source, self.directory
        weight_map: dict[str, str] = {}
        linked: list[str] = []
        copied: list[str] = []
        for f in self.plan.replicated:
            result = results[f.name]
            if result is None:
                continue
            (linked if result[0] else copied).append(f.out_name)
            for name in result[1]:
                weight_map[name] = f.out_name
        total = sum(ckpt.tensors[t].nbytes for t in weight_map)
        # The targets point at a file that does not exist, so a plain loader fails naming it; the notice file
        # exists so that loaders which glob *.safetensors fail naming its tensor (docs/format.md).
        with writing(directory / NOTICE_FILE):
            write_safetensors(directory / NOTICE_FILE, [OutTensor(NOTICE_TENSOR, "U8", (1,), bytes(1))],
                              {"format": "pt", "shardprep": NOTICE_TEXT})
        index_map = {**weight_map, **{name: SHARDED_SENTINEL for name in self.plan.targets.names},
                     NOTICE_TENSOR: NOTICE_FILE}
        index = {"metadata": {**ckpt.index_metadata, "total_size": total, "shardprep": NOTICE_TEXT},
                 "weight_map": dict(sorted(index_map.items()))}
        write_atomically(directory / REPLICATED_INDEX, json.dumps(index, indent=2) + "\n")
        return linked, copied, len(weight_map), total


def _digest_replicated_files(directory: Path, world_size: int,
                             known: dict[str, FileRecord]) -> tuple[FileRecord, ...]:
    """Size and XXH3-128 of every file in `directory` but the manifest and the rank files (those in `known`
    were taken when they were written)."""
    own = {MANIFEST_NAME, *(rank_file_name(r, world_size) for r in range(world_size))}
    records = []
    for rel in files_under(directory):
        if rel in known:
            records.append(known[rel])
        elif rel not in own:
            size, hexdigest = file_digest(directory / rel)
            records.append(FileRecord(rel, size, hexdigest))
    return tuple(sorted(records, key=lambda f: f.path))


def link_or_copy(src: Path, dest: Path, mode: str) -> bool:
    """Hard-link when allowed and possible (same filesystem); returns True when linked. A copy keeps the mode.

    `mode` is a CopyMode value: auto, link (refuse to copy) or copy.

    >>> link_or_copy(Path("my-model/config.json"), Path("staging/config.json"), "auto")  # doctest: +SKIP
    """
    real = src.resolve()  # hub snapshots are symlinks into blobs/: link the blob itself
    if mode in ("auto", "link"):
        try:
            os.link(real, dest)
            return True
        except OSError as exc:
            if mode == "link":
                raise OutputError(f"{dest}: cannot hard-link {real} ({exc.strerror}); use --copy-mode copy") from None
    with writing(dest):
        shutil.copyfile(real, dest)
        _keep_mode(real, dest)
    return False


def _copy_other_files(directory: Path, plan: ConvertPlan) -> None:
    ckpt = plan.source
    config_update = plan.requant.config_update if plan.requant else None
    for rel in plan.other_files:
        src, dest = (ckpt.root / rel).resolve(), directory / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        with writing(dest):
            if rel == "config.json" and config_update:
                config = ckpt.config or {}
                config.update(config_update)
                write_atomically(dest, json.dumps(config, indent=2) + "\n")
            else:
                shutil.copyfile(src, dest)
            _keep_mode(src, dest)


def _keep_mode(src: Path, dest: Path) -> None:
    # Permission bits only: a setuid/setgid/sticky bit on a model file is never wanted in a copy.
    os.chmod(dest, stat.S_IMODE(os.stat(src).st_mode) & 0o777)


def output_bytes(plan: ConvertPlan, out: Path, copy_mode: str = "auto") -> int:
    """Disk bytes `write_plan` will need next to `out` (an upper bound; a hard link costs nothing).

    Rank files, rewritten safetensors files (header bounded by the source's), copied files, the index
    and the manifest, each rounded up to 4 KiB blocks. Files that will be hard-linked count as 0 when
    the source is on the destination's filesystem.

    >>> needed = output_bytes(plan, Path("out/"))  # doctest: +SKIP
    """
    dest_dev = output_device(out)
    ckpt = plan.source
    total = plan.world_size * disk_bytes(plan.rank_file_bytes)
    for f in plan.replicated:
        sf = ckpt.files[f.name]
        if f.tensors is None:
            total += carried_bytes(sf.path, sf.size, copy_mode, dest_dev)
        elif f.tensors:
            header = min(ckpt.tensors[name].start for name in sf.tensors)  # 8 + the source header
            total += disk_bytes(header + sum(t.nbytes for t in f.tensors))
    for rel in plan.other_files:
        total += disk_bytes(os.stat(ckpt.root / rel).st_size)
    # The index and the manifest: a few hundred bytes per tensor at most.
    total += disk_bytes(1024 * (len(ckpt.tensors) + 16))
    return total


def carried_bytes(src: Path, size: int, copy_mode: str, dest_dev: int) -> int:
    """Disk bytes a file taken over whole costs next to the output: 0 when `link_or_copy` will hard-link it
    (any mode but copy, the same filesystem), else its size in blocks.

    >>> here = os.stat(__file__).st_dev
    >>> carried_bytes(Path(__file__), 5000, "auto", here), carried_bytes(Path(__file__), 5000, "copy", here)
    (0, 8192)
    """
    linked = copy_mode != "copy" and os.stat(src).st_dev == dest_dev
    return 0 if linked else disk_bytes(size)


def disk_bytes(n: int) -> int:
    """`n` rounded up to whole 4 KiB blocks: at most what a file of `n` bytes takes on disk.

    >>> disk_bytes(1), disk_bytes(4096), disk_bytes(0)
    (4096, 4096, 0)
    """
    return -(-n // 4096) * 4096


def output_device(out: Path) -> int:
    """The device (`st_dev`) of the filesystem `out` is or will be on: that of its nearest existing ancestor.

    >>> output_device(Path("no/such/dir")) == os.stat(".").st_dev
    True
    """
    path = Path(os.path.abspath(out))
    while not path.exists() and path.parent != path:
        path = path.parent
    return os.stat(path).st_dev


def write_atomically(path: Path, text: str) -> None:
    """Write a small text file under a temporary name, fsync it, then rename it into place."""
    part = path.with_name(path.name + ".part")
    with writing(path):
        with open(part, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
