"""Rebuild the full target tensors from every rank's file, one layer at a time (for unsharded serving).

A server that does not gather at run time (vLLM's full mode, any tensor-parallel layout) still wants
the one artifact: it reads every rank's chunk of a layer, puts them back together into T and hands out
each entry of T. Only the chunks that hold wanted entries are read, and with `verify` each chunk read
is checked against its checksum in the manifest before any of its bytes is used.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from ..manifests.dtypes import torch_dtype
from ..manifests.exact_read import open_for_reading, read_exact
from ..manifests.layout import Entry, chunk_range
from ..manifests.manifest import LayerRecord, Manifest, load_manifest, read_chunk
from ..manifests.paths import resolve_inside
from ..manifests.rank_file import check_rank_header
from ..manifests.swap_lock import reads_output


@reads_output  # held until the generator ends: every layer from one output
def iter_full_targets(
    directory: str | Path,
    *,
    verify: bool = True,
    names: Collection[str] | None = None,
    manifest: Manifest | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor on the CPU) for every target entry of DIR, in manifest order.

    Layer by layer: the layer's chunks are read from all rank files (`manifest.rank_files[r]` at
    `file_offset`) into one buffer of |T| bytes, and its entries are views of it, so at most one layer
    is in memory while the caller consumes them. `names` keeps only those targets (and reads only the
    chunks they lie in); `verify` checks the XXH3-128 checksum of every chunk read. A rank file is
    opened when first needed, under the same path rules and header check as `open_rank`. Fused views
    are not yielded: their members are, under the checkpoint's own names.

    >>> for name, tensor in iter_full_targets("out/"):  # doctest: +SKIP
    ...     model_state[name].copy_(tensor)
    """
    directory = Path(directory)
    manifest = load_manifest(directory) if manifest is None else manifest
    wanted = None if names is None else set(names)
    with ExitStack() as files:
        fds: dict[int, tuple[int, Path]] = {}
        for record in manifest.layers:
            entries = [e for e in record.entries if wanted is None or e.name in wanted]
            if not entries:
                continue
            layer = torch.empty(record.total_bytes, dtype=torch.uint8)
            for rank in _ranks_holding(record, entries, manifest.world_size):
                if rank not in fds:
                    fds[rank] = _open_rank_file(files, directory, manifest, rank)
                fd, path = fds[rank]
                lo, hi = chunk_range(rank, record.chunk_bytes)
                read_chunk(fd, path, record, rank, layer.numpy().data[lo:hi], verify=verify)
            for e in entries:
                yield e.name, layer[e.offset:e.offset + e.nbytes].view(torch_dtype(e.dtype, tensor=e.name)).view(
                    e.shape)


def _ranks_holding(record: LayerRecord, entries: list[Entry], world_size: int) -> list[int]:
    c = record.chunk_bytes
    needed: set[int] = set()
    for e in entries:
        if e.nbytes:
            needed.update(range(e.offset // c, (e.offset + e.nbytes - 1) // c + 1))
    return sorted(r for r in needed if r < world_size)


def _open_rank_file(files: ExitStack, directory: Path, manifest: Manifest, rank: int) -> tuple[int, Path]:
    path = resolve_inside(directory, manifest.rank_files[rank], what=f"rank {rank}'s shard file")
    fd = files.enter_context(open_for_reading(path, f"rank {rank}'s shard file (full mode reads every rank's)"))
    header = manifest.rank_header
    check_rank_header(read_exact(fd, len(header), 0, path) if header else b"", header, path, str(path))
    return fd, path
