"""Run a function on N fresh processes that form one torch.distributed group, and collect what each returns.

Process start is the cost of a distributed test, so a test module starts one group and runs all its scenarios in
it (see test_gatherer.py), and the children are forked from multiprocessing's fork server, which imported torch,
torch.distributed, transformers and pytest once for the pytest worker (PRELOAD), instead of each child starting Python
and importing them (2-4 s of CPU a child). The server runs no tensor op, so no OpenMP thread pool is forked (a fork
after an OpenMP parallel region hangs the child), and each child takes the caller's environment whole, as a spawned
child would.

A rank that dies (a signal, `os._exit`, a crash inside CUDA or NCCL) puts no result on the queue, and its
peers may then wait in a collective for ever: the parent watches every process while it waits, and fails
the run within a second or two of such a death, naming the rank, its exit code or signal, and the end of its
stderr (each child writes its stderr, faulthandler's dump on a fatal signal included, to a file of its own).
"""

from __future__ import annotations

import os
import queue as queue_module
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "transformers", "pytest"]
"""Imported once by the fork server (one missing is skipped); the test module that defines a rank's function is
imported by each child, as with spawn."""
START_METHOD = os.environ.get("SHARDPREP_TEST_START_METHOD", "forkserver")
"""`spawn`: each child a fresh interpreter that imports torch itself (the way to time one method against the other)."""
POLL_S = 0.5  # how often the parent looks at the processes while it waits for results
GRACE_S = 5.0  # after one rank failed, how long its peers may still report before they are killed
TAIL_LINES = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_description(exitcode: int | None) -> str:
    """How a process ended, as a person reads it: "exit code 1", "killed by SIGSEGV".

    >>> exit_description(-11)
    'killed by SIGSEGV'
    >>> exit_description(1)
    'exit code 1'
    """
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a text file ('' if it is missing)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def died(rank: int, exitcode: int | None, log: Path) -> str:
    """The failure line of a rank that ended without a result, with the end of its stderr."""
    last = tail(log)
    return (f"rank {rank} exited without a result ({exit_description(exitcode)}); the last lines of its stderr:\n"
            f"{last or '(nothing)'}")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 120.0, env: dict[str, str] | None = None) -> list[Any]:
    """fn(rank, world_size, *args) on every rank of a fresh group; the list of their return values.

    A rank that raises makes this raise with its traceback; a rank that exits without a result (a signal, a
    crash) makes it raise within seconds naming the rank, its signal or exit code and its stderr's end; a rank
    that does not finish within `timeout` seconds is killed and reported. Peers of a failed rank are killed.
    """
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first group of this process
    env = {**os.environ, **(env or {})}  # the server's environment is the one it started with
    results_queue = ctx.Queue()
    port = free_port()
    logdir = Path(tempfile.mkdtemp(prefix="spawn-group-"))
    logs = [logdir / f"rank{rank}.stderr" for rank in range(world_size)]
    procs = [ctx.Process(target=_child, args=(fn, rank, world_size, port, backend, env, args, results_queue,
                                              str(logs[rank])))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        _collect(procs, logs, results_queue, results, errors, timeout)
    finally:
        _stop(procs, failed=bool(errors))
        _relay(logs)
    if errors:
        raise AssertionError("\n".join(f"rank {r}:\n{e}" if r >= 0 else e for r, e in sorted(errors.items())))
    return [results[r] for r in range(len(procs))]


def _collect(procs: Sequence[Any], logs: Sequence[Path], results_queue: Any, results: dict[int, Any],
             errors: dict[int, str], timeout: float) -> None:
    """Fill `results` / `errors` until every rank reported, one died, one failed (plus a grace), or time ran out."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    pending = set(range(len(procs)))
    while pending:
        try:
            rank, ok, value = results_queue.get(timeout=POLL_S)
            (results if ok else errors)[rank] = value
            pending.discard(rank)
            if not ok and failed_at is None:
                failed_at = time.monotonic()
            continue
        except queue_module.Empty:
            pass
        # A rank that has ended put its result into the pipe before it exited (_child joins the feeder thread), so
        # only a rank that ended and is still pending after an empty poll died without one.
        for rank in sorted(r for r in pending if procs[r].exitcode is not None):
            errors[rank] = died(rank, procs[rank].exitcode, logs[rank])
            pending.discard(rank)
            failed_at = failed_at or time.monotonic()
        now = time.monotonic()
        if failed_at is not None and pending and now - failed_at > GRACE_S:
            errors[-1] = (f"ranks {sorted(pending)} were stopped {GRACE_S:.0f} s after a peer failed (they were "
                          "waiting for it)")
            return
        if now > deadline:
            errors[-1] = f"ranks {sorted(pending)} did not finish within {timeout} s"
            return


def _stop(procs: Sequence[Any], failed: bool) -> None:
    for p in procs:
        p.join(timeout=1 if failed else 10)
        if p.is_alive():
            p.kill()
            p.join()


def _relay(logs: Sequence[Path]) -> None:
    """Each rank's stderr, to this process's stderr (pytest shows it with a failure), then the files removed."""
    for rank, log in enumerate(logs):
        text = log.read_text(errors="replace") if log.exists() else ""
        if text.strip():
            sys.stderr.write(f"--- rank {rank} stderr ---\n{text}")
        log.unlink(missing_ok=True)
    if logs:
        logs[0].parent.rmdir()


def _child(fn, rank, world_size, port, backend, env, args, results_queue, log) -> None:
    # stderr (and faulthandler's dump on SIGSEGV/SIGABRT) to a file the parent reads if this rank dies.
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    try:
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120), **kwargs)
        value = fn(rank, world_size, *args)
        results_queue.put((rank, True, value))
    except BaseException:
        results_queue.put((rank, False, traceback.format_exc()))
    results_queue.close()
    results_queue.join_thread()  # the result is in the pipe before the process ends
    sys.stderr.flush()
    # A scenario may leave a collective blocked on purpose (timeouts); do not wait for it at exit.
    os._exit(0)
