"""The CLI boundary: library exceptions become one line on stderr and an exit code."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import typer

from ..errors import ShardprepError
from ..prep.output.output_dir import output_outcome

EXIT_INVALID = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def debug_enabled() -> bool:
    return os.environ.get("SHARDPREP_DEBUG", "") not in ("", "0")


def print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    """Silence huggingface_hub's log lines and warnings: its retry messages would surround shardprep's one line."""
    logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL + 1)
    warnings.filterwarnings("ignore", module="huggingface_hub")


@contextmanager
def cli_errors(report: Callable[[str], None] = print_error) -> Iterator[None]:
    """Turn ShardprepError (and common OS errors) into `error: ...` and exit code 2; --debug re-raises.

    `report` says the message (default: prints `error: ...` on stderr). Without --debug, the libraries beneath
    (huggingface_hub) print nothing of their own: no warnings, no retry lines around the one line.
    """
    if not debug_enabled():
        quiet_libraries()
    try:
        yield
    except (ShardprepError, OSError) as exc:
        if debug_enabled():
            raise
        msg = str(exc) if isinstance(exc, ShardprepError) else f"{exc.filename or ''}: {exc.strerror or exc}"
        report(msg)
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt as exc:
        cause = f" by {exc.args[0]}" if exc.args else ""
        print(f"interrupted{cause}; {output_outcome(exc) or 'nothing was written'}", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED) from None


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM (schedulers, `timeout`, `docker stop`) stops a command exactly like Ctrl-C.

    The first SIGINT or SIGTERM raises KeyboardInterrupt (its argument names the signal); later ones are
    ignored, so the cleanup that the interrupt starts (removing a staging directory) runs to its end.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
