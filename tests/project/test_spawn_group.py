"""A rank that dies fails its test within seconds, named with its signal or exit code and its stderr's end,
instead of leaving its peers (and the test) waiting for a result that never comes."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from support.spawn_group import run_ranks

pytestmark = pytest.mark.timeout(120)


def _dies_while_its_peer_waits(rank: int, world_size: int, how: str) -> str:
    import torch.distributed as dist

    if rank == 1:
        print(f"rank 1 about to end by {how}", file=sys.stderr, flush=True)
        if how == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        os._exit(1)
    dist.barrier()  # rank 0 waits here for ever: its peer never comes
    return "unreachable"


@pytest.mark.parametrize("how, named", [("segfault", "killed by SIGSEGV"), ("exit", "exit code 1")])
def test_a_rank_that_dies_fails_the_run_within_seconds_naming_it_and_its_stderr(how, named):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_dies_while_its_peer_waits, 2, how, timeout=600)
    took = time.monotonic() - start
    message = str(failed.value)
    assert took < 30, f"the dead rank was noticed only after {took:.0f} s"
    assert f"rank 1 exited without a result ({named})" in message
    assert f"rank 1 about to end by {how}" in message  # the end of its stderr
    if how == "segfault":
        assert "Segmentation fault" in message  # faulthandler's dump reached the report


def _raises_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1's own error")
    return rank


def test_a_rank_that_raises_is_reported_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1's own error"):
        run_ranks(_raises_on_rank_1, 2)
