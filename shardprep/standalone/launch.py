"""Starting a node's ranks the way torchrun does, from inside a command: `shardprep run` and `shardprep profile`.

torch's elastic launcher gives each process RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK
(the node's rank), MASTER_ADDR, ... and, when one fails, stops the others on its node (they would
otherwise wait for it in a collective forever). This module turns that failure into one
RuntimeShardError naming the rank.

A failure must also reach the other nodes, whose agents know nothing of it: their ranks would die of a
transport error ("Connection closed by peer") or hang in a collective. So the ranks share a
`FailureBoard` in the launch's store: the first rank to fail records its one-line message there, every
rank watches it, and every rank and agent of every node ends with that line.

On one node the ranks meet at a rendezvous of their own on 127.0.0.1. Across M nodes each node runs
the same command with its `--node-rank`; the nodes meet at node 0's `--rdzv-endpoint` (torch's static
rendezvous, torchrun's `--master-addr/--master-port` with `--node-rank`), and node k's local rank i is
global rank k·P + i: node-major, as shard groups expect.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import RuntimeShardError

if TYPE_CHECKING:
    import torch

AGENT_PRINTS_FAILURES = "SHARDPREP_AGENT_PRINTS_FAILURES"
"""Set (to 1) for the workers `launch_local` starts: their agent prints the failure line they hand it, so they
print nothing themselves (one line per node, not one per rank)."""
WATCH_INTERVAL_S = 0.2


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
    # The agent's chatter, its "failed (exitcode: 2) local_rank: 1 ..." included, is not the user's output:
    # a failure reaches the user as the one line raised below.
    elastic.setLevel(logging.CRITICAL)
    agent_prints = os.environ.get(AGENT_PRINTS_FAILURES)
    if isinstance(entrypoint, str):
        os.environ[AGENT_PRINTS_FAILURES] = "1"  # the workers inherit this process's environment
    try:
        results = elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as exc:
        raise RuntimeShardError(_failure_line(entrypoint, exc)) from None
    finally:
        elastic.setLevel(level)
        if agent_prints is None:
            os.environ.pop(AGENT_PRINTS_FAILURES, None)
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


def _failure_line(entrypoint: Callable[..., Any] | str, exc: Any) -> str:
    """The line that names a launch's first failure, from the failures of this node's workers."""
    rank, failure = exc.get_first_failure()
    if isinstance(entrypoint, str):
        # A shardprep worker hands over the launch's first failure, rank and node included (`hand_to_agent`);
        # which of this node's workers reported it first does not matter, they all report the same line. A
        # worker that hands over nothing (killed, or a binary of another kind) printed its own message.
        handed = sorted((f.timestamp, r, _message(f)) for r, f in exc.failures.items()
                        if os.path.isfile(f.error_file) and _message(f))
        if handed:
            return handed[0][2]
        return f"rank {rank} exited with status {failure.exitcode} (its message is above); the others were stopped"
    text = _message(failure) or f"exit code {failure.exitcode}"
    return f"rank {rank} failed: {text.splitlines()[0]}; the others were stopped"


def _message(failure: Any) -> str:
    """The worker's message: what it left in its error file, or what torch made up (a signal, an exit code)."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message).strip()


def hand_to_agent(line: str) -> None:
    """Leave `line` where torch's elastic agent reads a failed worker's message (TORCHELASTIC_ERROR_FILE,
    what torch's `@record` writes); `launch_local` raises it, and torchrun prints it as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": "",
                                                                   "timestamp": str(int(time.time()))}}}, f)


class FailureBoard:
    """The first failure of a launch, in the store every rank of every node reaches (MASTER_ADDR:MASTER_PORT).

    A rank that fails `record`s its one-line message before its sockets close (the first record wins), so a
    peer whose collective breaks because of it finds it there; `record` returns the line that won. Every
    rank also watches the board: a failure recorded elsewhere calls `on_failure(line)` at once, before this
    rank blocks in a collective that would only break or, on NCCL, hang until its timeout.

    >>> board = FailureBoard.join(on_failure=print)  # doctest: +SKIP
    >>> board.record("rank 3 (node 1) failed first: ...")  # doctest: +SKIP
    """

    def __init__(self, store: Any | None, key: str = "", on_failure: Callable[[str], None] | None = None):
        self._store, self._key = store, key
        self._lock = threading.Lock()
        self._ending = False  # this rank is already leaving with a failure: recorded, or seen on the board
        self._stop = threading.Event()
        if store is not None and on_failure is not None:
            threading.Thread(target=self._watch, args=(store, on_failure), name="shardprep-failure-board",
                             daemon=True).start()

    @classmethod
    def join(cls, on_failure: Callable[[str], None] | None = None) -> FailureBoard:
        """The launch's board, once the process group is up (its store then exists); a board of this rank
        alone where there is no store to reach."""
        import torch.distributed as dist

        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return cls(None)
        try:
            store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=30))
        except RuntimeError:
            return cls(None)
        # A key per attempt: a torchrun restart starts from a clean board.
        return cls(store, f"shardprep/first-failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", on_failure)

    def record(self, line: str) -> str:
        """Record this rank's failure unless another was first; the first failure's line."""
        with self._lock:
            self._ending = True
        if self._store is None:
            return line
        try:
            return bytes(self._store.compare_set(self._key, "", line)).decode()
        except RuntimeError:  # the store is gone (node 0's agent has left): this rank knows only its own
            return line

    def close(self) -> None:
        """Stop watching (the run is over)."""
        self._stop.set()

    def _watch(self, store: Any, on_failure: Callable[[str], None]) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                if not store.check([self._key]):
                    continue
                line = bytes(store.get(self._key)).decode()
            except RuntimeError:  # the store is gone: the launch is over
                return
            with self._lock:
                if self._ending or self._stop.is_set():
                    return
                self._ending = True
            on_failure(line)
            return
