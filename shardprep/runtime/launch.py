"""Starting N local ranks the way torchrun does, from inside a command: `shardprep run` and `shardprep profile`.

torch's elastic launcher gives each process RANK, WORLD_SIZE, MASTER_ADDR, ... and, when one fails, stops
the others (they would otherwise wait for it in a collective forever). This module turns that failure into
one RuntimeShardError naming the rank.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import RuntimeShardError

if TYPE_CHECKING:
    import torch


def launch_local(entrypoint: Callable[..., Any] | str, nproc: int, *args: Any) -> list[Any]:
    """`entrypoint(*args)` in `nproc` local processes; their return values by rank.

    `entrypoint` is a picklable function (its return value comes back, its error message becomes the
    RuntimeShardError's) or a binary such as `sys.executable` (it prints its own error; the return values
    are None).

    >>> launch_local(sys.executable, 2, "-m", "shardprep.run", "out/")  # doctest: +SKIP
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # As torchrun does: N processes each using every core would oversubscribe the machine.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"shardprep-{uuid.uuid4().hex}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn")
    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    elastic.setLevel(logging.ERROR)  # the agent's INFO/WARNING chatter is not the user's output
    try:
        results = elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise RuntimeShardError(f"rank {rank} {_failure_text(entrypoint, failure)}; the others were stopped") from None
    finally:
        elastic.setLevel(level)
    return [results[r] for r in range(nproc)] if results else [None] * nproc


def init_local_rank(device: str) -> tuple[int, int, torch.device]:
    """Join this process's rank to the default process group: (rank, world size, its device).

    Reads torchrun's RANK, WORLD_SIZE and LOCAL_RANK; `device` is auto, cpu or cuda (local rank r uses
    GPU r); NCCL on CUDA, gloo on the CPU.

    >>> rank, world_size, device = init_local_rank("auto")  # doctest: +SKIP
    """
    import torch
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = _local_device(device, int(os.environ.get("LOCAL_RANK", rank)))
    if local.type == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=local)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return rank, world_size, local


def _local_device(requested: str, local_rank: int) -> torch.device:
    import torch

    kind = requested
    if requested == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeShardError("--device cuda but torch sees no CUDA device; use --device cpu")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeShardError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); start fewer ranks per node"
            )
        return torch.device("cuda", local_rank)
    if kind != "cpu":
        raise RuntimeShardError(f"--device {requested!r}: expected auto, cpu or cuda")
    return torch.device("cpu")


def _failure_text(entrypoint: Callable[..., Any] | str, failure: Any) -> str:
    if isinstance(entrypoint, str):  # a binary printed its own message to the terminal
        return f"exited with status {failure.exitcode} (its message is above)"
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message).strip()
    return f"failed: {text.splitlines()[0]}" if text else f"failed: exit code {failure.exitcode}"
