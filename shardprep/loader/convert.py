"""`shardprep convert`: HF safetensors checkpoint in, per-rank flat chunks + manifest + replicated part out.

Streaming: one layer's targets are packed into a reusable buffer of max|T| bytes, checksummed and
written to the N rank files; non-target tensors are copied file-to-file by byte range (or the whole
source file is hard-linked when nothing in it changes). Everything lands in a temporary sibling of
OUT that is renamed into place only after the manifest, written last, is on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .. import __version__
from ..errors import OutputError, ShardprepError
from ..manifests.layout import LayerLayout, TensorSpec, plan_file_offsets, plan_layer
from ..manifests.manifest import MANIFEST_NAME, REPLICATED_INDEX, LayerRecord, Manifest, rank_file_name
from ..manifests.selection import (
    DEFAULT_LAYER_PATTERN,
    DEFAULT_LAYERS,
    Selection,
    load_preset,
    parse_layer_range,
    select_targets,
)
from .output_dir import check_output_dir, staged_directory
from .safetensors_writer import FileRange, OutTensor, write_safetensors
from .source import INDEX_NAME, SourceCheckpoint, open_source, pread_exact

Progress = Callable[[int, int], None]
"""progress(bytes_done, bytes_total), called as work advances."""

COPY_MODES = ("auto", "link", "copy")


@dataclass(frozen=True)
class TensorOverride:
    """Replacement bytes for a source tensor (requantized weights and scales); produced lazily."""

    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], bytes]


@dataclass
class ConvertSummary:
    """What convert wrote; `--json` prints `to_dict()`."""

    out: str
    world_size: int
    layers: list[int]
    target_tensors: int
    target_bytes: int
    sharded_bytes: int
    rank_file_bytes: int
    replicated_tensors: int
    replicated_bytes: int
    linked_files: list[str]
    copied_files: list[str]
    requantized_tensors: int = 0
    quantization: dict[str, Any] | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def convert(
    src: str | Path,
    out: str | Path,
    ranks: int,
    *,
    targets: Sequence[str] = (),
    preset: str | None = None,
    layers: str = DEFAULT_LAYERS,
    layer_pattern: str | None = None,
    revision: str | None = None,
    copy_mode: str = "auto",
    overwrite: bool = False,
    requant: str = "auto",
    requant_scope: str = "all",
    requant_recipe: str = "sglang",
    scale_format: str = "f32",
    allow_nonfinite: bool = False,
    device: str = "cpu",
    workers: int = 0,
    progress: Progress | None = None,
) -> ConvertSummary:
    """Convert a checkpoint into `ranks` per-rank files plus a manifest and the replicated part.

    >>> convert("Qwen/Qwen3-30B-A3B", "out/", ranks=8, preset="qwen3-moe")  # doctest: +SKIP
    ConvertSummary(out='out/', world_size=8, layers=[1, 2, ...], ...)
    """
    t0 = time.perf_counter()
    if not isinstance(ranks, int) or ranks < 1:
        raise ShardprepError(f"--ranks must be >= 1, got {ranks}")
    if copy_mode not in COPY_MODES:
        raise ShardprepError(f"--copy-mode {copy_mode!r}: expected one of {', '.join(COPY_MODES)}")
    out = Path(out)
    ckpt = open_source(src, revision)
    check_output_dir(out, ckpt.root, overwrite)

    selection = Selection(
        targets=tuple(targets),
        preset=load_preset(preset) if preset else None,
        layers=parse_layer_range(layers),
        layer_pattern=layer_pattern or DEFAULT_LAYER_PATTERN,
    )
    plan = select_targets(ckpt.tensors, selection)

    from .requant_step import plan_requant

    requant_plan = plan_requant(ckpt, plan.names, mode=requant, scope=requant_scope, recipe=requant_recipe,
                                scale_format=scale_format, allow_nonfinite=allow_nonfinite, device=device,
                                workers=workers)
    overrides = requant_plan.overrides if requant_plan else {}
    # Laid out from the override specs, so the layout describes the bytes actually written (a targeted
    # scale written as F8_E8M0 is a quarter of its F32 source).
    layouts = [
        plan_layer(idx, [_spec(ckpt, n, overrides) for n in names], ranks, plan.groups.get(idx, ()))
        for idx, names in plan.layers.items()
    ]
    offsets = plan_file_offsets([lay.chunk_bytes for lay in layouts])

    target_bytes = sum(e.nbytes for lay in layouts for e in lay.entries)
    replicated = _replicated_files(ckpt, plan.names, overrides)
    copy_bytes = sum(t.nbytes for tensors in replicated.values() if tensors is not None for t in tensors)
    tracker = _Tracker(target_bytes + copy_bytes, progress)

    with staged_directory(out) as tmp:
        if requant_plan:
            # Queue requant work in the order the writers below will consume it.
            order = [e.name for lay in layouts for e in lay.entries]
            order += [t.name for tensors in replicated.values() if tensors for t in tensors]
            requant_plan.start(order)
        try:
            records = _write_rank_files(tmp, ckpt, layouts, offsets, ranks, overrides, tracker)
            linked, copied, rep_tensors, rep_bytes = _write_replicated(tmp, ckpt, replicated, copy_mode, tracker)
        finally:
            if requant_plan:
                requant_plan.close()
        _copy_other_files(tmp, ckpt, requant_plan.config_update if requant_plan else None)
        manifest = Manifest(
            world_size=ranks,
            rank_files=tuple(rank_file_name(r, ranks) for r in range(ranks)),
            layers=tuple(records),
            source=ckpt.describe(),
            quantization=requant_plan.manifest_record if requant_plan else None,
            created_by=f"shardprep {__version__}",
        )
        Manifest.from_dict(manifest.to_dict())  # the same checks a reader will run, before anything is visible
        _write_atomically(tmp / MANIFEST_NAME, manifest.to_json())

    return ConvertSummary(
        out=str(out),
        world_size=ranks,
        layers=[lay.layer for lay in layouts],
        target_tensors=sum(len(lay.entries) for lay in layouts),
        target_bytes=target_bytes,
        sharded_bytes=sum(lay.total_bytes for lay in layouts),
        rank_file_bytes=manifest.rank_file_bytes,
        replicated_tensors=rep_tensors,
        replicated_bytes=rep_bytes,
        linked_files=linked,
        copied_files=copied,
        requantized_tensors=len(overrides),
        quantization=manifest.quantization,
        seconds=time.perf_counter() - t0,
    )


def _spec(ckpt: SourceCheckpoint, name: str, overrides: dict[str, TensorOverride] | None = None) -> TensorSpec:
    o = overrides.get(name) if overrides else None
    if o is not None:
        return TensorSpec(name, o.dtype, o.shape)
    t = ckpt.tensors[name]
    return TensorSpec(name, t.dtype, t.shape)


class _Tracker:
    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.progress = total, 0, progress
        if progress:
            progress(0, total)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress:
            self.progress(self.done, self.total)


def _write_rank_files(
    tmp: Path,
    ckpt: SourceCheckpoint,
    layouts: list[LayerLayout],
    offsets: list[int],
    ranks: int,
    overrides: dict[str, TensorOverride],
    tracker: _Tracker,
) -> list[LayerRecord]:
    (tmp / "shards").mkdir()
    buf = memoryview(bytearray(max(lay.total_bytes for lay in layouts)))
    src_fds: dict[str, int] = {}
    rank_fds = [os.open(tmp / rank_file_name(r, ranks), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                for r in range(ranks)]
    records = []
    try:
        for lay, file_offset in zip(layouts, offsets):
            flat = buf[: lay.total_bytes]
            at = 0
            for e in lay.entries:
                flat[at:e.offset] = bytes(e.offset - at)  # alignment gap: padding bytes are zero
                dest = flat[e.offset:e.offset + e.nbytes]
                if e.name in overrides:
                    dest[:] = overrides[e.name].produce()
                else:
                    t = ckpt.tensors[e.name]
                    if t.file not in src_fds:
                        src_fds[t.file] = os.open(ckpt.files[t.file].path, os.O_RDONLY)
                    pread_exact(src_fds[t.file], dest, t.start, ckpt.files[t.file].path)
                at = e.offset + e.nbytes
                tracker(e.nbytes)
            flat[at:] = bytes(lay.total_bytes - at)
            c = lay.chunk_bytes
            sums = []
            for r, fd in enumerate(rank_fds):
                chunk = flat[r * c:(r + 1) * c]
                sums.append(xxhash.xxh3_128_hexdigest(chunk))
                _pwrite_all(fd, chunk, file_offset)
            records.append(LayerRecord.from_layout(lay, file_offset, tuple(sums)))
        size = offsets[-1] + layouts[-1].chunk_bytes
        for fd in rank_fds:
            os.ftruncate(fd, size)
            os.fsync(fd)
    except OSError as exc:
        raise OutputError(f"{tmp.parent}: writing rank files failed ({exc.strerror or exc})") from None
    finally:
        for fd in (*rank_fds, *src_fds.values()):
            os.close(fd)
    return records


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _replicated_files(
    ckpt: SourceCheckpoint, targets: set[str], overrides: dict[str, TensorOverride]
) -> dict[str, list[OutTensor] | None]:
    """Per source file: None to link/copy it as is, else the tensors to rewrite it with (possibly none)."""
    result: dict[str, list[OutTensor] | None] = {}
    for name, sf in ckpt.files.items():
        # A requantized weight before its scale, so the scale comes from the weight's result, not a rerun.
        keep = sorted((t for t in sf.tensors if t not in targets), key=_weight_before_scale)
        if len(keep) == len(sf.tensors) and not any(t in overrides for t in keep):
            result[name] = None
            continue
        out = []
        for t in keep:
            if t in overrides:
                o = overrides[t]
                out.append(OutTensor(t, o.dtype, o.shape, o.produce))
            else:
                st = ckpt.tensors[t]
                out.append(OutTensor(t, st.dtype, st.shape, FileRange(sf.path, st.start, st.nbytes)))
        result[name] = out
    return result


def _weight_before_scale(name: str) -> tuple[str, bool]:
    scale = name.endswith("_scale_inv")
    return (name[: -len("_scale_inv")] if scale else name, scale)


def _write_replicated(
    tmp: Path,
    ckpt: SourceCheckpoint,
    replicated: dict[str, list[OutTensor] | None],
    copy_mode: str,
    tracker: _Tracker,
) -> tuple[list[str], list[str], int, int]:
    weight_map: dict[str, str] = {}
    linked, copied = [], []
    total = 0
    for name, tensors in replicated.items():
        sf = ckpt.files[name]
        dest = tmp / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if tensors is None:
            (linked if _link_or_copy(sf.path, dest, copy_mode) else copied).append(name)
            kept = sf.tensors
        else:
            if not tensors:
                continue  # every tensor of this file became a target: drop the file
            write_safetensors(dest, tensors, sf.metadata, progress=tracker)
            copied.append(name)
            kept = [t.name for t in tensors]
        for t in kept:
            weight_map[t] = name
    for t in weight_map:
        total += ckpt.tensors[t].nbytes
    index = {"metadata": {**ckpt.index_metadata, "total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_atomically(tmp / REPLICATED_INDEX, json.dumps(index, indent=2) + "\n")
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


def _copy_other_files(tmp: Path, ckpt: SourceCheckpoint, config_update: dict[str, Any] | None) -> None:
    for rel in ckpt.other_files:
        if rel == INDEX_NAME:
            continue
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if rel == "config.json" and config_update:
            config = ckpt.config or {}
            config.update(config_update)
            _write_atomically(dest, json.dumps(config, indent=2) + "\n")
        else:
            shutil.copyfile((ckpt.root / rel).resolve(), dest)


def _write_atomically(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
