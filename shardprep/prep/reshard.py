"""`shardprep reshard OUT NEW --ranks M`: an output directory for N ranks rewritten for M, without the source.

Three steps, like convert: open OUT (`output/opened_output.py`: the manifest, every rank file's size and
header, every listed file), plan the new layout from the manifest alone (`reshard_plan.py`), and write
NEW inside `staged_output`. Writing streams one layer at a time through one buffer: its N chunks are
read and checked against their checksums, the padding above the last entry is zeroed, and the M chunks
are checksummed and written. Meanwhile a thread pool hard-links (or copies) the replicated part, which
does not depend on N, and checks every file's checksum in NEW's staging directory
(`output/carried_files.py`). The manifest, the input's with the new layout and a `resharded_from` record,
is written last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..manifests.checksums import digest
from ..manifests.layout import chunk_range
from ..manifests.manifest import LayerRecord, Manifest, rank_file_name
from ..manifests.swap_lock import reading
from .convert import check_write_options
from .output.carried_files import write_carrying
from .output.opened_output import OpenedOutput, open_output, read_layer
from .output.output_dir import check_output_dir, staged_output
from .output.writeback import Writeback
from .output.writer import (
    CREATED_BY,
    CopyMode,
    Progress,
    carried_bytes,
    create_rank_file,
    disk_bytes,
    output_device,
    write_chunk,
    write_manifest,
)
from .reshard_plan import ReshardPlan, plan_reshard

SUMMARY_SCHEMA = "shardprep/reshard-summary/1"


@dataclass
class ReshardSummary:
    """What reshard wrote; `--json` prints `to_dict()`."""

    out: str
    new: str
    from_world_size: int
    world_size: int
    layers: list[int]
    target_tensors: int
    target_bytes: int
    sharded_bytes: int
    rank_file_bytes: int
    chunk_alignment: int
    alignment_padding_bytes: int
    replicated_files: int
    replicated_bytes: int
    linked_files: list[str]
    copied_files: list[str]
    unlisted_files: list[str]
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SUMMARY_SCHEMA, **asdict(self)}


def reshard(
    out: str | Path,
    new: str | Path,
    ranks: int,
    *,
    overwrite: bool = False,
    chunk_alignment: str | int = "auto",
    copy_mode: CopyMode | str = CopyMode.AUTO,
    progress: Progress | None = None,
) -> ReshardSummary:
    """Rewrite the output directory `out` (N rank files) as `new` with `ranks` rank files; no source needed.

    `new` gets exactly what `convert SRC new --ranks M` with `out`'s selection writes, but for the manifest's
    `resharded_from` record (and its own checksum): docs/format.md. Every rank file's size and header are
    checked before anything is written, every input chunk against its checksum as it is read, and every
    other file against its checksum in NEW's staging directory right after it is linked (`copy_mode` auto,
    link) or copied; anything corrupt or missing is a ShardprepError naming the file, and `new` is left as
    it was. `chunk_alignment` and `overwrite` work as
    in convert, and so do the guarantees of docs/reliability.md (atomic replacement, lock, free space).
    Files in `out` that its manifest does not list have no checksum: they are not carried over
    (`unlisted_files`).

    >>> reshard("out-8/", "out-4/", ranks=4)  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    mode = check_write_options(ranks, copy_mode, chunk_alignment)
    out, new = Path(out), Path(new)
    with ExitStack() as reading_out:
        reading_out.enter_context(reading(out))  # one output, not half of one replaced meanwhile
        source = open_output(out, purpose="resharded")
        check_output_dir(new, [out], overwrite)  # early, before planning; again under the lock
        plan = plan_reshard(source.manifest, ranks, chunk_alignment, where=str(source.manifest_path))
        resharded_from = {"path": str(source.root.resolve()), "world_size": source.manifest.world_size,
                          "chunk_alignment": source.manifest.chunk_alignment,
                          "created_by": source.manifest.created_by}
        needed = _output_bytes(plan, source, new, mode)
        with staged_output(new, inputs=[out], overwrite=overwrite, needed_bytes=needed) as tmp:
            manifest, linked = _write(plan, source, tmp, mode, resharded_from, progress)
            # Every byte of OUT is read: let a swap of OUT go on, and never wait for NEW's swap holding OUT.
            reading_out.close()
    return ReshardSummary(
        out=str(out),
        new=str(new),
        from_world_size=source.manifest.world_size,
        world_size=plan.world_size,
        layers=[r.layer for r in manifest.layers],
        target_tensors=sum(len(r.entries) for r in manifest.layers),
        target_bytes=sum(e.nbytes for r in manifest.layers for e in r.entries),
        sharded_bytes=plan.rank_layout.sharded_bytes,
        rank_file_bytes=plan.rank_layout.rank_file_bytes,
        chunk_alignment=plan.rank_layout.chunk_alignment,
        alignment_padding_bytes=plan.rank_layout.padding_bytes,
        replicated_files=len(manifest.replicated_files),
        replicated_bytes=sum(f.size for f in manifest.replicated_files),
        linked_files=[path for path, was_linked in linked.items() if was_linked],
        copied_files=[path for path, was_linked in linked.items() if not was_linked],
        unlisted_files=list(source.unlisted_files),
        seconds=time.perf_counter() - t0,
    )


