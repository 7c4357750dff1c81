"""`shardprep convert`: HF safetensors checkpoint in, per-rank flat chunks + manifest + replicated part out.

Three steps: open the source (headers only), make the plan (`plan.py`: every decision, no writes), and
carry it out (`output/writer.py`) inside `staged_output` (`output/output_dir.py`): a locked staging sibling of OUT
that replaces OUT atomically only once the manifest, written last, is on disk.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ShardprepError
from ..manifests.manifest import MAX_WORLD_SIZE
from .convert_plan import ConvertPlan, make_plan, parse_chunk_alignment
from .header_source import open_headers
from .hub.repo_id import hub_repo_id
from .hub.stream import check_requant_pairs, open_hub_source
from .output.output_dir import check_output_dir, staged_output
from .output.writer import CopyMode, Progress, output_bytes, write_plan
from .requant_jobs import RequantOptions
from .selection import check_preset_fits, make_selection
from .source import SourceCheckpoint, open_source

SUMMARY_SCHEMA = "shardprep/convert-summary/1"


@dataclass
class ConvertSummary:
    """What convert wrote (or, with `dry_run`, would write); `--json` prints `to_dict()`."""

    out: str
    world_size: int
    layers: list[int]
    target_tensors: int
    target_bytes: int
    sharded_bytes: int
    rank_file_bytes: int
    chunk_alignment: int
    alignment_padding_bytes: int
    replicated_tensors: int
    replicated_bytes: int
    linked_files: list[str]
    copied_files: list[str]
    requantized_tensors: int = 0  # weights and their scales: every tensor the requant rewrites
    requantized_weights: int = 0
    requantized_blocks: int = 0  # 128×128 blocks, one scale each, over the requantized weights
    quantization: dict[str, Any] | None = None
    seconds: float = 0.0
    dry_run: bool = False
    plan: dict[str, Any] = field(default_factory=dict)
    fetched_bytes: int | None = None  # a hub id: what its headers (a dry run) or its files cost to fetch
    source_peak_bytes: int | None = None  # a hub id fetched a layer at a time: the most source bytes on disk at once
    preset: str | None = None  # the preset applied: --preset's, or a draft checkpoint's own (make_selection)
    draft: dict[str, Any] | None = None  # the manifest's draft record (DraftLayers.record), None without a draft

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SUMMARY_SCHEMA, **asdict(self)}


def convert(
    src: str | Path,
    out: str | Path,
    ranks: int,
    *,
    targets: Sequence[str] = (),
    preset: str | None = None,
    layers: str | None = None,
    layer_pattern: str | None = None,
    revision: str | None = None,
    copy_mode: CopyMode | str = CopyMode.AUTO,
    overwrite: bool = False,
    requant: RequantOptions | None = None,
    chunk_alignment: str | int = "auto",
    dry_run: bool = False,
    progress: Progress | None = None,
    allow_preset_mismatch: bool = False,
    keep_source: bool = False,
) -> ConvertSummary:
    """Convert a checkpoint into `ranks` per-rank files plus a manifest and the replicated part.

    With `dry_run` a hub id is read from its headers alone (`header_source.py`), nothing downloaded.
    `requant` holds the block-FP8 options (default: requantize to UE8M0 where needed, the SGLang
    recipe). `chunk_alignment` is "auto", "none" or a size such as "2MiB" (see docs/format.md). A draft model's
    own checkpoint (DFlash, EAGLE-3) gets its preset without `preset` or `targets`, and every layer without
    `layers` (else `1-`): `selection.make_selection`. With
    `dry_run` nothing is written: the summary says what would be. OUT is replaced atomically, under a
    lock, only when it is empty or (with `overwrite`) a shardprep output, and only when the parent's
    filesystem has room for what the plan writes; see docs/reliability.md. A preset that does not fit the
    checkpoint's model type is refused (`selection.check_preset_fits`) unless `allow_preset_mismatch`.
    A hub id is fetched a layer at a time and each file dropped once converted (`hub/stream.py`: the disk holds
    the output and a file or two of the source); `keep_source` (or HF_HUB_OFFLINE) downloads the whole snapshot
    into the HF cache first, as huggingface_hub's `snapshot_download` does, and keeps it.

    >>> convert("Qwen/Qwen3-30B-A3B", "out/", ranks=8, preset="qwen3-moe")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    mode = check_write_options(ranks, copy_mode, chunk_alignment)  # before the source is read
    out = Path(out)
    repo_id = None if dry_run or keep_source else streamable_repo_id(src)
    if repo_id is not None:
        return _convert_streamed(repo_id, out, ranks, mode, t0, targets=targets, preset=preset, layers=layers,
                                 layer_pattern=layer_pattern, revision=revision, overwrite=overwrite, requant=requant,
                                 chunk_alignment=chunk_alignment, progress=progress,
                                 allow_preset_mismatch=allow_preset_mismatch)
    # A dry run of a hub id reads the headers alone (by HTTP range), never the weights.
    ckpt = open_headers(src, revision) if dry_run else open_source(src, revision)
    if not dry_run:
        check_output_dir(out, [ckpt.root], overwrite)  # early, before planning; again under the lock
    plan = _plan(ckpt, src, ranks, targets, preset, layers, layer_pattern, requant, chunk_alignment,
                 allow_preset_mismatch)
    if dry_run:
        return _summary(out, plan, t0, dry_run=True)
    needed = output_bytes(plan, out, mode.value)
    with staged_output(out, inputs=[ckpt.root], overwrite=overwrite, needed_bytes=needed) as tmp:
        result = write_plan(plan, tmp, mode.value, progress)
    return _summary(out, plan, t0, linked=result.linked_files, copied=result.copied_files,
                    replicated_tensors=result.replicated_tensors, replicated_bytes=result.replicated_bytes)


