"""A file a command writes whole or not at all: a temporary file beside it, renamed over it on success."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ShardprepError


@contextmanager
def replaced_on_success(path: Path, option: str) -> Iterator[Path]:
    """A new empty file beside `path`, renamed to `path` when the block succeeds and removed when it fails.

    Creating it is the check that `path` can be written, so call this before the work that fills it: an
    unwritable path is one line naming the file and the option, before anything ran. A reader of `path`
    never sees a half-written file.

    >>> with replaced_on_success(Path("trace.json"), "--trace") as part:  # doctest: +SKIP
    ...     part.write_text(text)
    """
    parent = path.parent
    if path.is_dir():
        raise ShardprepError(f"{option} {path}: is a directory; give a file name")
    if parent.exists() and not parent.is_dir():
        raise ShardprepError(f"{option} {path}: cannot write there: {parent} is not a directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".part")
    except OSError as exc:
        raise ShardprepError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
    os.close(fd)
    part = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(part, 0o666 & ~umask)  # mkstemp's 0600 would make the result unreadable to others
    try:
        yield part
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
