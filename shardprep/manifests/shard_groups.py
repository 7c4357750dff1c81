"""Shard groups: a world of W ranks as W/N groups of N consecutive ranks, and the nodes each group spans.

Rank r is in group r // N and serves rank file r mod N. Ranks are numbered node-major, as torchrun
and vLLM number them (node k holds ranks k·P .. k·P + P − 1 with P ranks per node), so a group stays
inside one node when N divides P. A group that spans nodes gathers over the network between them,
which is an order of magnitude slower than NVLink and cannot hide behind a layer's compute.

Pure arithmetic: `plan` and `inspect` use it with a node size (`node_major`), the runtime
(`shardprep.runtime.shard_groups`) with the node every rank reports, and both ask the same questions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ShardprepError

DEFAULT_GPUS_PER_NODE = 8
"""Ranks per node `plan` and `inspect` assume (an HGX node)."""


@dataclass(frozen=True)
class ShardGroups:
    """W ranks in groups of `group_size` consecutive ranks; `nodes[r]` is the node rank r runs on.

    >>> g = ShardGroups.node_major(world_size=16, group_size=8, ranks_per_node=8)
    >>> g.count, g.group_of(11), g.rank_file_of(11), g.ranks_of(1)
    (2, 1, 3, (8, 9, 10, 11, 12, 13, 14, 15))
    >>> g.cross_node_groups()
    ()
    """

    group_size: int
    nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        problem = group_size_problem(len(self.nodes), self.group_size)
        if problem is not None:
            raise ShardprepError(problem)

    @classmethod
    def node_major(cls, world_size: int, group_size: int, ranks_per_node: int) -> ShardGroups:
        """The groups of a world whose node k holds ranks k·P .. k·P + P − 1 (P = `ranks_per_node`).

        >>> ShardGroups.node_major(4, 2, ranks_per_node=2).nodes
        (0, 0, 1, 1)
        """
        if ranks_per_node < 1:
            raise ShardprepError(f"ranks per node must be >= 1, got {ranks_per_node}")
        return cls(group_size, tuple(r // ranks_per_node for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    @property
    def count(self) -> int:
        """How many groups: W / N."""
        return self.world_size // self.group_size

    def group_of(self, rank: int) -> int:
        """The group of global rank `rank`: rank // N."""
        return rank // self.group_size

    def rank_file_of(self, rank: int) -> int:
        """The rank file global rank `rank` serves: its position in its group, rank mod N."""
        return rank % self.group_size

    def ranks_of(self, group: int) -> tuple[int, ...]:
        """The global ranks of group `group`, in rank-file order."""
        return tuple(range(group * self.group_size, (group + 1) * self.group_size))

    def enumeration(self) -> list[list[int]]:
        """Every group's ranks, group by group: what torch's `new_subgroups_by_enumeration` takes.

        >>> ShardGroups.node_major(4, 2, ranks_per_node=4).enumeration()
        [[0, 1], [2, 3]]
        """
        return [list(self.ranks_of(g)) for g in range(self.count)]

    def nodes_of(self, group: int) -> tuple[int, ...]:
        """The nodes group `group` runs on, in order (one node for a node-local group)."""
        return tuple(sorted({self.nodes[r] for r in self.ranks_of(group)}))

    def cross_node_groups(self) -> tuple[int, ...]:
        """The groups whose ranks run on more than one node.

        >>> ShardGroups.node_major(16, 16, ranks_per_node=8).cross_node_groups()
        (0,)
        """
        return tuple(g for g in range(self.count) if len(self.nodes_of(g)) > 1)

    def cross_node_problem(self) -> str | None:
        """What is wrong when a group spans nodes (the first such group), or None when none does.

        >>> ShardGroups.node_major(24, 6, ranks_per_node=8).cross_node_problem()
        'shard group 1 (ranks 6..11) spans nodes 0 and 1 (and 1 more group)'
        """
        spanning = self.cross_node_groups()
        if not spanning:
            return None
        g = spanning[0]
        ranks, nodes = self.ranks_of(g), self.nodes_of(g)
        more = f" (and {len(spanning) - 1} more group{'s' * (len(spanning) > 2)})" if len(spanning) > 1 else ""
        return (f"shard group {g} (ranks {ranks[0]}..{ranks[-1]}) spans nodes "
                f"{', '.join(map(str, nodes[:-1]))} and {nodes[-1]}{more}")


