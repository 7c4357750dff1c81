"""Output directories that never lose data, for any command that writes one (convert, reshard, export).

`staged_output(OUT)` yields an empty staging directory next to OUT; the caller writes everything into
it. On success the staging directory takes OUT's place in one atomic step, so at every instant OUT is
either the complete old output or the complete new one:

- OUT absent or empty: `rename(2)` (it replaces an empty directory atomically);
- OUT an existing output (`--overwrite`): `renameat2(RENAME_EXCHANGE)` swaps the two directories, then
  the old tree, now under the staging name, is removed. A filesystem without the exchange is refused
  up front (a probe on two empty directories), before anything is written: a two-rename fallback would
  leave an instant with no OUT at all.

A lock file next to OUT (`.OUT.shardprep-lock`, `flock`) is held for the whole transaction: a second
writer into the same OUT is refused, and staging directories (`.OUT.shardprep-tmp-XXXXXXXX`) whose
owner's lock is free belong to a killed run and are removed by the next writer into the same parent.
Such a directory is never an output (`is_staging_dir`; `validate` rejects it), even in the instant
before the final rename when it is complete.

The swap itself (rename or exchange, and the parent's fsync) runs under the readers' lock of OUT
(`manifests/swap_lock.py`), taken exclusively: it waits for the readers of the old output to finish, so
that none of them reads half of the old output and half of the new.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import platform
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ...errors import OutputError, ShardprepError
from ...manifests.manifest import MANIFEST_NAME  # what marks a directory as a shardprep output
from ...manifests.swap_lock import SWAP_LOCK_SUFFIX, remove_if_free, swapping
from ...planning.accounting import human_bytes

# What marks a directory as written by shardprep, and so replaceable with --overwrite: an output's manifest, or
# the record `export` writes into a plain checkpoint.
EXPORT_RECORD = "shardprep_export.json"
STAGING_MARK = ".shardprep-tmp-"
LOCK_SUFFIX = ".shardprep-lock"
# tempfile.mkdtemp's suffix: 8 characters of this alphabet. Only names of exactly this shape are ever removed.
_STAGING_NAME = re.compile(r"^\.(?P<out>.+)" + re.escape(STAGING_MARK) + r"[a-z0-9_]{8}$")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347, "riscv64": 276}
_NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV)

FreeSpace = Callable[[Path], int]
"""free_space(directory) -> bytes available to this user on the directory's filesystem."""


def disk_free(directory: Path) -> int:
    """Bytes an unprivileged writer can still put on `directory`'s filesystem (statvfs f_bavail).

    >>> disk_free(Path(".")) > 0
    True
    """
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def is_staging_dir(path: str | Path) -> bool:
    """True for a staging directory of `staged_output` (an unfinished or abandoned write, never an output).

    >>> is_staging_dir(".out.shardprep-tmp-k2j4h1x0"), is_staging_dir("out")
    (True, False)
    """
    return _STAGING_NAME.match(Path(os.path.abspath(path)).name) is not None


def output_outcome(exc: BaseException) -> str | None:
    """What is true of OUT after `exc` left a `staged_output` block ("out unchanged", ...), or None.

    The CLI prints it after "interrupted" (Ctrl-C, SIGTERM); errors carry it in their message already.

    >>> output_outcome(KeyboardInterrupt())  # None: raised before any output transaction began
    """
    outcome = getattr(exc, "shardprep_outcome", None)
    return outcome if isinstance(outcome, str) else None


