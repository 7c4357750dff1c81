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
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import OutputError
from ..manifests.checksums import digest, file_digest
from ..manifests.exact_read import pread_exact
from ..manifests.layout import chunk_range
from ..manifests.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    REPLICATED_INDEX,
    FileRecord,
    LayerRecord,
    Manifest,
    rank_file_name,
)
from ..manifests.replicated import NOTICE_FILE, NOTICE_TENSOR, NOTICE_TEXT, SHARDED_SENTINEL
from .output_dir import writing
from .plan import ConvertPlan
from .requant_jobs import RequantRunner
from .safetensors_writer import FileRange, OutTensor, write_safetensors
from .source import SourceCheckpoint

Progress = Callable[[int, int], None]
"""progress(bytes_done, bytes_total), called as work advances."""


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
        if progress:
            progress(0, total)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress:
            self.progress(self.done, self.total)


def write_plan(plan: ConvertPlan, directory: Path, copy_mode: str = "auto",
               progress: Progress | None = None) -> WriteResult:
    """Write everything `plan` describes into the empty `directory`; the manifest goes last.

    >>> write_plan(make_plan(ckpt, 8, selection), Path("staging/"))  # doctest: +SKIP
    """
    tracker = _Tracker(plan.target_bytes + plan.rewritten_bytes, progress)
    runner = RequantRunner(plan.requant, plan.write_order()) if plan.requant else None
    with runner or nullcontext():
        producers = {name: runner.producer(name) for name in plan.rewritten} if runner else {}
        records = _write_rank_files(directory, plan, producers, tracker)
        linked, copied, rep_tensors, rep_bytes = _write_replicated(directory, plan, producers, copy_mode, tracker)
    _copy_other_files(directory, plan)
    manifest = replace(plan.skeleton_manifest(), layers=tuple(records), created_by=f"shardprep {__version__}",
                       replicated_files=_digest_replicated_files(directory, plan.world_size))
    text = manifest.to_json()
    if len(text) > MAX_MANIFEST_BYTES:
        raise OutputError(f"{directory}: the manifest would be {len(text)} bytes, more than readers accept "
                          f"({MAX_MANIFEST_BYTES}); use fewer ranks")
    Manifest.from_dict(manifest.to_dict())  # the same checks a reader will run, before anything is visible
    write_atomically(directory / MANIFEST_NAME, text)
    return WriteResult(manifest, linked, copied, rep_tensors, rep_bytes)


def _write_rank_files(directory: Path, plan: ConvertPlan, producers: dict[str, Callable[[], Any]],
                      tracker: _Tracker) -> list[LayerRecord]:
    # At most one rank file and a few source files are open at any time, whatever N: each rank file is
    # opened for its chunk of a layer and closed again (N·layers opens, each far cheaper than its write).
    ckpt, ranks = plan.source, plan.world_size
    (directory / "shards").mkdir()
    paths = [directory / rank_file_name(r, ranks) for r in range(ranks)]
    buf = memoryview(bytearray(max(lay.total_bytes for lay in plan.layouts)))
    sources = _SourceFiles(ckpt)
    records = []
    last = len(plan.layouts) - 1
    try:
        for path in paths:
            _create_rank_file(path, plan.rank_header, plan.rank_file_bytes)
        for i, (lay, file_offset) in enumerate(zip(plan.layouts, plan.file_offsets)):
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
                with writing(path):
                    fd = os.open(path, os.O_WRONLY)
                    try:
                        pwrite_all(fd, chunk, file_offset)
                        if i == last:
                            os.fsync(fd)
                    finally:
                        os.close(fd)
            records.append(LayerRecord.from_layout(lay, file_offset, tuple(sums)))
    except OSError as exc:
        raise OutputError(f"{directory.parent}: writing rank files failed ({exc.strerror or exc})") from None
    finally:
        sources.close()
    return records


