"""`shardprep export OUT DIR`: a plain HF checkpoint from an output directory, for servers without a shardprep loader.

SGLang, TensorRT-LLM or llama.cpp's converters then get what convert did offline (the UE8M0 requant,
every byte checked) without the sharding. DIR holds (docs/format.md, "Export"):

- the targets, rebuilt layer by layer from all rank files (each chunk checked against its checksum as it
  is read), one safetensors file per sharded layer, `model-targets-layer-{ℓ:05d}.safetensors`: the
  checkpoint's names, dtypes, shapes and bytes exactly as converted (requantized ones included);
- every other file OUT's manifest lists, config.json as convert wrote it included, hard-linked (or
  copied) and checked against its checksum where it lands; not the notice file, which guards OUT only;
- `model.safetensors.index.json`: OUT's, with every target mapped to its new file; it names real files
  only (no sentinel, no notice) and its `total_size` counts every tensor;
- `shardprep_export.json`, written last: where DIR came from (OUT, its source checkpoint, the requant). It
  also marks DIR as shardprep's, so that `export --overwrite` may replace it.

OUT is checked before anything is written as reshard checks it (`output/opened_output.py`), and read under its
readers' lock (`manifests/swap_lock.py`); DIR is written inside `staged_output`, like convert's OUT.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, ShardprepError
from ..manifests.dtypes import DTYPE_SIZES
from ..manifests.layout import Entry
from ..manifests.manifest import REPLICATED_INDEX, FileRecord, LayerRecord, Manifest
from ..manifests.paths import resolve_inside
from ..manifests.replicated import NOTICE_FILE, NOTICE_TENSOR, ReplicatedIndex, read_replicated_index
from ..manifests.safetensors_header import read_safetensors_header
from ..manifests.swap_lock import reading
from .output.carried_files import write_carrying
from .output.opened_output import OpenedOutput, open_output, read_layer
from .output.output_dir import EXPORT_RECORD, check_output_dir, staged_output, writing
from .output.safetensors_writer import OutTensor, write_safetensors
from .output.writeback import Writeback
from .output.writer import CREATED_BY, CopyMode, Progress, carried_bytes, disk_bytes, output_device, write_atomically

SUMMARY_SCHEMA = "shardprep/export-summary/1"
RECORD_SCHEMA = "shardprep/export/1"


def target_file_name(layer: int) -> str:
    """The file of DIR that holds layer ℓ's targets.

    >>> target_file_name(3)
    'model-targets-layer-00003.safetensors'
    """
    return f"model-targets-layer-{layer:05d}.safetensors"


@dataclass(frozen=True)
class TargetFile:
    """One sharded layer's targets as a safetensors file of DIR, its tensors in the order they are written."""

    name: str
    layer: LayerRecord
    tensors: tuple[Entry, ...]


@dataclass(frozen=True)
class ExportPlan:
    """What export writes: the target files, the files carried over, and the index (as JSON data)."""

    target_files: tuple[TargetFile, ...]
    carried: tuple[FileRecord, ...]
    index: dict[str, Any]
    record: dict[str, Any]  # shardprep_export.json


@dataclass
class ExportSummary:
    """What export wrote; `--json` prints `to_dict()`."""

    out: str
    dest: str
    world_size: int
    layers: list[int]
    target_tensors: int
    target_bytes: int
    target_files: list[str]
    carried_files: int
    carried_bytes: int
    linked_files: list[str]
    copied_files: list[str]
    unlisted_files: list[str]
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SUMMARY_SCHEMA, **asdict(self)}


