"""Atomic output directories: everything is written into a temporary sibling, then renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError


def check_output_dir(out: Path, src_root: Path, overwrite: bool) -> None:
    """Refuse OUT inside SRC, SRC inside OUT, or a non-empty OUT without `overwrite`."""
    out_r, src_r = out.resolve(), src_root.resolve()
    if out_r == src_r or out_r.is_relative_to(src_r):
        raise OutputError(f"{out}: output directory is inside the source {src_root}; choose another location")
    if src_r.is_relative_to(out_r):
        raise OutputError(f"{out}: output directory contains the source {src_root}; choose another location")
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"{out}: exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise OutputError(f"{out}: directory is not empty; pass --overwrite to replace it")


@contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; on success it replaces `out`, on any error it is removed.

    The rename is what makes a finished convert visible, so an interrupted run leaves `out` as it was.

    >>> with staged_directory(Path("out")) as tmp:  # doctest: +SKIP
    ...     (tmp / "shard_manifest.json").write_text("{}")
    """
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.shardprep-", dir=parent))
    except PermissionError:
        raise OutputError(f"{parent}: no write permission; choose an output directory you can write") from None
    except OSError as exc:
        raise OutputError(f"{parent}: cannot create the output directory ({exc.strerror})") from None
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the result is a normal directory
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.rename(out, trash / "old")
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
