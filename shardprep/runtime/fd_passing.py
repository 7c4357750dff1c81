"""Pass file descriptors between the ranks of a group on one host (Unix sockets, SCM_RIGHTS).

The ce backend's zero-copy shard buffer is made of CUDA allocations that the peers map directly.
The driver exports each allocation as a POSIX file descriptor, which means something in another
process only once the kernel has passed it there. Every rank listens on an abstract Unix socket
named after a token that the group's first rank draws, sends its descriptors to every peer in
SOCK_SEQPACKET messages of at most 250 (the kernel passes at most 253 per message), and receives
theirs. All ranks must run on one host, as NVLink peers do.
"""

from __future__ import annotations

import secrets
import socket
import struct
from collections.abc import Sequence

import torch.distributed as dist

from ..errors import RuntimeShardError

PER_MESSAGE = 250
TIMEOUT_S = 120.0


def exchange_fds(fds: Sequence[int], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's `fds`, in rank order (this rank's own as given; the others' are new descriptors
    in this process, which the caller closes). Collective over `group`.

    >>> everyone = exchange_fds([fd_a, fd_b], group)  # doctest: +SKIP
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    token: list[str | None] = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)

    def address(r: int) -> str:
        return f"\0shardprep-fds-{token[0]}-{r}"

    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.settimeout(TIMEOUT_S)
    received: dict[int, list[int]] = {}
    try:
        server.bind(address(rank))
        server.listen(n)
        dist.barrier(group=group)  # every rank listens before anyone connects
        for peer in range(n):
            if peer != rank:
                _send(address(peer), rank, fds)
        for _ in range(n - 1):
            conn, _ = server.accept()
            with conn:
                sender, got = _receive(conn)
                received[sender] = got
    except OSError as exc:
        for got in received.values():
            _close(got)
        raise RuntimeShardError(f"passing CUDA memory handles between the ranks failed ({exc}); the ranks of "
                                "a zero-copy ce group must run on one host") from None
    finally:
        server.close()
    return [list(fds) if p == rank else received[p] for p in range(n)]


def _send(address: str, rank: int, fds: Sequence[int]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(TIMEOUT_S)
        conn.connect(address)
        conn.send(struct.pack("<ii", rank, len(fds)))
        for start in range(0, len(fds), PER_MESSAGE):
            socket.send_fds(conn, [b"f"], list(fds[start:start + PER_MESSAGE]))


def _receive(conn: socket.socket) -> tuple[int, list[int]]:
    sender, count = struct.unpack("<ii", conn.recv(8))
    got: list[int] = []
    while len(got) < count:
        _, fds, _, _ = socket.recv_fds(conn, 1, PER_MESSAGE)
        if not fds:
            _close(got)
            raise OSError(f"rank {sender} sent {len(got)} of {count} descriptors")
        got += fds
    return sender, got


def _close(fds: Sequence[int]) -> None:
    import os

    for fd in fds:
        os.close(fd)