def export(
    out: str | Path,
    dest: str | Path,
    *,
    overwrite: bool = False,
    copy_mode: CopyMode | str = CopyMode.AUTO,
    progress: Progress | None = None,
    swap_timeout: float | None = None,
) -> ExportSummary:
    """Write the output directory `out` as a plain HF checkpoint `dest` (layout: this module's notes).

    Before anything is written, `out` is checked as reshard checks it (manifest and its checksum, format
    version 2, every rank file's size and header, every listed file's size, the index, every replicated
    safetensors header against the index); every chunk is checked against its checksum as it is read
    and every carried file where it lands. Anything wrong is a ShardprepError naming the file, and
    `dest` is left as it was. `dest` is replaced atomically under a lock, only when it is empty or
    (with `overwrite`) a shardprep output, with free space checked first; `copy_mode` and
    `swap_timeout` work as in convert and `staged_output`. Files `out`'s manifest does not list have
    no checksum and are not carried over (`unlisted_files`).

    >>> export("out/", "plain/")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    try:
        mode = CopyMode(copy_mode)
    except ValueError:
        raise ShardprepError(f"--copy-mode {copy_mode!r}: expected one of auto, link, copy") from None
    out, dest = Path(out), Path(dest)
    with ExitStack() as reading_out:
        reading_out.enter_context(reading(out))  # one output, not half of one replaced meanwhile
        source = open_output(out, purpose="exported")
        plan = plan_export(source)
        check_output_dir(dest, [out], overwrite)  # early; again under the lock
        needed = _output_bytes(plan, source, dest, mode)
        with staged_output(dest, inputs=[out], overwrite=overwrite, needed_bytes=needed,
                           swap_timeout=swap_timeout) as tmp:
            linked = _write(plan, source, tmp, mode, progress)
            # Every byte of OUT is read: let a swap of OUT go on, and never wait for DIR's swap holding OUT.
            reading_out.close()
    targets = [e for f in plan.target_files for e in f.tensors]
    return ExportSummary(
        out=str(out),
        dest=str(dest),
        world_size=source.manifest.world_size,
        layers=[f.layer.layer for f in plan.target_files],
        target_tensors=len(targets),
        target_bytes=sum(e.nbytes for e in targets),
        target_files=[f.name for f in plan.target_files],
        carried_files=len(plan.carried),
        carried_bytes=sum(f.size for f in plan.carried),
        linked_files=[path for path, was_linked in linked.items() if was_linked],
        copied_files=[path for path, was_linked in linked.items() if not was_linked],
        unlisted_files=list(source.unlisted_files),
        seconds=time.perf_counter() - t0,
    )


def plan_export(source: OpenedOutput) -> ExportPlan:
    """Decide DIR's files and index from OUT's manifest, index and replicated headers (nothing is written).

    Raises IntegrityError when the index cannot be read or does not match the files it names.

    >>> plan_export(open_output("out/", purpose="exported")).index["weight_map"]["model.norm.weight"]  # doctest: +SKIP
    """
    m = source.manifest
    replicated, replicated_bytes = _replicated_part(source)
    target_files = tuple(TargetFile(target_file_name(r.layer), r, _file_order(r.entries)) for r in m.layers)
    written = {f.name: f"layer {f.layer.layer}'s targets" for f in target_files} | {EXPORT_RECORD: "its record"}
    for record in m.replicated_files:
        if record.path in written:
            raise ShardprepError(f"{source.root / record.path}: export writes {written[record.path]} to a file of this "
                                 "name; rename it in the source checkpoint and convert again")
    weight_map = {name: file for name, file in replicated.weight_map.items() if name != NOTICE_TENSOR}
    for f in target_files:
        weight_map.update((e.name, f.name) for e in f.tensors)
    metadata = {key: value for key, value in replicated.metadata.items() if key != "shardprep"}
    metadata["total_size"] = replicated_bytes + sum(e.nbytes for f in target_files for e in f.tensors)
    carried = tuple(f for f in m.replicated_files if f.path not in (m.replicated_index, NOTICE_FILE))
    exported_from = {"path": str(source.root.resolve()), "world_size": m.world_size, "created_by": m.created_by}
    provenance = {"schema": RECORD_SCHEMA, "created_by": CREATED_BY, "exported_from": exported_from,
                  "source": m.source, "quantization": m.quantization}
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return ExportPlan(target_files, carried, index, provenance)


def _replicated_part(source: OpenedOutput) -> tuple[ReplicatedIndex, int]:
    """OUT's index (checksum checked) and the bytes of the tensors it maps to real files, each file's header
    holding exactly the tensors the index maps to it (as `load_replicated` requires)."""
    m: Manifest = source.manifest
    index, problems = read_replicated_index(source.root, m, verify=True)
    if problems:
        raise problems[0].error()
    total = 0
    for name in index.files():
        if name == NOTICE_FILE:
            continue
        header = read_safetensors_header(resolve_inside(source.root, name))
        held, listed = set(header.tensors), index.tensors_of(name)
        if held != listed:
            odd = sorted(held ^ listed)[0]
            raise IntegrityError(f"{source.root / name}: does not hold exactly the tensors {m.replicated_index} maps "
                                 f"to it ({odd!r} differs); copy the whole output directory again",
                                 code="index_mismatch", file=name, tensor=odd)
        total += sum(t.nbytes for t in header.tensors.values())
    return index, total


def _file_order(entries: tuple[Entry, ...]) -> tuple[Entry, ...]:
    # Larger elements first (T's order within a size), as safetensors' own writer does: written back to back,
    # every tensor then starts on a multiple of its element size, which zero-copy readers need.
    return tuple(sorted(entries, key=lambda e: (-DTYPE_SIZES[e.dtype], e.offset)))


def _write(plan: ExportPlan, source: OpenedOutput, directory: Path, mode: CopyMode,
           progress: Progress | None) -> dict[str, bool]:
    """Write DIR's files into `directory`, the index last; returns, per carried file, whether it was linked."""
    _, linked = write_carrying(
        source, plan.carried, directory, mode,
        lambda writeback, check_carried: _write_targets(plan, source, directory, writeback, progress, check_carried))
    write_atomically(directory / REPLICATED_INDEX, json.dumps(plan.index, indent=2) + "\n")
    write_atomically(directory / EXPORT_RECORD, json.dumps(plan.record, indent=2) + "\n")
    return linked


