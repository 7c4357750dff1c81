"""Starting a node's ranks the way torchrun does, from inside a command: `shardprep run` and `shardprep profile`.

torch's elastic launcher gives each process RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK
(the node's rank), MASTER_ADDR, ... and, when one fails, stops the others on its node (they would
otherwise wait for it in a collective forever). This module turns that failure into one
RuntimeShardError naming the rank.

On one node the ranks meet at a rendezvous of their own on 127.0.0.1. Across M nodes each node runs
the same command with its `--node-rank`; the nodes meet at node 0's `--rdzv-endpoint` (torch's static
rendezvous, torchrun's `--master-addr/--master-port` with `--node-rank`), and node k's local rank i is
global rank k·P + i: node-major, as shard groups expect.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import RuntimeShardError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Nodes:
    """The nodes of a launch: how many, this one's rank among them, and node 0's HOST:PORT (M > 1).

    >>> Nodes(nnodes=2, node_rank=1, rdzv_endpoint="node0:29400").check()
    """

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    def check(self) -> None:
        """Refuse, in one line, nodes that cannot meet.

        >>> Nodes(nnodes=2, node_rank=2, rdzv_endpoint="node0:29400").check()
        Traceback (most recent call last):
        ...
        shardprep.errors.RuntimeShardError: --node-rank 2 with --nnodes 2: node ranks are 0 to 1
        """
        if self.nnodes < 1:
            raise RuntimeShardError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise RuntimeShardError(f"--node-rank {self.node_rank} with --nnodes {self.nnodes}: node ranks are 0 to "
                                    f"{self.nnodes - 1}")
        if self.rdzv_endpoint is None:
            if self.nnodes > 1:
                raise RuntimeShardError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, an address of "
                                        "node 0 that every node reaches (the same on every node)")
            return
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RuntimeShardError(f"--rdzv-endpoint {self.rdzv_endpoint!r}: expected HOST:PORT, e.g. node0:29400")


def launch_local(entrypoint: Callable[..., Any] | str, nproc: int, *args: Any,
                 nodes: Nodes | None = None) -> list[Any]:
    """`entrypoint(*args)` in `nproc` local processes; their return values by local rank.

    `entrypoint` is a picklable function (its return value comes back, its error message becomes the
    RuntimeShardError's) or a binary such as `sys.executable` (it prints its own error; the return values
    are None). `nodes`: this node's place in a launch over several nodes (default: one node).

    >>> launch_local(sys.executable, 2, "-m", "shardprep.run", "out/")  # doctest: +SKIP
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # As torchrun does: N processes each using every core would oversubscribe the machine.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    nodes = nodes or Nodes()
    nodes.check()
    if nodes.rdzv_endpoint is None:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                              run_id=f"shardprep-{uuid.uuid4().hex}", rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1, start_method="spawn")
    else:
        # Static: node k is node k (torchrun's --node-rank); node 0's agent hosts the store at the endpoint.
        config = LaunchConfig(min_nodes=nodes.nnodes, max_nodes=nodes.nnodes, nproc_per_node=nproc,
                              run_id="shardprep", rdzv_backend="static", rdzv_endpoint=nodes.rdzv_endpoint,
                              rdzv_configs={"rank": nodes.node_rank}, max_restarts=0, monitor_interval=0.1,
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
    first = nodes.node_rank * nproc  # results are keyed by global rank
    return [results[first + r] for r in range(nproc)] if results else [None] * nproc


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
