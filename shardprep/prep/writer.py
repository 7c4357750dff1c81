"""Carry out a `ConvertPlan`: write the rank files, the replicated part and the manifest into a directory.

Streaming: one layer's targets are packed into a reusable buffer of max|T| bytes, checksummed and
written to the N rank files; non-target tensors are copied file-to-file by byte range, or the whole
source file is hard-linked when nothing in it changes. The manifest is written last.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import xxhash

from .._version import __version__
from ..errors import OutputError
from ..manifests.layout import chunk_range
from ..manifests.manifest import MANIFEST_NAME, REPLICATED_INDEX, LayerRecord, Manifest, rank_file_name
from .plan import ConvertPlan
from .requant_jobs import RequantRunner
from .safetensors_writer import FileRange, OutTensor, write_safetensors
from .source import pread_exact

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
    manifest = replace(plan.skeleton_manifest(), layers=tuple(records), created_by=f"shardprep {__version__}")
    Manifest.from_dict(manifest.to_dict())  # the same checks a reader will run, before anything is visible
    write_atomically(directory / MANIFEST_NAME, manifest.to_json())
    return WriteResult(manifest, linked, copied, rep_tensors, rep_bytes)


def _write_rank_files(directory: Path, plan: ConvertPlan, producers: dict[str, Callable[[], Any]],
                      tracker: _Tracker) -> list[LayerRecord]:
    ckpt, ranks = plan.source, plan.world_size
    (directory / "shards").mkdir()
    buf = memoryview(bytearray(max(lay.total_bytes for lay in plan.layouts)))
    src_fds: dict[str, int] = {}
    rank_fds = [os.open(directory / rank_file_name(r, ranks), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                for r in range(ranks)]
    records = []
    try:
        for lay, file_offset in zip(plan.layouts, plan.file_offsets):
            flat = buf[: lay.total_bytes]
            at = 0
            for e in lay.entries:
                flat[at:e.offset] = bytes(e.offset - at)  # alignment gap: padding bytes are zero
                dest = flat[e.offset:e.offset + e.nbytes]
                if e.name in producers:
                    dest[:] = producers[e.name]()
                else:
                    t = ckpt.tensors[e.name]
                    if t.file not in src_fds:
                        src_fds[t.file] = os.open(ckpt.files[t.file].path, os.O_RDONLY)
                    pread_exact(src_fds[t.file], dest, t.start, ckpt.files[t.file].path)
                at = e.offset + e.nbytes
                tracker(e.nbytes)
            flat[at:] = bytes(lay.total_bytes - at)
            sums = []
            for r, fd in enumerate(rank_fds):
                lo, hi = chunk_range(r, lay.chunk_bytes)
                chunk = flat[lo:hi]
                sums.append(xxhash.xxh3_128_hexdigest(chunk))
                pwrite_all(fd, chunk, file_offset)
            records.append(LayerRecord.from_layout(lay, file_offset, tuple(sums)))
        for fd in rank_fds:
            os.ftruncate(fd, plan.rank_file_bytes)
            os.fsync(fd)
    except OSError as exc:
        raise OutputError(f"{directory.parent}: writing rank files failed ({exc.strerror or exc})") from None
    finally:
        for fd in (*rank_fds, *src_fds.values()):
            os.close(fd)
    return records


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
        dest = directory / f.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if f.tensors is None:
            (linked if _link_or_copy(sf.path, dest, copy_mode) else copied).append(f.name)
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
            write_safetensors(dest, out, sf.metadata, progress=tracker)
            copied.append(f.name)
            kept = [spec.name for spec in f.tensors]
        for name in kept:
            weight_map[name] = f.name
    total = sum(ckpt.tensors[t].nbytes for t in weight_map)
    index = {"metadata": {**ckpt.index_metadata, "total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomically(directory / REPLICATED_INDEX, json.dumps(index, indent=2) + "\n")
    return linked, copied, len(weight_map), total


def _link_or_copy(src: Path, dest: Path, mode: str) -> bool:
    """Hard-link when allowed and possible (same filesystem); returns True when linked."""
    real = src.resolve()  # hub snapshots are symlinks into blobs/: link the blob itself
    if mode in ("auto", "link"):
        try:
            os.link(real, dest)
            return True
        except OSError as exc:
            if mode == "link":
                raise OutputError(f"{dest}: cannot hard-link {real} ({exc.strerror}); use --copy-mode copy") from None
    shutil.copyfile(real, dest)
    return False


def _copy_other_files(directory: Path, plan: ConvertPlan) -> None:
    ckpt = plan.source
    config_update = plan.requant.config_update if plan.requant else None
    for rel in plan.other_files:
        dest = directory / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if rel == "config.json" and config_update:
            config = ckpt.config or {}
            config.update(config_update)
            write_atomically(dest, json.dumps(config, indent=2) + "\n")
        else:
            shutil.copyfile((ckpt.root / rel).resolve(), dest)


def write_atomically(path: Path, text: str) -> None:
    """Write a small text file under a temporary name, fsync it, then rename it into place."""
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
