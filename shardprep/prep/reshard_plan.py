"""The reshard plan: an output directory's layers laid out again for M ranks, from its manifest alone.

A layer's flat buffer T holds the same entries at the same offsets for any N (docs/format.md, "Packing
one layer"): only its tail padding (|T| = N·C) and the chunk alignment depend on N. So the plan lays
every layer out again with the code convert uses (`plan.lay_out`, `plan.choose_rank_layout`), from the
entries and fused views the manifest records, and checks that every entry and view comes out exactly
where the manifest has it: the bytes of T below the last entry's end can then be moved from the N
chunks to the M chunks unchanged. Nothing here reads or writes a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError, ManifestError
from ..manifests.layout import FusedGroup, LayerLayout, TensorSpec, file_alignment_for, used_bytes
from ..manifests.manifest import MANIFEST_NAME, LayerRecord, Manifest
from ..manifests.rank_file import rank_file_name
from .convert_plan import RankFileLayout, choose_rank_layout, lay_out, parse_chunk_alignment
from .selection import TargetPlan


@dataclass(frozen=True)
class LayerMove:
    """One layer: where its N chunks are (`source`, the input's record) and how its M chunks are laid out."""

    source: LayerRecord
    layout: LayerLayout
    file_offset: int

    @property
    def used_bytes(self) -> int:
        """Where the last entry ends: T's bytes below it are the same for N and M, those above are zero."""
        return used_bytes(self.layout.entries)

    @property
    def buffer_bytes(self) -> int:
        """T as read (N chunks) or as written (M chunks), whichever is longer."""
        return max(self.source.total_bytes, self.layout.total_bytes)


@dataclass(frozen=True)
class ReshardPlan:
    """What reshard will write: the input's manifest and every layer's new layout and place. See `plan_reshard`."""

    source: Manifest
    rank_layout: RankFileLayout
    moves: tuple[LayerMove, ...]

    @property
    def world_size(self) -> int:
        return self.rank_layout.world_size

    @property
    def buffer_bytes(self) -> int:
        """The one buffer reshard needs: max over layers of max(|T| for N, |T| for M)."""
        return max(move.buffer_bytes for move in self.moves)

    def skeleton_manifest(self, resharded_from: dict[str, Any]) -> Manifest:
        """The new manifest without chunk checksums: the input's records but for the layout and provenance.

        `source`, `selection`, `quantization`, `requant_options` and `replicated_files` are the input's
        (the replicated part does not depend on N); `resharded_from` names the input.
        """
        src, rank_layout = self.source, self.rank_layout
        return Manifest(
            world_size=self.world_size,
            rank_files=tuple(rank_file_name(r, self.world_size) for r in range(self.world_size)),
            layers=tuple(LayerRecord.from_layout(m.layout, m.file_offset) for m in self.moves),
            source=src.source,
            quantization=src.quantization,
            replicated_index=src.replicated_index,
            chunk_alignment=rank_layout.chunk_alignment,
            file_alignment=file_alignment_for(rank_layout.chunk_alignment),
            replicated_files=tuple(sorted(src.replicated_files, key=lambda f: f.path)),
            selection=src.selection,
            requant_options=src.requant_options,
            resharded_from=resharded_from,
            draft=src.draft,
        )


def plan_reshard(manifest: Manifest, world_size: int, chunk_alignment: str | int = "auto", *,
                 where: str = MANIFEST_NAME) -> ReshardPlan:
    """Lay the layers of the version-2 `manifest` out for `world_size` ranks, `chunk_alignment` as in convert.

    Raises ManifestError, naming the manifest as `where`, when an entry or fused view is not where the
    layout rule puts it: convert cannot have written that manifest, and moving its bytes would misplace
    tensors.

    >>> from shardprep.manifests.layout import plan_layer
    >>> lay = plan_layer(1, [TensorSpec("layers.1.w", "BF16", (40,))], world_size=4)
    >>> m = Manifest(4, tuple(rank_file_name(r, 4) for r in range(4)), (LayerRecord.from_layout(lay, 4096),))
    >>> plan = plan_reshard(m, 3, "none")
    >>> [(mv.source.chunk_bytes, mv.layout.chunk_bytes, mv.used_bytes) for mv in plan.moves]
    [(32, 32, 80)]
    """
    alignment = parse_chunk_alignment(chunk_alignment)
    layers = [(r.layer, [TensorSpec(e.name, e.dtype, e.shape) for e in r.entries]) for r in manifest.layers]
    # The fused groups in the manifest's view order: plan_layer lists the views in the order it is given. A view
    # with pad rows is padded to its own row count, the one multiple that gives exactly its rows again.
    targets = TargetPlan(layers={r.layer: [e.name for e in r.entries] for r in manifest.layers},
                         groups={r.layer: [FusedGroup(v.name, v.members, v.shape[0] if v.pad_rows else 1)
                                           for v in r.views] for r in manifest.layers})
    try:
        if alignment is None:
            rank_layout = choose_rank_layout(layers, targets, world_size)
        else:
            rank_layout = lay_out(layers, targets, world_size, alignment)
    except LayoutError as exc:
        raise ManifestError(f"{where}: its layers cannot be laid out again ({exc})") from None
    moves = []
    for record, layout, offset in zip(manifest.layers, rank_layout.layouts, rank_layout.file_offsets):
        _check_same_entries(record, layout, where)
        moves.append(LayerMove(record, layout, offset))
    return ReshardPlan(manifest, rank_layout, tuple(moves))


def _check_same_entries(record: LayerRecord, layout: LayerLayout, where: str) -> None:
    # The entries' offsets are a pure function of the names, dtypes, shapes and fused groups; a manifest
    # whose entries sit elsewhere was not written by convert, and moving its bytes would misplace tensors.
    placed = {e.name: e for e in layout.entries}
    for e in record.entries:
        if placed.get(e.name) != e:
            at = placed[e.name].offset if e.name in placed else None
            raise ManifestError(f"{where}: layer {record.layer}: tensor {e.name!r} is at offset {e.offset}, "
                                f"where the layout rule puts it at {at}; not an output of `shardprep convert`, so it "
                                "cannot be resharded", code="manifest_invariant")
    if tuple(layout.views) != tuple(record.views):
        raise ManifestError(f"{where}: layer {record.layer}: its fused views are not where the layout rule "
                            "puts them; not an output of `shardprep convert`, so it cannot be resharded",
                            code="manifest_invariant")
