"""Waiting for a writer process that pauses mid-way (its path written to a file), for the tests that act while it
waits (a second writer, a reader, a signal)."""

import time
from pathlib import Path


def wait_for(path, proc, timeout=120):
    """The path a driver wrote to `path` once paused. `write_text` creates the file before it writes, so a file seen
    empty is still being written (read as `Path("")`, it failed CI once: `is_staging_dir(PosixPath('.'))`)."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the driver never reached the pause"
        time.sleep(0.02)
    return Path(path.read_text())
