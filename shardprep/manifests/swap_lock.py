"""The lock between the readers of an output directory and the swap that replaces it.

`--overwrite` puts a new output in OUT's place in one rename (`prep/output/output_dir.py`), but a reader opens
OUT's files one after another: without a lock it could read the old manifest and then the new files
("model-00004-of-00008.safetensors: not found" for a good output). So every reader (`validate`,
`open_rank`, `load_replicated`, `iter_replicated`, `iter_full_targets`, vLLM's full mode, `export`,
`reshard`) holds a shared `flock` on `.OUT.shardprep-swap-lock` while it reads, and the writer takes it
exclusively around the swap alone:

- The lock file sits next to OUT, not inside it: OUT itself is what the swap replaces.
- The writer holds it for the exchange and one directory fsync only: readers never wait for a
  convert's staging, only for a swap in progress. The swap waits for the readers that came first; a
  reader that holds it long (full mode reading hundreds of GB) holds the swap off as long, and a warning
  names it after `NOTICE_AFTER` seconds (`swapping(timeout=)` gives up instead, OUT unchanged).
- A reader that cannot take the lock (a read-only filesystem, a parent directory it may not write, a
  filesystem without locks) reads without it: on a read-only filesystem nothing can swap OUT anyway.
- Over NFS, Linux emulates `flock` with POSIX locks, which the server keeps for every client (a mount with
  `local_lock=flock` or `nolock` keeps them on one host only). POSIX locks belong to a process, not to a
  descriptor, so a process takes the lock once and counts nested readers (`reading` is re-entrant).
- Like the writer's own lock, the file is removed by a process that holds it alone; after locking, a
  process checks that the name still points at the file it locked, and starts over if it does not.
"""

from __future__ import annotations

import fcntl
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from ..errors import OutputError

SWAP_LOCK_SUFFIX = ".shardprep-swap-lock"
NOTICE_AFTER = 2.0  # seconds a swap waits for readers before it says so (a log warning)
_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # O_NONBLOCK: a FIFO planted there cannot hang us

log = logging.getLogger("shardprep")
P = ParamSpec("P")
R = TypeVar("R")


def swap_lock_path(out: str | Path) -> Path | None:
    """The lock file of the output directory `out`, next to it (None when `out` has no parent to hold one).

    Symlinks are resolved, so that a reader given a link to OUT and the writer share one lock.

    >>> swap_lock_path("/models/out").name
    '.out.shardprep-swap-lock'
    """
    real = Path(os.path.realpath(out))
    if not real.name:
        return None
    return real.parent / f".{real.name}{SWAP_LOCK_SUFFIX}"


@contextmanager
def reading(out: str | Path) -> Iterator[bool]:
    """Hold the readers' lock of `out` for the block: no swap replaces OUT until it ends.

    Yields True when the lock is held, False when it could not be taken (see the module's notes); the
    block runs either way. Re-entrant within a process; waits only for a swap already in progress.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as parent, reading(Path(parent, "out")) as held:
    ...     held
    True
    """
    path = _lock_path_or_none(out)
    held = path is not None and _enter(path)
    try:
        yield held
    finally:
        if held:
            assert path is not None
            _leave(path)


