"""Output reaches the disk while convert still copies, instead of all at once at the end.

Left alone, what convert writes stays dirty in the page cache until the staging tree's fsync pass
(`output_dir.staged_output`; the kernel starts on its own only after 30 s, or past
`dirty_background_ratio`): the disk idles while the CPU copies, then the CPU idles while the disk
writes. `Writeback.start(path, offset, nbytes)` asks the kernel to begin writing a finished range now
(`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which does not wait for the write to complete), so the two
overlap and the final fsyncs find little left to do. The call blocks while the device's queue is full,
so a background thread makes it, never a copying thread; it opens the file for each request and closes
it again, so no descriptor is held between requests.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None  # not Linux: the final fsyncs do all of the writing
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


class Writeback:
    """Starts the disk writes of finished ranges from a background thread.

    Use as a context manager; leaving it drops the requests not yet made (the final fsyncs write
    everything anyway).

    >>> with Writeback() as writeback:  # doctest: +SKIP
    ...     pwrite_all(fd, chunk, offset)
    ...     writeback.start(path, offset, len(chunk))
    """

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[str, int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def __enter__(self) -> Writeback:
        if _sync_file_range is not None:
            self._thread = threading.Thread(target=self._run, name="shardprep-writeback", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stopping = True
            self._requests.put(None)
            self._thread.join()
            self._thread = None

    def start(self, path: str | Path, offset: int, nbytes: int) -> None:
        """`nbytes` at `offset` of `path` are written: begin putting them on disk."""
        if self._thread is not None and nbytes > 0:
            self._requests.put((os.fspath(path), offset, nbytes))

    def _run(self) -> None:
        assert _sync_file_range is not None
        while (request := self._requests.get()) is not None:
            if self._stopping:
                continue
            path, offset, nbytes = request
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # gone (an error elsewhere removed the staging tree): nothing to write
            try:
                # An error here (EIO) comes back from the final fsync, where it is reported.
                _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)
            finally:
                os.close(fd)
