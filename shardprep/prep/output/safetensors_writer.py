"""Streaming safetensors writer: tensors are copied file-to-file by byte range, never loaded whole.

Tensors that lie next to each other in the same source file are copied in one `copy_file_range` run,
so a file that keeps most of its tensors costs a few large kernel copies, as `cp` would.

With a hasher the file's checksum is taken while it is written: bytes from memory are hashed where
they are, and only the ranges the kernel copied are read back. Reading a whole written file back cost
a fifth of the main thread of a block-FP8 convert, whose replicated files are requantized in memory
(docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...manifests.dtypes import tensor_nbytes
from ...manifests.exact_read import iter_blocks
from .file_ranges import copy_range, pwrite_all

if TYPE_CHECKING:
    from .writeback import Writeback

# Large enough that a copy costs one system call per tens of MB, small enough that the disk starts
# writing the first piece while the next is copied.
COPY_PIECE = 64 << 20


@dataclass(frozen=True)
class FileRange:
    """Bytes to copy from an existing file."""

    path: Path
    start: int
    nbytes: int


@dataclass(frozen=True)
class OutTensor:
    """One tensor to write: header fields plus where its bytes come from (a file range, or bytes in memory)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: FileRange | bytes | memoryview | Callable[[], Any]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape, tensor=self.name)


def write_safetensors(
    path: str | Path,
    tensors: Sequence[OutTensor],
    metadata: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
    writeback: Writeback | None = None,
    hasher: Any = None,
) -> int:
    """Write a standard safetensors file; returns its data size (the sum of tensor bytes).

    In-memory data may be bytes or any buffer (a numpy array); a callable is called when its turn
    comes. With `writeback`, the disk write of each finished piece starts at once. With `hasher` (an
    object with `update`, such as `checksums.file_hasher()`), every byte of the file is fed to it in
    order: its digest is then the file's.

    >>> write_safetensors("x.safetensors", [OutTensor("a", "F32", (1,), b"\\0\\0\\x80?")])  # doctest: +SKIP
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    at = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so the data starts 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    # Read and write: with a hasher, what the kernel copied is read back from here.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
    sources: dict[Path, int] = {}
    try:
        pwrite_all(fd, head, 0)
        if hasher is not None:
            hasher.update(head)
        pos, started = len(head), 0
        for data, nbytes in _runs(tensors):
            if isinstance(data, FileRange):
                if data.path not in sources:
                    sources[data.path] = os.open(data.path, os.O_RDONLY)
                for piece in range(0, nbytes, COPY_PIECE):
                    n = min(COPY_PIECE, nbytes - piece)
                    copy_range(sources[data.path], data.start + piece, fd, pos + piece, n, data.path)
                    if hasher is not None:  # just written, so still in the page cache
                        for _, block in iter_blocks(fd, pos + piece, n, path):
                            hasher.update(block)
                    if writeback is not None:
                        writeback.start(path, started, pos + piece + n - started)
                        started = pos + piece + n
            else:
                pwrite_all(fd, data, pos)
                if hasher is not None:
                    hasher.update(data)
                if writeback is not None and pos + nbytes - started >= COPY_PIECE:
                    writeback.start(path, started, pos + nbytes - started)
                    started = pos + nbytes
            pos += nbytes
            if progress:
                progress(nbytes)
        if writeback is not None:
            writeback.start(path, started, pos - started)
    finally:
        for src in sources.values():
            os.close(src)
        os.close(fd)
    return at


def _runs(tensors: Sequence[OutTensor]) -> Iterator[tuple[FileRange | memoryview, int]]:
    """The tensors' data in order, adjacent ranges of one file merged into one; callables called in turn."""
    run: FileRange | None = None
    for t in tensors:
        data = t.data() if callable(t.data) else t.data
        if isinstance(data, FileRange):
            if run is not None and run.path == data.path and run.start + run.nbytes == data.start:
                run = FileRange(run.path, run.start, run.nbytes + data.nbytes)
                continue
            if run is not None:
                yield run, run.nbytes
            run = data
            continue
        if run is not None:
            yield run, run.nbytes
            run = None
        view = memoryview(data).cast("B")
        if len(view) != t.nbytes:
            raise ValueError(f"tensor {t.name!r}: {len(view)} bytes given for {t.dtype}{list(t.shape)}")
        yield view, t.nbytes
    if run is not None:
        yield run, run.nbytes
