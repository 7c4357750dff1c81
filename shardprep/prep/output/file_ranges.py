"""Moving byte ranges into output files: whole writes, and file-to-file copies done inside the kernel.

`copy_file_range` copies page-cache pages to page-cache pages without a trip through user space (what
`cp` does); where the kernel refuses it (another filesystem on an old kernel, a filesystem without
support), the bytes go through a buffer instead.

Large writes from memory go through a pipe on Linux: `vmsplice` lends the buffer's pages to the pipe
and `splice` copies them into the file's page cache, the way `copy_file_range` does. On the machine of
docs/benchmarks.md that costs a quarter of the kernel time of `pwrite`, whose copy from user memory
runs at about 1 GB/s there. Anything else, or any refusal, is a plain `pwrite`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ...errors import SourceError

FALLBACK_BUFFER = 16 << 20
SPLICE_MIN = 256 << 10  # below this, two system calls per piece are not worth it
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20  # the default /proc/sys/fs/pipe-max-size
# The kernel refuses copy_file_range with these before copying anything; any other error is a real one.
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF,
                errno.EPERM}


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    """Write all of `data` (any buffer) at `offset`.

    >>> pwrite_all(fd, memoryview(b"abc"), 0)  # doctest: +SKIP
    """
    view = memoryview(data).cast("B")
    done = _splice_write(fd, view, offset) if len(view) >= SPLICE_MIN else 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_vmsplice() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_uint)
    fn.restype = ctypes.c_ssize_t
    return fn


_vmsplice = _load_vmsplice() if hasattr(os, "splice") else None
_pipes = threading.local()  # one pipe per writing thread


def _pipe() -> tuple[int, int, int]:
    pipe = getattr(_pipes, "pipe", None)
    if pipe is None:
        read_end, write_end = os.pipe()
        try:
            size = fcntl.fcntl(write_end, _F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            size = 64 << 10  # the pipe's default capacity
        pipe = _pipes.pipe = (read_end, write_end, size)
    return pipe


def _drop_pipe() -> None:
    pipe = getattr(_pipes, "pipe", None)
    if pipe is not None:
        os.close(pipe[0])
        os.close(pipe[1])
        _pipes.pipe = None


def _splice_write(fd: int, view: memoryview, offset: int) -> int:
    """Write a prefix of `view` at `offset` through this thread's pipe; returns how many bytes were written.

    Stops at the first refusal (read-only buffer, no vmsplice, a filesystem without splice); the caller
    writes the rest. A refused pipe may hold bytes, so it is dropped.
    """
    if _vmsplice is None or view.readonly:
        return 0
    anchor = ctypes.c_char.from_buffer(view)  # the buffer's address; keeps it exported until we are done
    base = ctypes.addressof(anchor)
    read_end, write_end, size = _pipe()
    done = 0
    try:
        while done < len(view):
            piece = _Iovec(base + done, min(size, len(view) - done))
            lent = _vmsplice(write_end, ctypes.byref(piece), 1, 0)
            if lent <= 0:
                break
            moved = 0
            while moved < lent:  # drain the pipe completely before the next loan: it holds our pages
                n = os.splice(read_end, fd, lent - moved, offset_dst=offset + done + moved)
                if n <= 0:
                    raise OSError(errno.EIO, "splice moved nothing")
                moved += n
            done += lent
    except OSError:
        _drop_pipe()
        return done
    finally:
        del anchor
    return done


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int, src_path: str | Path) -> None:
    """Copy `nbytes` from `src_fd` at `src_offset` to `dst_fd` at `dst_offset`, in the kernel where it can.

    A source that ends early is a SourceError naming `src_path`.

    >>> copy_range(src, 4096, dst, 0, 1 << 20, "model-00001-of-00002.safetensors")  # doctest: +SKIP
    """
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(src_fd, dst_fd, nbytes - done, src_offset + done, dst_offset + done)
            if n == 0:
                raise SourceError(f"{src_path}: truncated (ended while reading at byte {src_offset + done})")
            done += n
        return
    except OSError as exc:
        if done or exc.errno not in _UNSUPPORTED:
            raise
    buf = memoryview(bytearray(min(nbytes, FALLBACK_BUFFER)))
    while done < nbytes:
        n = os.preadv(src_fd, [buf[: nbytes - done]], src_offset + done)
        if n == 0:
            raise SourceError(f"{src_path}: truncated (ended while reading at byte {src_offset + done})")
        pwrite_all(dst_fd, buf[:n], dst_offset + done)
        done += n
