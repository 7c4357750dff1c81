"""The manifest's layout rules that its JSON Schema cannot express (docs/format.md), checked once when a manifest
is parsed: after that every offset in it can be trusted by the loader and the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .draft_layers import DraftLayers, draft_problems
from .dtypes import tensor_nbytes
from .layout import Entry, FusedView, file_alignment_for, is_chunk_alignment
from .paths import is_safe_relpath
from .problems import Problem, quoted
from .rank_file import plan_rank_file, rank_file_name
from .records import FileRecord, LayerRecord

MANIFEST_NAME = "shard_manifest.json"


class Checked(Protocol):
    """What the invariants read of a manifest (`manifest.Manifest` has it all)."""

    @property
    def world_size(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def rank_files(self) -> Sequence[str]: ...
    @property
    def layers(self) -> Sequence[LayerRecord]: ...
    @property
    def replicated_index(self) -> str: ...
    @property
    def replicated_files(self) -> Sequence[FileRecord]: ...
    @property
    def entry_alignment(self) -> int: ...
    @property
    def file_alignment(self) -> int: ...
    @property
    def chunk_alignment(self) -> int: ...
    @property
    def draft(self) -> DraftLayers | None: ...


def check_invariants(m: Checked) -> list[Problem]:
    """Every layout rule of docs/format.md that the schema cannot express; returns the problems found.

    >>> from shardprep.manifests.manifest import Manifest
    >>> [p.message for p in check_invariants(Manifest(1, ("shards/r.bin",), (), version=1))]
    ['manifest has no layers']
    """
    problems: list[Problem] = []

    def bad(message: str, code: str = "manifest_invariant", *, layer: int | None = None,
            tensor: str | None = None, file: str | None = None) -> None:
        problems.append(Problem(code, message, file=file, layer=layer, tensor=tensor))

    n = m.world_size
    if len(m.rank_files) != n:
        bad(f"world_size is {n} but rank_files lists {len(m.rank_files)} files")
    if len(set(m.rank_files)) != len(m.rank_files):
        bad("rank_files lists the same file twice")
    listed = [f.path for f in m.replicated_files]
    for p in (*m.rank_files, m.replicated_index, *listed):
        if not is_safe_relpath(p):
            bad(f"path {quoted(p)} is absolute or leaves the output directory", "unsafe_path", file=str(p))
    if m.version >= 2:
        _check_v2_files(m, listed, bad)
    if not m.layers:
        bad("manifest has no layers")
        return problems
    seen_layers: set[int] = set()
    seen_names: set[str] = set()
    prev_end = 0
    for r in m.layers:
        tag = f"layer {r.layer}"
        if r.layer in seen_layers:
            bad(f"{tag} appears twice", layer=r.layer)
        seen_layers.add(r.layer)
        if r.file_offset % m.file_alignment:
            bad(f"{tag}: file_offset {r.file_offset} is not {m.file_alignment}-aligned", layer=r.layer)
        if r.file_offset < prev_end:
            bad(f"{tag}: file_offset {r.file_offset} overlaps the previous layer's chunk", layer=r.layer)
        prev_end = r.file_offset + r.chunk_bytes
        if r.total_bytes % (m.entry_alignment * n):
            bad(f"{tag}: total_bytes {r.total_bytes} is not a multiple of 16·world_size", layer=r.layer)
        if r.chunk_bytes * n != r.total_bytes:
            bad(f"{tag}: chunk_bytes·world_size {r.chunk_bytes * n} != total_bytes {r.total_bytes}", layer=r.layer)
        if r.chunk_bytes % m.chunk_alignment:
            bad(f"{tag}: chunk_bytes {r.chunk_bytes} is not a multiple of chunk_alignment {m.chunk_alignment}",
                layer=r.layer)
        if len(r.checksums) != n:
            bad(f"{tag}: {len(r.checksums)} checksums for {n} ranks (every chunk needs one)", "checksum_count",
                layer=r.layer)
        _check_entries(r, m.entry_alignment, seen_names, bad)
    if m.draft is not None:
        for problem in draft_problems(m.draft, [r.layer for r in m.layers]):
            bad(problem, "draft_layers")
    if m.version >= 2 and not problems:
        _check_v2_offsets(m, bad)
    return problems


def _check_v2_files(m: Checked, listed: list[str], bad: Any) -> None:
    if not is_chunk_alignment(m.chunk_alignment):
        bad(f"chunk_alignment {m.chunk_alignment} is not a power of two from 16 bytes to 64 MiB")
    elif m.file_alignment != file_alignment_for(m.chunk_alignment):
        bad(f"file_alignment {m.file_alignment} is not max(4096, chunk_alignment) = "
            f"{file_alignment_for(m.chunk_alignment)}")
    for r, name in enumerate(m.rank_files):
        if name != rank_file_name(r, m.world_size):
            bad(f"rank_files[{r}] is {quoted(name)}, not {rank_file_name(r, m.world_size)!r}", file=str(name))
            break
    if len(set(listed)) != len(listed):
        bad("replicated_files lists the same path twice")
    own = {MANIFEST_NAME, *m.rank_files}
    for p in listed:
        if p in own:
            bad(f"replicated_files lists {quoted(p)}, which is the manifest or a rank file", file=p)
    if m.replicated_index not in listed:
        bad(f"replicated_files has no checksum of the index {quoted(m.replicated_index)}",
            file=m.replicated_index)


def _check_v2_offsets(m: Checked, bad: Any) -> None:
    # In version 2 the rank file's layout follows from the layers alone (docs/format.md), which is what
    # makes its header the same bytes on every rank and rebuildable by any reader.
    try:
        expected, _ = plan_rank_file([(r.layer, r.chunk_bytes) for r in m.layers], m.world_size,
                                     m.file_alignment)
    except (ValueError, ZeroDivisionError):
        bad("the layers' sizes do not give a rank file layout")
        return
    for r, want in zip(m.layers, expected):
        if r.file_offset != want:
            bad(f"layer {r.layer}: file_offset {r.file_offset} is not {want}, where the rank file layout puts it",
                layer=r.layer)
            return


def _check_entries(r: LayerRecord, entry_alignment: int, seen_names: set[str], bad: Any) -> None:
    tag = f"layer {r.layer}"
    end = 0
    by_name = {}
    for e in sorted(r.entries, key=lambda e: e.offset):
        if e.name in seen_names:
            bad(f"tensor {quoted(e.name)} appears twice in the manifest", layer=r.layer, tensor=e.name)
        seen_names.add(e.name)
        by_name[e.name] = e
        if e.offset % entry_alignment:
            bad(f"tensor {quoted(e.name)}: offset {e.offset} is not {entry_alignment}-aligned", layer=r.layer,
                tensor=e.name)
        if e.offset < end:
            bad(f"tensor {quoted(e.name)}: offset {e.offset} overlaps the previous entry", layer=r.layer,
                tensor=e.name)
        if e.nbytes != tensor_nbytes(e.dtype, e.shape, tensor=e.name):
            bad(f"tensor {quoted(e.name)}: nbytes {e.nbytes} does not match {e.dtype}{list(e.shape)}",
                layer=r.layer, tensor=e.name)
        end = e.offset + e.nbytes
    if end > r.total_bytes:
        bad(f"{tag}: entries end at byte {end}, past total_bytes {r.total_bytes}", layer=r.layer)
    for v in r.views:
        problem = _check_view(v, by_name, tag) or _check_pad_rows(v, by_name, r, tag)
        if problem:
            bad(problem, layer=r.layer, tensor=v.name)


def _check_view(v: FusedView, entries: dict[str, Entry], tag: str) -> str | None:
    missing = [name for name in v.members if name not in entries]
    if missing:
        return f"{tag}: fused view {quoted(v.name)} names unknown member {quoted(missing[0])}"
    at = v.offset
    rows = 0
    for name in v.members:
        e = entries[name]
        if e.offset != at or e.dtype != v.dtype or not e.shape or tuple(e.shape[1:]) != tuple(v.shape[1:]):
            return f"{tag}: fused view {quoted(v.name)} does not cover member {quoted(name)} contiguously"
        at += e.nbytes
        rows += e.shape[0]
    if not v.shape or rows + v.pad_rows != v.shape[0]:
        pad = f" and {v.pad_rows} pad rows" if v.pad_rows else ""
        return f"{tag}: fused view {quoted(v.name)} has shape {list(v.shape)} but its members have {rows} rows{pad}"
    return None


def _check_pad_rows(v: FusedView, entries: dict[str, Entry], r: LayerRecord, tag: str) -> str | None:
    """A view's pad rows must be bytes of T that no entry holds (so they are zero padding, which validate checks)."""
    if not v.pad_rows:
        return None
    last = entries[v.members[-1]]
    start, end = last.offset + last.nbytes, v.offset + v.nbytes
    if end > r.total_bytes:
        return f"{tag}: fused view {quoted(v.name)}'s {v.pad_rows} pad rows end at byte {end}, past total_bytes"
    inside = next((e.name for e in r.entries if e.offset < end and e.offset + e.nbytes > start), None)
    if inside is not None:
        return f"{tag}: fused view {quoted(v.name)}'s {v.pad_rows} pad rows overlap tensor {quoted(inside)}"
    return None
