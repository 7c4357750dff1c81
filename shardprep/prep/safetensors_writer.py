"""Streaming safetensors writer: tensors are copied file-to-file by byte range, never loaded whole."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..manifests.dtypes import tensor_nbytes

COPY_BLOCK = 16 << 20


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
    data: FileRange | bytes | Callable[[], bytes]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape, tensor=self.name)


def write_safetensors(
    path: str | Path,
    tensors: Sequence[OutTensor],
    metadata: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write a standard safetensors file; returns its data size (the sum of tensor bytes).

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
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for t in tensors:
            data = t.data() if callable(t.data) else t.data
            if isinstance(data, FileRange):
                copy_range(data, out)
            else:
                if len(data) != t.nbytes:
                    raise ValueError(f"tensor {t.name!r}: {len(data)} bytes given for {t.dtype}{list(t.shape)}")
                out.write(data)
            if progress:
                progress(t.nbytes)
    return at


def copy_range(src: FileRange, out: BinaryIO) -> None:
    """Copy a byte range into an open file at its current position, in the kernel where possible."""
    out.flush()
    with open(src.path, "rb") as f:
        left, pos = src.nbytes, src.start
        dst_pos = out.tell()
        try:
            while left:
                n = os.copy_file_range(f.fileno(), out.fileno(), left, pos, dst_pos)
                if n == 0:
                    raise OSError(f"{src.path}: unexpected end of file")
                left, pos, dst_pos = left - n, pos + n, dst_pos + n
            out.seek(dst_pos)
            return
        except (AttributeError, OSError) as exc:
            if left != src.nbytes or isinstance(exc, OSError) and "unexpected end" in str(exc):
                raise
        f.seek(pos)
        while left:
            block = f.read(min(COPY_BLOCK, left))
            if not block:
                raise OSError(f"{src.path}: unexpected end of file")
            out.write(block)
            left -= len(block)
