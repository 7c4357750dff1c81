"""File descriptors passed between the ranks of a gloo group (what the ce backend's zero copy relies on)."""

from __future__ import annotations

import os

from support.spawn_group import run_ranks


def _suite(rank: int, n: int, root: str) -> dict:
    import torch.distributed as dist

    from shardprep.runtime.fd_passing import PER_MESSAGE, exchange_fds

    count = PER_MESSAGE + 3  # more than one message's worth
    fds = []
    for k in range(count):
        path = os.path.join(root, f"r{rank}-{k}")
        with open(path, "w") as f:
            f.write(f"{rank}:{k}")
        fds.append(os.open(path, os.O_RDONLY))
    everyone = exchange_fds(fds, dist.group.WORLD)
    seen = {}
    for p, got in enumerate(everyone):
        contents = [os.pread(fd, 64, 0).decode() for fd in got]
        seen[p] = contents == [f"{p}:{k}" for k in range(count)]
        if p != rank:
            for fd in got:
                os.close(fd)
    for fd in fds:
        os.close(fd)
    return seen


def test_every_rank_receives_every_peers_descriptors_in_order(tmp_path):
    for n in (2, 3):
        results = run_ranks(_suite, n, str(tmp_path), timeout=120)
        assert results == [{p: True for p in range(n)} for _ in range(n)]