def _create_rank_file(path: Path, header: bytes, size: int) -> None:
    # The header first; the rest of the file is a hole until the chunks are written, and the gaps between
    # chunks stay holes, which read as zeros.
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pwrite_all(fd, memoryview(header), 0)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)


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


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (pwrite until done)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _write_replicated(directory: Path, plan: ConvertPlan, producers: dict[str, Callable[[], Any]],
                      copy_mode: str, tracker: _Tracker) -> tuple[list[str], list[str], int, int]:
    ckpt = plan.source
    weight_map: dict[str, str] = {}
    linked: list[str] = []
    copied: list[str] = []
    for f in plan.replicated:
        sf = ckpt.files[f.name]
        dest = directory / f.out_name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if f.tensors is None:
            (linked if _link_or_copy(sf.path, dest, copy_mode) else copied).append(f.out_name)
            kept = list(sf.tensors)
        else:
            if not f.tensors:
                continue  # every tensor of this file became a target: drop the file
            out = []
            for spec in f.tensors:
                if spec.name in producers:
                    out.append(OutTensor(spec.name, spec.dtype, spec.shape, producers[spec.name]))
                else:
                    st = ckpt.tensors[spec.name]
                    out.append(OutTensor(spec.name, spec.dtype, spec.shape, FileRange(sf.path, st.start, st.nbytes)))
            with writing(dest):
                write_safetensors(dest, out, sf.metadata, progress=tracker)
                _keep_mode(sf.path, dest)
            copied.append(f.out_name)
            kept = [spec.name for spec in f.tensors]
        for name in kept:
            weight_map[name] = f.out_name
    total = sum(ckpt.tensors[t].nbytes for t in weight_map)
    # The targets point at a file that does not exist, so a plain loader fails naming it; the notice file
    # exists so that loaders which glob *.safetensors fail naming its tensor (docs/format.md).
    with writing(directory / NOTICE_FILE):
        write_safetensors(directory / NOTICE_FILE, [OutTensor(NOTICE_TENSOR, "U8", (1,), bytes(1))],
                          {"format": "pt", "shardprep": NOTICE_TEXT})
    index_map = {**weight_map, **{name: SHARDED_SENTINEL for name in plan.targets.names},
                 NOTICE_TENSOR: NOTICE_FILE}
    index = {"metadata": {**ckpt.index_metadata, "total_size": total, "shardprep": NOTICE_TEXT},
             "weight_map": dict(sorted(index_map.items()))}
    write_atomically(directory / REPLICATED_INDEX, json.dumps(index, indent=2) + "\n")
    return linked, copied, len(weight_map), total


def _digest_replicated_files(directory: Path, world_size: int) -> tuple[FileRecord, ...]:
    """Size and XXH3-128 of every file in `directory` but the manifest and the rank files."""
    own = {MANIFEST_NAME, *(rank_file_name(r, world_size) for r in range(world_size))}
    records = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in sorted(filenames):
            rel = Path(dirpath, name).relative_to(directory).as_posix()
            if rel not in own:
                size, hexdigest = file_digest(Path(dirpath, name))
                records.append(FileRecord(rel, size, hexdigest))
    return tuple(sorted(records, key=lambda f: f.path))


def _link_or_copy(src: Path, dest: Path, mode: str) -> bool:
    """Hard-link when allowed and possible (same filesystem); returns True when linked. A copy keeps the mode."""
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
    def blocks(n: int) -> int:
        return -(-n // 4096) * 4096

    dest_dev = os.stat(_nearest_existing(Path(os.path.abspath(out)))).st_dev
    ckpt = plan.source
    total = plan.world_size * blocks(plan.rank_file_bytes)
    for f in plan.replicated:
        sf = ckpt.files[f.name]
        if f.tensors is None:
            linked = copy_mode != "copy" and os.stat(sf.path).st_dev == dest_dev
            total += 0 if linked else blocks(sf.size)
        elif f.tensors:
            header = min(ckpt.tensors[name].start for name in sf.tensors)  # 8 + the source header
            total += blocks(header + sum(t.nbytes for t in f.tensors))
    for rel in plan.other_files:
        total += blocks(os.stat(ckpt.root / rel).st_size)
    # The index and the manifest: a few hundred bytes per tensor at most.
    total += blocks(1024 * (len(ckpt.tensors) + 16))
    return total


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def write_atomically(path: Path, text: str) -> None:
    """Write a small text file under a temporary name, fsync it, then rename it into place."""
    part = path.with_name(path.name + ".part")
    with writing(path):
        with open(part, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