def check_output_dir(out: Path, inputs: Sequence[Path], overwrite: bool) -> None:
    """Refuse an OUT that a write could not safely replace; nothing is touched.

    Refused: OUT inside an input or containing one, a symlink, a mount point, a file, and a non-empty
    directory unless `overwrite` is set *and* shardprep wrote it (it holds a regular file named
    shard_manifest.json, or shardprep_export.json for an export; its content is not parsed, so a damaged
    output can be replaced by reconverting).

    >>> check_output_dir(Path("out"), [Path("my-model")], overwrite=False)  # doctest: +SKIP
    """
    out_r = Path(os.path.abspath(out)).resolve()
    if not out_r.name or out_r.parent == out_r:
        raise OutputError(f"{out}: not a directory that can be replaced; name a new or existing output directory")
    for src in inputs:
        src_r = src.resolve()
        if out_r == src_r or out_r.is_relative_to(src_r):
            raise OutputError(f"{out}: output directory is inside the source {src}; choose another location")
        if src_r.is_relative_to(out_r):
            raise OutputError(f"{out}: output directory contains the source {src}; choose another location")
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"{out}: is a symbolic link; give the directory it points to, or a new directory")
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{out}: exists and is not a directory")
    if st.st_dev != os.stat(Path(os.path.abspath(out)).parent).st_dev:
        raise OutputError(f"{out}: is a mount point and cannot be replaced; write into a directory inside it")
    if _is_empty(out):
        return
    if not _is_output(out):
        raise OutputError(f"{out}: directory is not empty and not a shardprep output (no {MANIFEST_NAME} or "
                          f"{EXPORT_RECORD}); "
                          "choose another location" + ("" if overwrite else " (--overwrite only replaces outputs)"))
    if not overwrite:
        raise OutputError(f"{out}: directory is not empty; pass --overwrite to replace it")


