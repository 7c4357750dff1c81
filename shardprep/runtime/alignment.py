"""Debug: check at every begin() that all ranks are at the same step, instead of hanging when they are not.

Every gather is a collective matched by position: a rank that runs one forward more, or stops a
forward midway, pairs its gathers with the wrong layers of its peers (silently, when layers have
equal sizes) or hangs. The check all-reduces each rank's (step, forwards begun, gathers issued) over
a separate gloo group, so it never interleaves with the gathers themselves, and raises an error
that names the ranks that disagree.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RuntimeShardError

FIELDS = ("step", "forwards begun", "gathers issued")


class AlignmentCheck:
    """One rank's side of the step check. Collective to construct (it creates a gloo group).

    >>> check = AlignmentCheck(dist.group.WORLD, timedelta(seconds=60))  # doctest: +SKIP
    >>> check(step=7, forwards=7, gathers=42)  # doctest: +SKIP
    """

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta):
        self.ranks = dist.get_process_group_ranks(group)
        kwargs: dict[str, Any] = {} if group is dist.group.WORLD else {"use_local_synchronization": True}
        self.group = dist.new_group(self.ranks, backend="gloo", timeout=timeout, **kwargs)
        self.rank = dist.get_rank(group)
        self.timeout = timeout
        self._table = torch.zeros(len(self.ranks), len(FIELDS), dtype=torch.int64)

    def __call__(self, step: int, forwards: int, gathers: int) -> None:
        table = self._table
        table.zero_()
        table[self.rank] = torch.tensor([step, forwards, gathers], dtype=torch.int64)
        try:
            dist.all_reduce(table, group=self.group)
        except RuntimeError as exc:
            raise RuntimeShardError(
                f"step alignment check: not every rank reached begin() within {self.timeout} "
                f"(rank {self.ranks[self.rank]} is at step {step}); a rank has stopped or is blocked in a "
                f"gather its peers did not issue ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None
        rows = [tuple(r) for r in table.tolist()]
        if len(set(rows)) > 1:
            raise RuntimeShardError(describe_disagreement(self.ranks, rows))


def describe_disagreement(ranks: list[int], rows: list[tuple[int, ...]]) -> str:
    """The error text: which ranks differ from the majority, and every rank's (step, forwards, gathers).

    >>> describe_disagreement([0, 1, 2], [(3, 3, 9), (4, 4, 12), (3, 3, 9)]).split(";")[0]
    'ranks disagree at begin(): rank(s) [1] differ from rank(s) [0, 2]'
    """
    by_row: dict[tuple[int, ...], list[int]] = {}
    for rank, row in zip(ranks, rows):
        by_row.setdefault(row, []).append(rank)
    # The majority is presumed right; on a tie, the group holding the lowest rank.
    majority = max(by_row.values(), key=lambda rs: (len(rs), -rs[0]))
    others = sorted(r for rs in by_row.values() if rs is not majority for r in rs)
    detail = "; ".join(
        f"rank(s) {rs}: " + ", ".join(f"{name} {v}" for name, v in zip(FIELDS, row))
        for row, rs in sorted(by_row.items(), key=lambda kv: kv[1][0])
    )
    return (f"ranks disagree at begin(): rank(s) {others} differ from rank(s) {majority}; {detail}. "
            "Every rank must call begin()/wait()/idle_step() for the same forwards")