def group_size_problem(world_size: int, group_size: int) -> str | None:
    """Why `world_size` ranks cannot form groups of `group_size`, or None when they can.

    >>> group_size_problem(6, 4)
    '6 ranks are not a whole number of shard groups of 4'
    >>> group_size_problem(8, 4) is None
    True
    """
    if group_size < 1:
        return f"a shard group needs at least 1 rank, got {group_size}"
    if world_size < 1 or world_size % group_size:
        return f"{world_size} ranks are not a whole number of shard groups of {group_size}"
    return None


def largest_node_local_group(world_size: int, ranks_per_node: int) -> int:
    """The largest group size N that divides `world_size` and keeps every group inside one node.

    >>> largest_node_local_group(16, 8), largest_node_local_group(12, 8), largest_node_local_group(6, 8)
    (8, 4, 6)
    """
    for n in range(min(world_size, max(ranks_per_node, 1)), 0, -1):
        if world_size % n == 0 and not ShardGroups.node_major(world_size, n, ranks_per_node).cross_node_groups():
            return n
    return 1


@dataclass(frozen=True)
class GroupFit:
    """How W data-parallel ranks on nodes of G GPUs take shard groups of N: what `plan` and `inspect` report.

    >>> fit = GroupFit(world_size=16, ranks_per_node=8, group_size=16)
    >>> fit.count, fit.largest_node_local, fit.cross_node_problem()
    (1, 8, 'shard group 0 (ranks 0..15) spans nodes 0 and 1')
    >>> GroupFit(16, 8, 8).describe()
    'W = 16 ranks in 2 shard groups of N = 8 consecutive ranks, each inside one node of 8 GPUs'
    """

    world_size: int
    ranks_per_node: int
    group_size: int

    @property
    def groups(self) -> ShardGroups:
        return ShardGroups.node_major(self.world_size, self.group_size, self.ranks_per_node)

    @property
    def count(self) -> int:
        return self.world_size // self.group_size

    @property
    def largest_node_local(self) -> int:
        """The largest N that divides W and keeps every group inside one node."""
        return largest_node_local_group(self.world_size, self.ranks_per_node)

    def cross_node_problem(self) -> str | None:
        return self.groups.cross_node_problem()

    def describe(self) -> str:
        """One line: the groups and where they run."""
        where = (f"each inside one node of {self._gpus}" if self.cross_node_problem() is None else
                 f"on nodes of {self._gpus}: {self.cross_node_problem()}")
        groups = f"{self.count} shard group{'s' * (self.count > 1)}"
        return f"W = {self.world_size} ranks in {groups} of N = {self.group_size} consecutive ranks, {where}"

    def crosses_nodes_line(self) -> str | None:
        """The start of a verdict when a group spans nodes (callers add their fix), else None.

        >>> GroupFit(16, 8, 16).crosses_nodes_line().split(", so")[0]
        'crosses nodes: on nodes of 8 GPUs, shard group 0 (ranks 0..15) spans nodes 0 and 1'
        >>> GroupFit(16, 8, 8).crosses_nodes_line() is None
        True
        """
        problem = self.cross_node_problem()
        if problem is None:
            return None
        return (f"crosses nodes: on nodes of {self._gpus}, {problem}, so its gathers would cross the network "
                "between nodes, which cannot hide behind compute")

    @property
    def _gpus(self) -> str:
        return f"{self.ranks_per_node} GPU{'s' * (self.ranks_per_node != 1)}"

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "gpus_per_node": self.ranks_per_node, "group_size": self.group_size,
                "groups": self.count, "cross_node_groups": list(self.groups.cross_node_groups()),
                "largest_node_local_group_size": self.largest_node_local, "description": self.describe()}