@contextmanager
def staged_output(out: str | Path, *, inputs: Sequence[Path] = (), overwrite: bool = False,
                  needed_bytes: int = 0, free_space: FreeSpace | None = None,
                  swap_timeout: float | None = None) -> Iterator[Path]:
    """Yield an empty staging directory that atomically becomes `out` when the block succeeds.

    Under a lock on `out`: checks it (`check_output_dir`), removes abandoned staging directories in its
    parent, and refuses when the parent's filesystem has fewer than `needed_bytes` free (`free_space`,
    default `disk_free`). The swap waits for `out`'s readers (`swap_lock.reading`) to finish, at most
    `swap_timeout` seconds when given. Any exception leaves `out` as it was (or, after the swap, holding
    the new output) and says which: ShardprepError and OSError messages end with it (OSError becomes
    OutputError); every exception (KeyboardInterrupt too) carries it for `output_outcome`.

    >>> with staged_output("out/", inputs=[Path("my-model")], overwrite=True) as tmp:  # doctest: +SKIP
    ...     (tmp / "shard_manifest.json").write_text("{}")
    """
    out = Path(out)
    txn = _Transaction(out, swap_timeout)
    try:
        txn.lock()
        check_output_dir(out, inputs, overwrite)
        _remove_abandoned(txn.parent, txn.name)
        available = (free_space or disk_free)(txn.parent)
        if needed_bytes > available:
            raise OutputError(f"{txn.parent}: needs {human_bytes(needed_bytes)} for {out}, {human_bytes(available)} "
                              "available; free some space or choose another location")
        txn.begin()
        yield txn.staging
        txn.commit()
    except BaseException as exc:
        txn.fail(exc)
        raise
    finally:
        txn.unlock()


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Name `path` in any OSError raised inside the block (disk full: "PATH: no space left on device").

    >>> with writing(dest):  # doctest: +SKIP
    ...     shutil.copyfile(src, dest)
    """
    try:
        yield
    except OSError as exc:
        raise OutputError(f"{path}: {_describe(exc)}") from None


class _Transaction:
    """The state of one `staged_output`: its lock, staging directory and whether OUT was swapped."""

    def __init__(self, out: Path, swap_timeout: float | None = None):
        self.out = out
        self.swap_timeout = swap_timeout
        self.abs = Path(os.path.abspath(out))
        self.parent, self.name = self.abs.parent, self.abs.name
        self.lock_path = self.parent / f".{self.name}{LOCK_SUFFIX}"
        self.lock_fd: int | None = None
        self.staging = Path()
        self.new_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the new tree once staged
        self.existed = False

    def lock(self) -> None:
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
            self.lock_fd = _try_lock(self.lock_path)
        except PermissionError:
            raise OutputError(f"{self.parent}: no write permission; choose an output directory you can write") from None
        except OSError as exc:
            raise OutputError(f"{self.parent}: cannot create the output directory ({exc.strerror})") from None
        if self.lock_fd is None:
            owner = _lock_owner(self.lock_path)
            raise OutputError(f"{self.out}: another shardprep{owner} is writing it right now; wait for it to finish "
                              "or choose another output directory")
        os.ftruncate(self.lock_fd, 0)
        os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode(), 0)

    def unlock(self) -> None:
        if self.lock_fd is not None:
            _unlock(self.lock_path, self.lock_fd)
            self.lock_fd = None

    def begin(self) -> None:
        self.existed = os.path.lexists(self.abs)
        replacing = self.existed and not _is_empty(self.abs)
        try:
            self.staging = Path(tempfile.mkdtemp(prefix=f".{self.name}{STAGING_MARK}", dir=self.parent))
        except PermissionError:
            raise OutputError(f"{self.parent}: no write permission; choose an output directory you can write") from None
        if replacing:
            self._probe_exchange()
        st = os.stat(self.staging)
        self.new_id = (st.st_dev, st.st_ino)

    def _probe_exchange(self) -> None:
        # Two empty directories inside the staging one (same filesystem as OUT): learn now, not after
        # hours of writing, whether the final swap works.
        probes = (self.staging / ".exchange-probe-a", self.staging / ".exchange-probe-b")
        for probe in probes:
            probe.mkdir()
        try:
            exchange(*probes)
        except OSError as exc:
            if exc.errno not in _NO_EXCHANGE:
                raise
            raise OutputError(f"{self.out}: the filesystem of {self.parent} cannot swap directories atomically "
                              f"(renameat2 RENAME_EXCHANGE: {exc.strerror}); remove {self.out} yourself or "
                              "write to a new directory") from None
        finally:
            for probe in probes:
                probe.rmdir()

    def commit(self) -> None:
        os.chmod(self.staging, self._final_mode())
        _fsync_tree(self.staging)
        with swapping(self.abs, self.swap_timeout):
            try:
                if os.path.isdir(self.abs) and not _is_empty(self.abs):
                    exchange(self.staging, self.abs)
                else:
                    os.rename(self.staging, self.abs)  # replaces an empty directory, refuses a non-empty one
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise OutputError(f"{self.out}: something else wrote into it meanwhile; it was not "
                                      "replaced") from None
                raise OutputError(f"{self.out}: cannot be replaced ({exc.strerror})") from None
            _fsync_dir(self.parent)
        if os.path.lexists(self.staging):  # the old output, swapped out
            try:
                _remove_output(self.staging)
            except OSError as exc:
                raise OutputError(f"{self.out} now holds the new output; the old one could not be removed from "
                                  f"{self.staging} ({exc.strerror}); delete it, or the next write into "
                                  f"{self.parent} removes it") from None

    def _final_mode(self) -> int:
        try:
            return os.stat(self.abs).st_mode & 0o7777  # an existing OUT keeps its permissions
        except FileNotFoundError:
            return 0o777 & ~_umask()  # mkdtemp made it 0700; give it what mkdir would

    def swapped(self) -> bool:
        """Whether OUT is the new tree, decided from the filesystem (a signal may land between syscall and flag)."""
        try:
            st = os.lstat(self.abs)
        except FileNotFoundError:
            return False
        return self.new_id is not None and (st.st_dev, st.st_ino) == self.new_id

    def fail(self, exc: BaseException) -> None:
        """Clean up after `exc` and make it say what is true of OUT."""
        if self.staging == Path():  # refused or interrupted before anything was staged
            exc.shardprep_outcome = f"nothing was written to {self.out}"  # type: ignore[attr-defined]
            if isinstance(exc, OSError):
                raise OutputError(f"{exc.filename or self.out}: {_describe(exc)}") from None
            return
        swapped = self.swapped()
        leftover = None
        if os.path.lexists(self.staging):
            try:
                _remove_output(self.staging)
            except BaseException:  # a second signal or a permission problem: the next writer removes it
                leftover = self.staging
        if swapped:
            outcome = f"{self.out} now holds the new output"
            if leftover:
                outcome += f"; the old one is left in {leftover} (the next write into {self.parent} removes it)"
        else:
            outcome = f"{self.out} unchanged" if self.existed else f"nothing was written to {self.out}"
            if leftover:
                outcome += f"; the unfinished {leftover} is removed by the next write into {self.parent}"
        if isinstance(exc, OSError):
            where = str(exc.filename).replace(str(self.staging), str(self.out)) if exc.filename else self.out
            raise OutputError(f"{where}: {_describe(exc)}; {outcome}") from None
        if isinstance(exc, ShardprepError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
            message = exc.args[0].replace(str(self.staging), str(self.out))
            exc.args = (message if "now holds the new output" in message else f"{message}; {outcome}",)
        exc.shardprep_outcome = outcome  # type: ignore[attr-defined]


def exchange(a: Path, b: Path) -> None:
    """Swap two directory entries in one atomic step (Linux renameat2 RENAME_EXCHANGE); raises OSError.

    >>> exchange(Path(".out.shardprep-tmp-k2j4h1x0"), Path("out"))  # doctest: +SKIP
    """
    renameat2 = _renameat2()
    if renameat2 is None:
        raise OSError(errno.ENOSYS, f"renameat2 is not available on {sys.platform}/{platform.machine()}")
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


@functools.cache
def _renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)  # glibc >= 2.28
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    number = _SYS_RENAMEAT2.get(platform.machine())
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    def via_syscall(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
        return int(syscall(ctypes.c_long(number), ctypes.c_int(olddirfd), ctypes.c_char_p(old),
                           ctypes.c_int(newdirfd), ctypes.c_char_p(new), ctypes.c_uint(flags)))

    return via_syscall


def _try_lock(path: Path) -> int | None:
    """An fd holding flock(LOCK_EX) on `path`, or None when another process holds it.

    Lock files are unlinked by their holder on release, so after locking, check that the name still
    points at the file we locked; otherwise we locked a deleted file and must start over.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            named = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            named = None
        held = os.fstat(fd)
        if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)


