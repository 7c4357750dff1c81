"""Test-only SGLang plugin: record which files each SGLang process opens, so that a test can check that in sharded
mode every DP rank opens only its own rank file; never shipped in shardprep.

SGLang gives every rank one model path, so on one host the ranks of a sharded run share a directory holding every
rank file (on several nodes, a node's directory need only hold its own ranks' files). What sharded mode promises is
that a rank maps only `rank_files[rank mod N]`; this plugin makes that observable. It adds a Python audit hook
(`sys.addaudithook`) on the `open` event, which both `open()` and `os.open()` raise, and appends
"`torch.distributed` rank, path" for every opened path that starts with `SHARDPREP_TEST_OPENED_UNDER` to
`SHARDPREP_TEST_OPENED_LOG` (one line per open, appended with O_APPEND so that the ranks' lines do not interleave).
Inactive unless both variables are set. Installed through SGLang's `sglang.srt.plugins` entry point, declared by
the engine runner (sglang_runs.py); no SGLang file is changed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

NAME = "shardprep_test_opened_files"


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`): install the audit hook if asked to."""
    log, under = os.environ.get("SHARDPREP_TEST_OPENED_LOG"), os.environ.get("SHARDPREP_TEST_OPENED_UNDER")
    if not log or not under:
        return
    recording = False  # the hook's own open of the log raises the event again

    def hook(event: str, args: tuple[Any, ...]) -> None:
        nonlocal recording
        if event != "open" or recording or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.fsdecode(args[0])
        if not path.startswith(under):
            return
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        recording = True
        try:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{rank}\t{path}\n".encode())
            finally:
                os.close(fd)
        finally:
            recording = False

    sys.addaudithook(hook)
