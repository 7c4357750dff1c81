"""Shared CLI presentation: byte sizes, JSON output, the progress bar."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@contextmanager
def byte_progress(description: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar with bytes and throughput, shown only on a TTY (stderr) when enabled."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def parse_token_counts(text: str) -> tuple[int, ...]:
    """'1,16,128' -> (1, 16, 128); a ShardprepError naming the option otherwise."""
    from ..errors import ShardprepError

    try:
        counts = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ShardprepError(f"--tokens {text!r}: expected comma-separated token counts, e.g. 1,16,128") from None
    if not counts or min(counts) < 1:
        raise ShardprepError(f"--tokens {text!r}: expected token counts >= 1")
    return counts