def _plan(ckpt: SourceCheckpoint, src: str | Path, ranks: int, targets: Sequence[str], preset: str | None,
          layers: str | None, layer_pattern: str | None, requant: RequantOptions | None, chunk_alignment: str | int,
          allow_preset_mismatch: bool) -> ConvertPlan:
    selection = make_selection(ckpt.config, targets=targets, preset=preset, layers=layers,
                               layer_pattern=layer_pattern)
    if not allow_preset_mismatch:
        check_preset_fits(ckpt.tensors, ckpt.config, selection, str(src))
    return make_plan(ckpt, ranks, selection, requant, chunk_alignment)


def streamable_repo_id(src: str | Path) -> str | None:
    """`src` as a hub repo id that `convert` fetches a layer at a time; None for a local path, and offline
    (HF_HUB_OFFLINE=1), where only a snapshot in the HF cache can serve.

    >>> streamable_repo_id("./my-model") is None
    True
    """
    repo_id = hub_repo_id(src)
    if repo_id is None:
        return None
    from huggingface_hub import constants

    return None if constants.HF_HUB_OFFLINE else repo_id


def _convert_streamed(repo_id: str, out: Path, ranks: int, mode: CopyMode, t0: float, *, targets: Sequence[str],
                      preset: str | None, layers: str | None, layer_pattern: str | None, revision: str | None,
                      overwrite: bool, requant: RequantOptions | None, chunk_alignment: str | int,
                      progress: Progress | None, allow_preset_mismatch: bool) -> ConvertSummary:
    """`convert` of a hub id with bounded disk (`hub/stream.py`)."""
    check_output_dir(out, [], overwrite)  # before a byte is fetched; again under the lock
    source = open_hub_source(repo_id, revision, out)
    try:
        plan = _plan(source.checkpoint, repo_id, ranks, targets, preset, layers, layer_pattern, requant,
                     chunk_alignment, allow_preset_mismatch)
        check_requant_pairs(plan)
        with staged_output(out, inputs=[source.fetch_dir], overwrite=overwrite,
                           needed_bytes=source.disk_bytes_needed(plan)) as tmp:
            # The fetch directory is touched under OUT's lock only, so no other conversion into OUT shares it.
            try:
                feed = source.feed(plan)
                result = write_plan(plan, tmp, mode.value, progress, feed)
            except BaseException:
                source.close(keep=True)  # what was converted, for the next run to resume from
                raise
            source.close(keep=False)
    finally:
        source.reader.close()
    summary = _summary(out, plan, t0, linked=result.linked_files, copied=result.copied_files,
                       replicated_tensors=result.replicated_tensors, replicated_bytes=result.replicated_bytes)
    return replace(summary, source_peak_bytes=feed.peak_bytes)


def check_write_options(ranks: object, copy_mode: CopyMode | str, chunk_alignment: str | int) -> CopyMode:
    """Refuse a bad `--ranks`, `--copy-mode` or `--chunk-alignment` (convert's and reshard's) with one line.

    >>> check_write_options(8, "auto", "2MiB")
    <CopyMode.AUTO: 'auto'>
    """
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ShardprepError(f"--ranks must be >= 1, got {ranks!r}")
    if ranks > MAX_WORLD_SIZE:
        raise ShardprepError(f"--ranks {ranks} is above the maximum of {MAX_WORLD_SIZE} ranks (docs/format.md)")
    try:
        mode = CopyMode(copy_mode)
    except ValueError:
        raise ShardprepError(f"--copy-mode {copy_mode!r}: expected one of auto, link, copy") from None
    parse_chunk_alignment(chunk_alignment)
    return mode


def _summary(out: Path, plan: ConvertPlan, t0: float, *, dry_run: bool = False, linked: Sequence[str] = (),
             copied: Sequence[str] = (), replicated_tensors: int | None = None,
             replicated_bytes: int | None = None) -> ConvertSummary:
    if replicated_tensors is None:
        replicated_tensors = sum(len(plan.source.files[f.name].tensors) if f.tensors is None else len(f.tensors)
                                 for f in plan.replicated)
    return ConvertSummary(
        out=str(out),
        world_size=plan.world_size,
        layers=[lay.layer for lay in plan.layouts],
        target_tensors=sum(len(lay.entries) for lay in plan.layouts),
        target_bytes=plan.target_bytes,
        sharded_bytes=plan.sharded_bytes,
        rank_file_bytes=plan.rank_file_bytes,
        chunk_alignment=plan.chunk_alignment,
        alignment_padding_bytes=plan.alignment_padding_bytes,
        replicated_tensors=replicated_tensors,
        replicated_bytes=plan.replicated_bytes if replicated_bytes is None else replicated_bytes,
        linked_files=list(linked),
        copied_files=list(copied),
        requantized_tensors=len(plan.rewritten),
        requantized_weights=len(plan.requant.jobs) if plan.requant else 0,
        requantized_blocks=sum(math.prod(job.scale.shape) for job in plan.requant.jobs.values()) if plan.requant else 0,
        quantization=plan.requant.manifest_record if plan.requant else None,
        seconds=time.perf_counter() - t0,
        dry_run=dry_run,
        plan=plan.describe() if dry_run else {},
        fetched_bytes=plan.source.fetched_bytes() if plan.source.fetched_bytes else None,
        preset=plan.selection.preset.name if plan.selection.preset else None,
        draft=plan.draft.record() if plan.draft else None,
    )