def reads_output(fn: Callable[P, R]) -> Callable[P, R]:
    """Run `fn` under `reading(DIR)`, DIR being its first argument; a generator holds it until it is closed.

    >>> @reads_output
    ... def count_files(directory):
    ...     return len(os.listdir(directory))
    >>> count_files(".") >= 0
    True
    """
    first = next(iter(inspect.signature(fn).parameters))

    def directory(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return args[0] if args else kwargs[first]

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def generator(*args: Any, **kwargs: Any) -> Any:
            with reading(directory(args, kwargs)):
                yield from cast(Any, fn)(*args, **kwargs)

        return cast(Callable[P, R], generator)

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with reading(directory(args, kwargs)):
            return fn(*args, **kwargs)

    return call


@contextmanager
def swapping(out: str | Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the lock of `out` exclusively for the block (the swap): wait until its readers are done.

    `timeout` (seconds; None waits as long as it takes) bounds the wait: then an OutputError names the
    readers' processes. A process that is reading `out` itself is refused at once instead of waiting
    for itself.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as parent, swapping(Path(parent, "out"), timeout=1):
    ...     pass
    """
    path = swap_lock_path(out)
    if path is None:
        raise OutputError(f"{out}: not a directory that can be replaced")
    with _registry:
        if path in _held:
            raise OutputError(f"{out}: this process is reading it, so it cannot replace it; finish reading first")
    fd = _lock_exclusive(path, out, timeout)
    try:
        yield
    finally:
        try:
            os.unlink(path)  # while still locked: see the module's notes
        except OSError:
            pass
        finally:
            os.close(fd)


def remove_if_free(path: Path) -> None:
    """Remove a lock file nobody holds (left by a killed reader or writer); leave a held one alone.

    >>> remove_if_free(Path("no/such/.out.shardprep-swap-lock"))
    """
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    except (OSError, ValueError):
        return
    _remove_if_alone(path, fd)


def _remove_if_alone(path: Path, fd: int) -> None:
    """Unlink the lock file `fd` has open if nobody else holds it (and `path` still names it); closes `fd`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _still_named(path, fd):
            os.unlink(path)
    except OSError:
        pass  # another reader or the writer has it; they remove it
    finally:
        os.close(fd)


# -- one lock per process and lock file, counted --------------------------------------------------------

_registry = threading.Lock()
_held: dict[Path, list[int]] = {}  # lock path -> [descriptor, readers in this process]


def _forget_after_fork() -> None:
    # A forked child shares the parent's lock (the same open file), but its readers are its own.
    global _registry, _held
    _registry, _held = threading.Lock(), {}


os.register_at_fork(after_in_child=_forget_after_fork)


def _lock_path_or_none(out: str | Path) -> Path | None:
    try:
        return swap_lock_path(out)
    except (OSError, ValueError):  # a NUL byte, an unreadable path: the reader reports it itself
        return None


def _enter(path: Path) -> bool:
    with _registry:
        entry = _held.get(path)
        if entry is not None:
            entry[1] += 1
            return True
        fd = _lock_shared(path)
        if fd is None:
            return False
        _held[path] = [fd, 1]
        return True


def _leave(path: Path) -> None:
    # All under the registry lock: over NFS a process's locks are one, and closing any descriptor of the
    # file would drop a lock another thread of this process has just taken.
    with _registry:
        entry = _held[path]
        entry[1] -= 1
        if entry[1]:
            return
        del _held[path]
        _remove_if_alone(path, entry[0])  # as the swap does


def _lock_shared(path: Path) -> int | None:
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | _OPEN_FLAGS, 0o644)
        except (OSError, ValueError):
            try:
                fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)  # not ours to create, but one may exist
            except (OSError, ValueError):
                return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for a swap in progress
        except OSError:  # ENOLCK: a filesystem without locks, where no one can rely on the file either
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        except BaseException:
            os.close(fd)
            raise
        if _still_named(path, fd):
            return fd
        os.close(fd)


def _lock_exclusive(path: Path, out: str | Path, timeout: float | None) -> int:
    start = time.monotonic()
    pause, noticed = 0.001, False
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o644)
        except PermissionError:  # a reader of another user created it; a shared one is enough for flock
            fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                # Polled, not blocking: a blocked flock could not be given up at the timeout.
                waited = time.monotonic() - start
                if timeout is not None and waited >= timeout:
                    raise OutputError(f"{out}: still being read after {timeout:g} s{_readers(fd)}; the new output "
                                      "was not put in its place; run again once the readers are done")
                if not noticed and waited >= NOTICE_AFTER:
                    log.warning("%s: waiting for its readers%s to finish before replacing it", out, _readers(fd))
                    noticed = True
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
        except BaseException:
            os.close(fd)
            raise
        if _still_named(path, fd):
            return fd
        os.close(fd)


def _still_named(path: Path, fd: int) -> bool:
    """Whether `path` still names the file `fd` has open (its holder may have unlinked it meanwhile)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _readers(fd: int) -> str:
    """" (pid 123: shardprep validate out)": who holds the lock file `fd` has open, from /proc/locks; "" if unknown."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return ""
    pids = sorted({int(parts[4]) for parts in map(str.split, lines)
                   if len(parts) > 5 and parts[5] == key and parts[4].isdigit()} - {os.getpid(), 0})
    if not pids:
        return ""
    return " (" + ", ".join(f"pid {pid}{_command(pid)}" for pid in pids[:4]) + (", ..." if pids[4:] else "") + ")"


def _command(pid: int) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    text = " ".join(os.path.basename(w.decode(errors="replace")) if i == 0 else w.decode(errors="replace")
                    for i, w in enumerate(words) if w)
    text = " ".join(text.split())  # one line, whatever the arguments hold
    return f": {text[:80]}" if text else ""


__all__ = ["NOTICE_AFTER", "SWAP_LOCK_SUFFIX", "reading", "reads_output", "remove_if_free", "swap_lock_path",
           "swapping"]
