"""Exact reads: fill a buffer from a file at an offset, however many calls it takes.

One `os.pread`/`os.preadv` returns at most 2,147,479,552 bytes on Linux (and may return fewer at any
time), so a single call silently truncates a chunk or tensor over 2 GiB. Every reader in shardprep
goes through these helpers; a file that ends early is an IntegrityError naming it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import IntegrityError

# Linux's limit for one read call (MAX_RW_COUNT); reads are asked for in pieces no larger than this.
MAX_READ_CALL = 2_147_479_552
# Streaming readers (hashing, padding checks) hold one block at a time.
BLOCK_BYTES = 64 << 20

PreadInto = Callable[[int, memoryview, int], int]
"""preadinto(fd, dest, offset) → bytes read into dest (0 at end of file)."""


def _preadv(fd: int, dest: memoryview, offset: int) -> int:
    return os.preadv(fd, [dest], offset)


def pread_exact(fd: int, dest: memoryview, offset: int, path: str | Path, *,
                preadinto: PreadInto = _preadv) -> None:
    """Fill all of `dest` with the file's bytes from `offset` on; a file that ends first is an IntegrityError.

    `preadinto` is the one-call read (tests pass one that returns short reads).

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(b"0123456789")
    ...     f.flush()
    ...     buf = bytearray(4)
    ...     pread_exact(f.fileno(), memoryview(buf), 3, "demo")
    >>> bytes(buf)
    b'3456'
    """
    done, total = 0, len(dest)
    while done < total:
        n = preadinto(fd, dest[done:done + min(total - done, MAX_READ_CALL)], offset + done)
        if n <= 0:
            raise IntegrityError(f"{path}: truncated (ended at byte {offset + done}, needed {offset + total})",
                                 code="truncated_file", file=str(path))
        done += n


def read_exact(fd: int, nbytes: int, offset: int, path: str | Path, *, preadinto: PreadInto = _preadv) -> bytes:
    """`nbytes` bytes of the file from `offset`, read exactly (see `pread_exact`).

    >>> read_exact(fd, 4096, 0, "shards/rank-00000-of-00002.safetensors")  # doctest: +SKIP
    """
    buf = bytearray(nbytes)
    pread_exact(fd, memoryview(buf), offset, path, preadinto=preadinto)
    return bytes(buf)


def iter_blocks(fd: int, offset: int, nbytes: int, path: str | Path, block: int = BLOCK_BYTES, *,
                preadinto: PreadInto = _preadv) -> Iterator[tuple[int, memoryview]]:
    """(start, bytes) of `[offset, offset + nbytes)` in blocks of at most `block` bytes, each read exactly.

    The memoryview is reused by the next block: use it before advancing.

    >>> sum(len(b) for _, b in iter_blocks(fd, 0, 10 << 30, "rank.safetensors"))  # doctest: +SKIP
    """
    buf = memoryview(bytearray(min(block, nbytes)))
    at, end = offset, offset + nbytes
    while at < end:
        piece = buf[:min(block, end - at)]
        pread_exact(fd, piece, at, path, preadinto=preadinto)
        yield at, piece
        at += len(piece)


@contextmanager
def open_for_reading(path: str | Path, what: str = "file") -> Iterator[int]:
    """A file descriptor of `path` for reading, closed on exit; OS errors, when opening or inside the
    block, become an IntegrityError naming the file (codes `missing_file`, `unreadable_file`).

    >>> with open_for_reading("out/config.json", "config.json") as fd:  # doctest: +SKIP
    ...     data = read_exact(fd, 10, 0, "out/config.json")
    """
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise IntegrityError(f"{where}: {what} not found", code="missing_file", file=where) from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise IntegrityError(f"{where}: cannot read the {what} ({getattr(exc, 'strerror', None) or exc})",
                             code="unreadable_file", file=where) from None
    try:
        yield fd
    except IsADirectoryError:
        raise IntegrityError(f"{where}: is a directory, expected the {what}", code="unreadable_file",
                             file=where) from None
    except OSError as exc:
        raise IntegrityError(f"{where}: cannot read the {what} ({exc.strerror or exc})", code="unreadable_file",
                             file=where) from None
    finally:
        os.close(fd)
