"""A manifest's records: one layer's (its packed layout, where its chunk sits in every rank file, its
checksums) and one replicated file's (path, size, checksum), and reading one rank's chunk of a layer.
Pure: no torch, nothing that writes files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import IntegrityError
from .checksums import digest
from .exact_read import pread_exact
from .layout import Entry, FusedView, LayerLayout


@dataclass(frozen=True)
class LayerRecord:
    """One layer of the manifest: its packed layout, where its chunk sits in every rank file, and checksums."""

    layer: int
    file_offset: int
    chunk_bytes: int
    total_bytes: int
    entries: tuple[Entry, ...]
    views: tuple[FusedView, ...] = ()
    checksums: tuple[str, ...] = ()

    @classmethod
    def from_layout(cls, layout: LayerLayout, file_offset: int, checksums: tuple[str, ...] = ()) -> LayerRecord:
        return cls(layout.layer, file_offset, layout.chunk_bytes, layout.total_bytes, layout.entries,
                   layout.views, checksums)

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)


def read_chunk(fd: int, path: str | Path, record: LayerRecord, rank: int, dest: memoryview, *,
               verify: bool = True) -> None:
    """Read `rank`'s chunk of `record`'s layer from its open rank file `fd` into `dest` (chunk_bytes long)
    and, with `verify`, check it against the manifest's checksum: IntegrityError naming `path` otherwise.

    >>> read_chunk(fd, "out/shards/rank-00001-of-00002.safetensors", record, 1, buffer)  # doctest: +SKIP
    """
    pread_exact(fd, dest, record.file_offset, path)
    if verify and (got := digest(dest)) != record.checksums[rank]:
        end = record.file_offset + record.chunk_bytes
        raise IntegrityError(
            f"{path}: layer {record.layer}'s chunk (bytes {record.file_offset}..{end}) has checksum {got}, the "
            f"manifest says {record.checksums[rank]}; the file is corrupt, copy it again",
            code="checksum_mismatch", file=str(path), layer=record.layer)


@dataclass(frozen=True)
class FileRecord:
    """A file of the output other than the manifest and the rank files: its path, size and XXH3-128."""

    path: str
    size: int
    xxh3_128: str
