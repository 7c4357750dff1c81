"""What is a hub repo id and what a local path: a path is never taken for a repo id."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def hub_repo_id(src: str | Path) -> str | None:
    """`src` as a hub repo id, or None when it names a local path.

    A local path is never taken for a hub id: a `Path`, a name that starts with `.`, `/` or `~`, one whose first
    component exists here (`examples/tiny-deepsek-fp8` where `examples/` does), and one that is not a repo id's
    shape are paths.

    >>> hub_repo_id("deepseek-ai/DeepSeek-V3"), hub_repo_id("./DeepSeek-V3"), hub_repo_id("~/models/x")
    ('deepseek-ai/DeepSeek-V3', None, None)
    """
    text = str(src)
    if isinstance(src, Path) or "\x00" in text or text.startswith((".", "/", "~")) or not REPO_ID.match(text):
        return None
    if Path(text).exists() or Path(text.split("/")[0]).exists():
        return None
    return text


def why_a_path(text: str) -> str:
    """Why a missing SRC was read as a path, said so that a mistyped directory is not taken for a hub id.

    >>> why_a_path("no such model!")
    ' (and not a hub repo id)'
    """
    first = text.split("/")[0]
    if not REPO_ID.match(text) and not text.startswith((".", "/", "~")):
        return " (and not a hub repo id)"
    if "/" in text and first and Path(first).exists():
        return f" ({first}/ exists here, so SRC is a local path, not a hub repo id)"
    return ""
