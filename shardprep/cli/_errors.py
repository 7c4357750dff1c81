"""The CLI boundary: library exceptions become one line on stderr and an exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from ..errors import ShardprepError

EXIT_INVALID = 1
EXIT_ERROR = 2


def debug_enabled() -> bool:
    return os.environ.get("SHARDPREP_DEBUG", "") not in ("", "0")


@contextmanager
def cli_errors() -> Iterator[None]:
    """Turn ShardprepError (and common OS errors) into `error: ...` and exit code 2; --debug re-raises."""
    try:
        yield
    except (ShardprepError, OSError) as exc:
        if debug_enabled():
            raise
        msg = str(exc) if isinstance(exc, ShardprepError) else f"{exc.filename or ''}: {exc.strerror or exc}"
        print(f"error: {msg}", file=sys.stderr)
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        print("interrupted; nothing was written to the output directory", file=sys.stderr)
        raise typer.Exit(130) from None
