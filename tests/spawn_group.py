"""Run a function on N fresh processes that form one torch.distributed group, and collect what each returns.

Process start is the cost of a distributed test (each child imports torch), so a test module starts
one group and runs all its scenarios in it (see test_gatherer.py).
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 120.0, env: dict[str, str] | None = None) -> list[Any]:
    """fn(rank, world_size, *args) on every rank of a fresh group; the list of their return values.

    A rank that raises makes this raise with its traceback; a rank that does not finish within
    `timeout` seconds is killed and reported.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, rank, world_size, port, backend, env or {}, args, queue))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout)
            (results if ok else errors)[rank] = value
    except Exception:  # queue.Empty: some rank hangs
        missing = sorted(set(range(world_size)) - set(results) - set(errors))
        errors.setdefault(-1, f"ranks {missing} did not finish within {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def _child(fn, rank, world_size, port, backend, env, args, queue) -> None:
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
        queue.put((rank, True, value))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    queue.close()
    queue.join_thread()  # the result is in the pipe before the process ends
    # A scenario may leave a collective blocked on purpose (timeouts); do not wait for it at exit.
    os._exit(0)