def _unlock(path: Path, fd: int) -> None:
    try:
        os.unlink(path)  # while still locked: see _try_lock
    except OSError:
        pass
    finally:
        os.close(fd)


def _lock_owner(path: Path) -> str:
    try:
        pid = int(path.read_text().strip() or "x")
    except (OSError, ValueError):
        return ""
    return f" (pid {pid})"


def _remove_abandoned(parent: Path, own_name: str) -> None:
    """Remove staging directories whose writer is gone (its lock is free), and free lock files."""
    with os.scandir(parent) as entries:
        names = [(entry.name, entry.path) for entry in entries]
    for name, path in names:
        staging = _STAGING_NAME.match(name)
        if name.startswith(".") and name.endswith(SWAP_LOCK_SUFFIX):
            remove_if_free(Path(path))  # a reader's or a swap's, killed while it held it
            continue
        if staging:
            owner = staging.group("out")
        elif name.startswith(".") and name.endswith(LOCK_SUFFIX):
            owner = name[1:-len(LOCK_SUFFIX)]
        else:
            continue
        if owner == own_name:  # we hold this name's lock: any staging directory of it is abandoned
            if staging:
                _remove_quietly(Path(path))
            continue
        lock_path = parent / f".{owner}{LOCK_SUFFIX}"
        try:
            fd = _try_lock(lock_path)
        except OSError:
            continue  # another user's lock file: not ours to judge
        if fd is None:
            continue  # a live writer owns it
        try:
            if staging:
                _remove_quietly(Path(path))
        finally:
            _unlock(lock_path, fd)


def _remove_quietly(path: Path) -> None:
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            _remove_output(path)
    except OSError:
        pass  # someone else's or not removable: leave it, it is never mistaken for an output


def _remove_output(path: Path) -> None:
    # The manifest first, so that a tree interrupted halfway through removal no longer looks like an output.
    try:
        os.unlink(path / MANIFEST_NAME)
    except FileNotFoundError:
        pass
    shutil.rmtree(path)


def _is_empty(directory: Path) -> bool:
    with os.scandir(directory) as entries:
        return next(entries, None) is None


def _is_output(path: Path) -> bool:
    for name in (MANIFEST_NAME, EXPORT_RECORD):
        try:
            if stat.S_ISREG(os.lstat(path / name).st_mode):
                return True
        except OSError:
            pass
    return False


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, so a power loss after the rename cannot empty them."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # a hard link to a source file we may not open: it is not ours to persist
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _describe(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on device"
    if exc.errno == errno.EDQUOT:
        return "disk quota exceeded"
    return exc.strerror or str(exc)

