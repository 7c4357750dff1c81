"""Run a command with its stderr on a pseudo-terminal, as a user's shell gives it, to see what it shows there
(progress bars are drawn on a terminal only)."""

from __future__ import annotations

import os
import pty
import subprocess


def run_on_a_terminal(argv: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str, str]:
    """(returncode, stdout, what the terminal received on stderr) of `argv`; stdout is a pipe."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=secondary, env=env, text=True)
    os.close(secondary)
    terminal = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: every process holding the terminal has ended
            break
        if not chunk:
            break
        terminal += chunk
    os.close(primary)
    stdout, _ = proc.communicate(timeout=timeout)
    return proc.returncode, stdout, terminal.decode(errors="replace")
