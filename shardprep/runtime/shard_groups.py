"""This rank's shard group inside a larger world, built with torch.distributed's subgroup API.

`manifests.shard_groups.ShardGroups` is the one mapping of a world onto shard groups (rank r in
group r // N, serving rank file r mod N); this module turns it into process groups. `shard_group(N)`
is collective over the world, and every rank:

1. reports the node it runs on (its host, and torchrun's node rank GROUP_RANK where set), so every
   rank knows every rank's node;
2. checks the same layout, so a refusal (W not a multiple of N, a group spanning nodes) is the same
   line on every rank and no rank is left waiting in a collective;
3. creates every group, in the same order (`new_subgroups_by_enumeration`), as torch requires: a
   NCCL world bound to a device splits its communicator for each new group, which is a collective
   over all of its ranks, members or not.

A world that is one group (W = N) gathers over the world itself, as before shard groups existed,
unless `own_communicator` asks for a group of its own (a server whose own collectives use the world).
The groups are built once per world; asking again returns the same group.
"""

from __future__ import annotations

import os
import socket
import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import RuntimeShardError
from ..manifests.shard_groups import ShardGroups, group_size_problem

CROSS_NODE_FLAG = "--allow-cross-node-groups"


@dataclass(frozen=True)
class ShardGroup:
    """This rank's shard group: the world's layout, this rank, and the process group its gathers use.

    >>> group = shard_group(8)  # doctest: +SKIP
    >>> shards = open_rank("out/", group.rank_file, world_size=8)  # doctest: +SKIP
    >>> gatherer = LayerGatherer(shards, group=group.process_group)  # doctest: +SKIP
    """

    layout: ShardGroups
    rank: int
    process_group: dist.ProcessGroup

    @property
    def index(self) -> int:
        """Which group: rank // N."""
        return self.layout.group_of(self.rank)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The group's global ranks, in rank-file order."""
        return self.layout.ranks_of(self.index)

    @property
    def rank_file(self) -> int:
        """The rank file this rank serves: its position in the group, rank mod N."""
        return self.layout.rank_file_of(self.rank)

    @property
    def node(self) -> int:
        """The node this rank runs on (nodes numbered in the order of their lowest rank)."""
        return self.layout.nodes[self.rank]


# Per world (the default process group, weakly: a destroyed world takes its groups with it).
_built: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], ShardGroup]] = weakref.WeakKeyDictionary()


def shard_group(group_size: int, *, allow_cross_node_groups: bool = False, backend: str | None = None,
                own_communicator: bool = False) -> ShardGroup:
    """This rank's group of `group_size` consecutive ranks; collective over the world on first call.

    `backend`: the groups' backend (default: the world's). `allow_cross_node_groups`: accept groups
    whose ranks run on several nodes (refused by default: their gathers cannot hide behind compute).
    `own_communicator`: a process group of its own even when the world is one group.

    >>> group = shard_group(8, allow_cross_node_groups=False)  # doctest: +SKIP
    """
    if not dist.is_initialized():
        raise RuntimeShardError("torch.distributed is not initialized; call dist.init_process_group() first")
    world = dist.group.WORLD
    built = _built.setdefault(world, {})
    key = (group_size, backend, own_communicator)
    group = built.get(key)
    if group is None:
        group = built[key] = _build(group_size, backend, own_communicator, allow_cross_node_groups)
    _check_nodes(group.layout, allow_cross_node_groups)
    return group


def _build(group_size: int, backend: str | None, own_communicator: bool, allow_cross_node_groups: bool) -> ShardGroup:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    problem = group_size_problem(world_size, group_size)
    if problem is not None:
        raise RuntimeShardError(f"{problem}: the world has {world_size} ranks; start a multiple of {group_size} "
                                f"ranks (nodes × ranks per node), or serve a directory converted for a group size "
                                f"that divides {world_size}")
    keys: list[Any] = [None] * world_size
    dist.all_gather_object(keys, node_key())
    first: dict[Any, int] = {}
    layout = ShardGroups(group_size, tuple(first.setdefault(k, len(first)) for k in keys))
    _check_nodes(layout, allow_cross_node_groups)  # before any communicator is made
    if layout.count == 1 and not own_communicator:
        process_group: Any = dist.group.WORLD
    else:
        process_group, _ = dist.new_subgroups_by_enumeration(layout.enumeration(), backend=backend)
    return ShardGroup(layout, rank, process_group)


def _check_nodes(layout: ShardGroups, allowed: bool) -> None:
    refusal = None if allowed else cross_node_refusal(layout)
    if refusal is not None:
        raise RuntimeShardError(refusal)


def cross_node_refusal(layout: ShardGroups) -> str | None:
    """The one-line refusal of a layout with a group spanning nodes, or None when every group is node-local.

    >>> cross_node_refusal(ShardGroups.node_major(4, 4, ranks_per_node=2)).split(":")[0]
    'shard group 0 (ranks 0..3) spans nodes 0 and 1 of the 2 nodes'
    """
    problem = layout.cross_node_problem()
    if problem is None:
        return None
    return (f"{problem} of the {len(set(layout.nodes))} nodes: its gathers would cross the network between nodes, "
            "which cannot hide behind compute; use a group size whose groups fit in a node (`shardprep reshard` "
            f"makes the directory for it), or pass {CROSS_NODE_FLAG} (allow_cross_node_groups=True) to accept it")


def node_key() -> str:
    """What names this process's node: its host, plus torchrun's node rank (GROUP_RANK) where set.

    Two torchrun agents are two nodes even on one host, as the launcher numbers them.

    >>> node_key()  # doctest: +SKIP
    """
    group_rank = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"/node {group_rank}" if group_rank is not None else "")