def _write_targets(plan: ExportPlan, source: OpenedOutput, directory: Path, writeback: Writeback,
                   progress: Progress | None, check_carried: Callable[[], None]) -> None:
    # One buffer of max|T| for every layer: its N chunks are read into it, then its entries written out.
    buf = memoryview(bytearray(max(f.layer.total_bytes for f in plan.target_files)))
    total = sum(e.nbytes for f in plan.target_files for e in f.tensors)
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress:
            progress(done, total)

    advance(0)
    for f in plan.target_files:
        flat = buf[:f.layer.total_bytes]
        read_layer(source, f.layer, flat)
        tensors = [OutTensor(e.name, e.dtype, e.shape, flat[e.offset:e.offset + e.nbytes]) for e in f.tensors]
        with writing(directory / f.name):
            write_safetensors(directory / f.name, tensors, {"format": "pt"}, progress=advance, writeback=writeback)
        check_carried()  # a carried file that failed its check stops the run now, not after every layer


def _output_bytes(plan: ExportPlan, source: OpenedOutput, dest: Path, mode: CopyMode) -> int:
    """Disk bytes the export needs next to `dest` (an upper bound; a hard link costs nothing)."""
    device = output_device(dest)
    total = sum(carried_bytes(source.root / f.path, f.size, mode.value, device) for f in plan.carried)
    for f in plan.target_files:
        # A header entry: the name, the shape, the dtype and two offsets of at most 20 digits, in JSON.
        header = 64 + sum(len(json.dumps(e.name)) + len(json.dumps(list(e.shape))) + 96 for e in f.tensors)
        total += disk_bytes(header + sum(e.nbytes for e in f.tensors))
    return total + sum(disk_bytes(len(json.dumps(data, indent=2)) + 1) for data in (plan.index, plan.record))

