"""Where every byte goes: pure layout math, no I/O and no torch.

A layer's targets are packed into one flat buffer T. Entries sit at 16-byte aligned offsets in a
deterministic order; members of a fused group sit back to back so the fused weight is a zero-copy
view. |T| is padded with zeros so that it splits into N equal chunks of C = |T|/N bytes, C a multiple
of the chunk alignment (16 bytes, or e.g. 2 MiB for the runtime's zero-copy mapping): rank i holds
T[i·C:(i+1)·C], whatever tensors those bytes belong to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import LayoutError
from .dtypes import tensor_nbytes

ENTRY_ALIGNMENT = 16
FILE_ALIGNMENT = 4096
# `--chunk-alignment none`: C a multiple of 16 bytes (format version 1's rule).
NO_CHUNK_ALIGNMENT = ENTRY_ALIGNMENT
# Above this the spaces that pad a rank file's header to the first chunk would pass safetensors' 100 MB
# header limit.
MAX_CHUNK_ALIGNMENT = 64 << 20


def file_alignment_for(chunk_alignment: int) -> int:
    """Alignment of every `file_offset` for a chunk alignment: max(4096, chunk_alignment).

    >>> file_alignment_for(16), file_alignment_for(2 << 20)
    (4096, 2097152)
    """
    return max(FILE_ALIGNMENT, chunk_alignment)


def is_chunk_alignment(value: object) -> bool:
    """True for a valid chunk alignment: a power of two from 16 bytes to 64 MiB.

    >>> is_chunk_alignment(16), is_chunk_alignment(2 << 20), is_chunk_alignment(24), is_chunk_alignment(8)
    (True, True, False, False)
    """
    return (isinstance(value, int) and not isinstance(value, bool) and NO_CHUNK_ALIGNMENT <= value
            <= MAX_CHUNK_ALIGNMENT and value & (value - 1) == 0)


def align_up(n: int, alignment: int) -> int:
    """Smallest multiple of `alignment` that is >= n.

    >>> align_up(17, 16)
    32
    """
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to place: its name, safetensors dtype string and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape, tensor=self.name)


@dataclass(frozen=True)
class FusedGroup:
    """Tensors that must sit back to back so that `name` can view them as one weight (concatenated on dim 0).

    `row_multiple`: the view's rows are the members' rows rounded up to a multiple of it, the rows past
    the last member zero (vLLM's Kimi K3 `in_proj_qkvgfab` pads its rows to a multiple of 16).
    """

    name: str
    members: tuple[str, ...]
    row_multiple: int = 1


@dataclass(frozen=True)
class Entry:
    """One tensor inside a layer's flat buffer T."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class FusedView:
    """A fused weight viewed over adjacent entries of T (for example qkv_proj over q, k, v).

    `pad_rows`: zero rows of T after the last member that the view covers too (0 for most views).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    members: tuple[str, ...]
    pad_rows: int = 0

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape, tensor=self.name)


@dataclass(frozen=True)
class LayerLayout:
    """The packed layout of one layer: entries, fused views, |T| and the per-rank chunk size C."""

    layer: int
    entries: tuple[Entry, ...]
    views: tuple[FusedView, ...]
    total_bytes: int
    chunk_bytes: int


def plan_layer(
    layer: int,
    tensors: Sequence[TensorSpec],
    world_size: int,
    groups: Sequence[FusedGroup] = (),
    entry_alignment: int = ENTRY_ALIGNMENT,
    chunk_alignment: int = NO_CHUNK_ALIGNMENT,
) -> LayerLayout:
    """Pack one layer's tensors into a flat buffer split into `world_size` equal chunks.

    Tensors are ordered by name; a fused group takes the place of its first-sorted member and keeps
    its declared member order, with no gap between members, followed by its zero pad rows (if its
    `row_multiple` asks for any), which the next entry does not overlap. A group whose members are a run
    of an earlier group's members (`is_run_of`) places nothing: its view names those bytes too, for a
    server that fuses fewer of them (SGLang's Kimi K3 fuses q, k, v, g where vLLM fuses q, k, v, g, f_a, b).
    C is the smallest multiple of `chunk_alignment` with N·C covering the entries and pad rows.

    >>> t = [TensorSpec("l.0.b", "BF16", (3, 5)), TensorSpec("l.0.a", "F32", (2,))]
    >>> lay = plan_layer(0, t, world_size=2)
    >>> [(e.name, e.offset) for e in lay.entries], lay.total_bytes, lay.chunk_bytes
    ([('l.0.a', 0), ('l.0.b', 16)], 64, 32)
    """
    if world_size < 1:
        raise LayoutError(f"world size must be >= 1, got {world_size}")
    if not is_chunk_alignment(chunk_alignment):
        raise LayoutError(f"chunk alignment {chunk_alignment!r} is not a power of two from 16 bytes to 64 MiB")
    if not tensors:
        raise LayoutError(f"layer {layer} has no tensors to lay out")
    by_name = {t.name: t for t in tensors}
    if len(by_name) != len(tensors):
        raise LayoutError(f"layer {layer} lists a tensor twice")

    group_of: dict[str, FusedGroup] = {}
    placing: list[FusedGroup] = []  # the groups that place their members; the others lie inside one of them
    for g in groups:
        for m in g.members:
            if m not in by_name:
                raise LayoutError(f"fused view {g.name!r}: member {m!r} is not a target of layer {layer}")
        _check_fusable(g, [by_name[m] for m in g.members], entry_alignment)
        host = next((h for h in placing if is_run_of(g.members, h.members)), None)
        if host is not None:
            if g.row_multiple != 1:
                raise LayoutError(f"fused view {g.name!r} lies inside {host.name!r}, so it cannot have pad rows of "
                                  "its own")
            continue  # the wider view placed these members back to back; this one names a run of them
        for m in g.members:
            if m in group_of:
                raise LayoutError(f"tensor {m!r} belongs to two fused views ({group_of[m].name!r}, {g.name!r}); a "
                                  "view may lie inside an earlier one only if its members are a run of that one's")
            group_of[m] = g
        placing.append(g)

    order: list[str] = []
    placed_groups: set[str] = set()
    for name in sorted(by_name):
        group = group_of.get(name)
        if group is None:
            order.append(name)
        elif group.name not in placed_groups:
            placed_groups.add(group.name)
            order.extend(group.members)

    pad_after = {g.members[-1]: _pad_rows(g, by_name) * _row_bytes(by_name[g.members[-1]]) for g in placing}
    entries: list[Entry] = []
    offset = 0
    for name in order:
        t = by_name[name]
        offset = align_up(offset, entry_alignment)
        entries.append(Entry(t.name, t.dtype, tuple(t.shape), offset, t.nbytes))
        offset += t.nbytes + pad_after.get(name, 0)

    at = {e.name: e for e in entries}
    views = []
    for g in groups:
        first = by_name[g.members[0]]
        rows = sum(by_name[m].shape[0] for m in g.members)
        pad = _pad_rows(g, by_name)
        views.append(FusedView(g.name, first.dtype, (rows + pad, *first.shape[1:]), at[g.members[0]].offset,
                               g.members, pad))

    chunk = align_up(-(-max(offset, 1) // world_size), chunk_alignment)
    return LayerLayout(layer, tuple(entries), tuple(views), chunk * world_size, chunk)


def is_run_of(inner: Sequence[str], outer: Sequence[str]) -> bool:
    """Whether `inner` is a contiguous run of `outer`, in order (a fused view that lies inside another).

    >>> [is_run_of(run, ("q", "k", "g")) for run in [("q", "k"), ("k", "g"), ("q", "g")]]
    [True, True, False]
    """
    n = len(inner)
    return any(tuple(outer[i:i + n]) == tuple(inner) for i in range(len(outer) - n + 1))


def _pad_rows(group: FusedGroup, by_name: dict[str, TensorSpec]) -> int:
    return -sum(by_name[m].shape[0] for m in group.members) % group.row_multiple


def _row_bytes(t: TensorSpec) -> int:
    # From the trailing shape, not nbytes / rows: a member may have no rows (members share dtype and trailing shape).
    return tensor_nbytes(t.dtype, (1, *t.shape[1:]), tensor=t.name)


def _check_fusable(group: FusedGroup, members: list[TensorSpec], entry_alignment: int) -> None:
    first = members[0]
    if len(members) < 2:
        raise LayoutError(f"fused view {group.name!r} needs at least two members")
    if group.row_multiple < 1:
        raise LayoutError(f"fused view {group.name!r}: row_multiple must be >= 1, got {group.row_multiple}")
    for m in members:
        if m.dtype != first.dtype:
            raise LayoutError(
                f"fused view {group.name!r}: member {m.name!r} is {m.dtype} but {first.name!r} is {first.dtype}"
            )
        if len(m.shape) == 0 or tuple(m.shape[1:]) != tuple(first.shape[1:]):
            raise LayoutError(
                f"fused view {group.name!r}: member {m.name!r} has shape {list(m.shape)}, which cannot be "
                f"concatenated on dim 0 with {first.name!r} of shape {list(first.shape)}"
            )
    for m in members[:-1]:
        if m.nbytes % entry_alignment:
            raise LayoutError(
                f"fused view {group.name!r}: member {m.name!r} is {m.nbytes} bytes, not a multiple of "
                f"{entry_alignment}, so the next member cannot follow it without a gap"
            )


def plan_file_offsets(chunk_bytes: Sequence[int], file_alignment: int = FILE_ALIGNMENT) -> list[int]:
    """Offsets of consecutive layer chunks inside every rank file, each aligned to `file_alignment`.

    >>> plan_file_offsets([10, 5000, 1])
    [0, 4096, 12288]
    """
    offsets, at = [], 0
    for c in chunk_bytes:
        at = align_up(at, file_alignment)
        offsets.append(at)
        at += c
    return offsets


def used_bytes(entries: Sequence[Entry]) -> int:
    """Where the last entry of T ends: the bytes of T before its tail padding.

    >>> used_bytes([Entry("a", "F32", (3,), 0, 12), Entry("b", "F32", (1,), 16, 4)])
    20
    """
    return max((e.offset + e.nbytes for e in entries), default=0)


def alignment_padding_bytes(rank_file_bytes: int, header_bytes: int, used: Sequence[int], world_size: int) -> int:
    """Bytes of each rank's file (and device buffer) that are alignment padding.

    Everything but the header and the rank's share ⌈used/N⌉ of each layer: the chunks' tail padding
    and the gaps between chunks.

    >>> alignment_padding_bytes(rank_file_bytes=8192 + 32, header_bytes=4096, used=[20, 40], world_size=2)
    4098
    """
    return rank_file_bytes - header_bytes - sum(-(-u // world_size) for u in used)


def chunk_range(rank: int, chunk_bytes: int) -> tuple[int, int]:
    """Byte range [start, end) of T that `rank` holds.

    >>> chunk_range(2, 32)
    (64, 96)
    """
    return rank * chunk_bytes, (rank + 1) * chunk_bytes
