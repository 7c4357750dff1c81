"""Paths named inside an output directory (by the manifest or an index): the one rule every reader applies.

A path is relative POSIX, names a file below the directory, and resolves (symlinks followed) inside
it. Absolute paths, `..`, `.`, empty parts, backslashes, drive letters, NUL and lone surrogates are refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import IntegrityError
from .problems import quoted


def is_safe_relpath(p: object) -> bool:
    """True for a relative POSIX path of a file that stays inside its directory (symlinks: see `resolve_inside`).

    >>> is_safe_relpath("shards/rank-00000-of-00002.safetensors"), is_safe_relpath("../x"), is_safe_relpath("/etc/x")
    (True, False, False)
    >>> is_safe_relpath("."), is_safe_relpath(""), is_safe_relpath("a\\x00b")
    (False, False, False)
    """
    if not isinstance(p, str) or not p or "\\" in p or "\x00" in p:
        return False
    try:
        p.encode("utf-8")
    except UnicodeEncodeError:
        return False
    parts = p.split("/")
    # An empty part also refuses "/abs", "a//b" and a trailing "/"; a colon in the first, "C:x".
    return not any(part in ("", ".", "..") for part in parts) and ":" not in parts[0]


def resolve_inside(root: str | Path, rel: object, *, what: str = "file") -> Path:
    """`root / rel`, after checking that `rel` is safe and, following symlinks, stays inside `root`.

    Raises IntegrityError (code `unsafe_path`) naming the path otherwise. The file need not exist.

    >>> resolve_inside("out", "shards/rank-00000-of-00002.safetensors")  # doctest: +SKIP
    """
    if not is_safe_relpath(rel):
        raise IntegrityError(f"{what} path {quoted(rel)} is absolute, empty or leaves the output directory",
                             code="unsafe_path", file=rel if isinstance(rel, str) else None)
    assert isinstance(rel, str)
    path = Path(root) / rel
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if not real.startswith(real_root.rstrip("/") + "/"):
        raise IntegrityError(f"{rel}: {what} path leaves the output directory (through a symlink, to {real})",
                             code="unsafe_path", file=rel)
    return path


def files_under(root: str | Path) -> Iterator[str]:
    """Every file below `root` as a relative POSIX path, in sorted order (directories sorted too).

    >>> next(files_under(Path(__file__).parent)) == "__init__.py"
    True
    """
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath, name).relative_to(root).as_posix()