def _write(plan: ReshardPlan, source: OpenedOutput, directory: Path, mode: CopyMode,
           resharded_from: dict[str, Any], progress: Progress | None) -> tuple[Manifest, dict[str, bool]]:
    """Write NEW's files into `directory`, the manifest last; returns it and, per replicated file, whether
    it was hard-linked."""
    records, linked = write_carrying(
        source, plan.source.replicated_files, directory, mode,
        lambda writeback, check_carried: _move_layers(plan, source, directory, writeback, progress, check_carried))
    manifest = replace(plan.skeleton_manifest(resharded_from), layers=tuple(records), created_by=CREATED_BY)
    write_manifest(directory, manifest)
    return manifest, linked


def _move_layers(plan: ReshardPlan, source: OpenedOutput, directory: Path, writeback: Writeback,
                 progress: Progress | None, check_carried: Callable[[], None]) -> list[LayerRecord]:
    # One buffer for every layer (the longer of |T| for N and for M), one rank file open at a time.
    (directory / "shards").mkdir()
    paths = [directory / rank_file_name(r, plan.world_size) for r in range(plan.world_size)]
    for path in paths:
        create_rank_file(path, plan.rank_layout.header, plan.rank_layout.rank_file_bytes)
    buf = memoryview(bytearray(plan.buffer_bytes))
    total, done = plan.rank_layout.sharded_bytes, 0
    if progress:
        progress(0, total)
    records = []
    for move in plan.moves:
        read_layer(source, move.source, buf[:move.source.total_bytes])
        flat = buf[:move.layout.total_bytes]
        # Below the last entry T's bytes are the N chunks' (checked, padding included); above it they are
        # zero by the format, and the buffer may still hold a longer layer's bytes there.
        flat[move.used_bytes:] = bytes(len(flat) - move.used_bytes)
        sums = []
        for r, path in enumerate(paths):
            lo, hi = chunk_range(r, move.layout.chunk_bytes)
            sums.append(digest(flat[lo:hi]))
            write_chunk(path, flat[lo:hi], move.file_offset, writeback)
            done += hi - lo
            if progress:
                progress(done, total)
        records.append(LayerRecord.from_layout(move.layout, move.file_offset, tuple(sums)))
        check_carried()  # a replicated file that failed its check stops the run now, not after every layer
    return records


def _output_bytes(plan: ReshardPlan, source: OpenedOutput, new: Path, mode: CopyMode) -> int:
    """Disk bytes the write needs next to `new` (an upper bound; a hard link costs nothing)."""
    device = output_device(new)
    total = plan.world_size * disk_bytes(plan.rank_layout.rank_file_bytes)
    for f in plan.source.replicated_files:
        total += carried_bytes(source.root / f.path, f.size, mode.value, device)
    # The manifest: the input's records with M checksums of 32 hex digits (and JSON around them) per layer.
    skeleton = plan.skeleton_manifest({}).to_json()
    return total + disk_bytes(len(skeleton) + 64 * plan.world_size * len(plan.moves))

