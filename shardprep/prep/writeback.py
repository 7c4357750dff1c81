"""Output reaches the disk while convert still copies, and every output file is fsynced before it returns.

Left alone, what convert writes stays dirty in the page cache until someone syncs it (the kernel starts
on its own only after 30 s, or past `dirty_background_ratio`): the disk idles while the CPU copies, then
the CPU idles while the disk writes. `Writeback.start(path, offset, nbytes)` asks the kernel to begin
writing a finished range now (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which does not wait for the
write to complete), so the two overlap. The call blocks while the device's queue is full, so a
background thread makes it, never a copying thread. `finish()` fsyncs every file it was told about.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None  # not Linux: the final fsync does all of the writing
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


class Writeback:
    """Starts the disk writes of finished ranges in the background; `finish()` fsyncs every file seen.

    Use as a context manager; leaving it without `finish()` (an error) stops the thread and closes
    the files without waiting for the disk.

    >>> with Writeback() as writeback:  # doctest: +SKIP
    ...     pwrite_all(fd, chunk, offset)
    ...     writeback.start(path, offset, len(chunk))
    ...     writeback.finish()
    """

    def __init__(self) -> None:
        self._kick = _sync_file_range()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # several writer threads report ranges
        self._requests: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def __enter__(self) -> Writeback:
        if self._kick is not None:
            self._thread = threading.Thread(target=self._run, name="shardprep-writeback", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def track(self, path: str | Path) -> int:
        """Remember `path` for the final fsync; returns the descriptor kept for it."""
        key = os.fspath(path)
        with self._lock:
            fd = self._fds.get(key)
            if fd is None:
                fd = self._fds[key] = os.open(key, os.O_RDONLY)
            return fd

    def start(self, path: str | Path, offset: int, nbytes: int) -> None:
        """`nbytes` at `offset` of `path` are written: begin putting them on disk (and fsync `path` at the end)."""
        fd = self.track(path)
        if self._thread is not None and nbytes > 0:
            self._requests.put((fd, offset, nbytes))

    def finish(self) -> None:
        """Wait until every tracked file is on disk (fsync each)."""
        self._stop()
        with self._lock:
            fds = list(self._fds.values())
        for fd in fds:
            os.fsync(fd)

    def _stop(self) -> None:
        if self._thread is not None:
            self._stopping = True  # what is still queued is left to the fsyncs
            self._requests.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        assert self._kick is not None
        while (request := self._requests.get()) is not None:
            if not self._stopping:
                # An error here (EIO) comes back from the fsync in finish(), where it is reported.
                self._kick(*request, SYNC_FILE_RANGE_WRITE)
