"""Open one rank's shard file: map it, optionally verify it, copy it into one device buffer.

Only `rank_files[rank]` is opened; the other ranks' files may be absent from this machine. The file
is memory-mapped (page cache, never anonymous memory) and copied whole, header included, into the
device buffer through a bounded pinned staging buffer, so the host's anonymous memory stays at
`staging_bytes` whatever the size of the model, and `file_offset` is also the offset in the buffer. On a
CPU device the buffer itself is the "device" memory and no staging is used. Paths, checksums and the
replicated part are read with the same strict readers `validate` uses (`shardprep.manifests`).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import IntegrityError, RuntimeShardError
from ..manifests.capacity import STAGING_BYTES
from ..manifests.checksums import digest
from ..manifests.manifest import MANIFEST_NAME, Manifest, load_manifest
from ..manifests.paths import resolve_inside
from ..manifests.rank_file import check_rank_header
from ..manifests.replicated import NOTICE_FILE, check_replicated_file, read_replicated_index
from ..manifests.safetensors_header import read_safetensors_header
from ..manifests.swap_lock import reads_output

Allocate = Callable[[int], torch.Tensor]
"""allocate(nbytes) → a 1-D uint8 device tensor of that size (for example, registered or shareable memory)."""


class RankShards:
    """One rank's chunks of every layer, in one flat uint8 buffer laid out like the rank file.

    Layer ℓ's chunk is `buffer[file_offset : file_offset + chunk_bytes]`, the same offsets on every rank.
    Made by `open_rank`; the gatherer reads `chunk(ℓ)`.

    >>> shards = open_rank("out/", rank=0, device="cuda:0")  # doctest: +SKIP
    >>> shards.chunk(1).numel() == shards.manifest.layer(1).chunk_bytes  # doctest: +SKIP
    """

    def __init__(self, manifest: Manifest, rank: int, buffer: torch.Tensor, directory: str | Path | None = None):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != manifest.rank_file_bytes:
            raise RuntimeShardError(
                f"a rank buffer must be a 1-D uint8 tensor of {manifest.rank_file_bytes} bytes, "
                f"got {buffer.dtype} of shape {list(buffer.shape)}"
            )
        self.manifest = manifest
        self.rank = rank
        self.world_size = manifest.world_size
        self.buffer = buffer
        self.directory = Path(directory) if directory is not None else None
        self._records = {r.layer: r for r in manifest.layers}

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def nbytes(self) -> int:
        """Bytes of the device buffer: Σ chunk_bytes plus the 4 KiB alignment gaps between layers."""
        return self.buffer.numel()

    def chunk(self, layer: int) -> torch.Tensor:
        """This rank's chunk of `layer` (a view of the buffer, no copy).

        >>> shards.chunk(1)  # doctest: +SKIP
        """
        try:
            r = self._records[layer]
        except KeyError:
            raise RuntimeShardError(f"layer {layer} is not in the manifest (it has {sorted(self._records)})") from None
        return self.buffer[r.file_offset:r.file_offset + r.chunk_bytes]

    def rehome(self, allocate: Allocate) -> None:
        """Move the buffer into memory from `allocate` (a backend's registered or shareable memory).

        Costs one device copy and, until it returns, twice the buffer's memory; pass `allocate=` to
        `open_rank` instead to load straight into such memory.

        >>> shards.rehome(backend.allocate_local)  # doctest: +SKIP
        """
        moved = allocate(self.nbytes)
        moved.copy_(self.buffer)
        self.buffer = moved

    def load_replicated(self, device: str | torch.device = "cpu", verify: bool = True) -> dict[str, torch.Tensor]:
        """Every non-target tensor of the directory these shards came from: `load_replicated(DIR, ...)`.

        >>> rest = shards.load_replicated("cuda:0")  # doctest: +SKIP
        >>> rest["model.embed_tokens.weight"].shape  # doctest: +SKIP
        """
        if self.directory is None:
            raise RuntimeShardError("these shards were not opened from a directory; use open_rank(DIR, rank)")
        return load_replicated(self.directory, self.manifest, device, verify)


@reads_output  # the old output or the new one, never half of each, while --overwrite replaces it
def load_replicated(directory: str | Path, manifest: Manifest, device: str | torch.device = "cpu",
                    verify: bool = True) -> dict[str, torch.Tensor]:
    """Every non-target tensor, read from the output directory's safetensors files onto `device`.

    The index and every file go through the strict reader `validate` uses: safe paths only, sizes
    as the manifest says, headers the safetensors library accepts holding exactly what the index
    lists, and with `verify` (the default) each file's XXH3-128 checked before it is loaded, which
    reads it once more. Raises IntegrityError naming the file otherwise. No rank file is read.

    >>> rest = load_replicated("out/", load_manifest("out/"))  # doctest: +SKIP
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    index, problems = read_replicated_index(directory, manifest, verify=verify)
    if problems:
        raise problems[0].error()
    out: dict[str, torch.Tensor] = {}
    for name in index.files():
        if name == NOTICE_FILE and manifest.version >= 2:
            continue
        path = check_replicated_file(directory, manifest, name, verify=verify)
        held = set(read_safetensors_header(path).tensors)
        listed = index.tensors_of(name)
        if held != listed:
            odd = sorted(held ^ listed)[0]
            raise IntegrityError(f"{name}: does not hold exactly the tensors {manifest.replicated_index} "
                                 f"maps to it ({odd!r} differs); copy the whole output directory again",
                                 code="index_mismatch", file=name, tensor=odd)
        try:
            out.update(load_file(path, device=str(torch.device(device))))
        except Exception as exc:  # the library's own SafetensorError, or torch lacking a dtype
            raise IntegrityError(f"{name}: the safetensors library cannot load it "
                                 f"({' '.join(str(exc).split())[:200]})", code="invalid_safetensors",
                                 file=name) from None
    return out


@reads_output  # the manifest and the rank file of one output, while --overwrite replaces it
def open_rank(
    path: str | Path,
    rank: int,
    world_size: int | None = None,
    device: str | torch.device = "cpu",
    verify: bool = False,
    staging_bytes: int = STAGING_BYTES,
    allocate: Allocate | None = None,
    manifest: Manifest | None = None,
) -> RankShards:
    """Load `rank`'s shard file from an output directory of `shardprep convert` into one device buffer.

    `world_size` (when given) must match the manifest's. The rank file's path must stay inside `path`
    (no absolute path, `..` or symlink out), its size must be the manifest's, and (format version 2) its
    header must be the bytes the manifest implies. `verify=True` also checks this rank's XXH3-128
    checksum of every chunk before copying. `allocate(nbytes)` supplies the device buffer (default:
    `torch.empty` on `device`), for backends that need registered or shareable memory. `manifest`: DIR's,
    when the caller has already loaded it (it is read again otherwise).

    >>> shards = open_rank("out/", rank=dist.get_rank(), world_size=dist.get_world_size(),
    ...                    device=f"cuda:{torch.cuda.current_device()}")  # doctest: +SKIP
    >>> shards.nbytes  # doctest: +SKIP
    """
    directory = Path(path)
    manifest = load_manifest(directory) if manifest is None else manifest
    where = directory / MANIFEST_NAME
    n = manifest.world_size
    if world_size is not None and world_size != n:
        raise RuntimeShardError(
            f"{where}: converted for world size {n}, but this job runs with world size {world_size}; "
            f"re-run `shardprep convert --ranks {world_size}` or launch {n} ranks"
        )
    if not 0 <= rank < n:
        raise RuntimeShardError(f"{where}: rank {rank} is out of range for world size {n} (ranks 0..{n - 1})")
    file = resolve_inside(directory, manifest.rank_files[rank], what=f"rank {rank}'s file")
    size = manifest.rank_file_bytes
    try:
        with open(file, "rb") as f:
            actual = f.seek(0, 2)
            if actual < size:
                raise RuntimeShardError(f"{file}: {actual} bytes, but the manifest needs {size}; the file is truncated")
            if actual > size:
                raise RuntimeShardError(f"{file}: {actual} bytes, but the manifest says {size}; the file is not the "
                                        "one this manifest describes")
            # ACCESS_COPY gives a writable (copy-on-write) map so torch.frombuffer needs no copy and no
            # warning; nothing writes to it, so its pages stay file-backed page cache.
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise RuntimeShardError(f"{file}: rank {rank}'s shard file is missing; copy it next to {where.name}") from None
    except (OSError, ValueError) as exc:
        raise RuntimeShardError(f"{file}: cannot read rank {rank}'s shard file "
                                f"({getattr(exc, 'strerror', None) or exc})") from None
    try:
        check_rank_header(mapped[:len(manifest.rank_header)], manifest.rank_header, file, str(file))
        if verify:
            _verify(manifest, rank, mapped, file)
        device = torch.device(device)
        buffer = allocate(size) if allocate is not None else torch.empty(size, dtype=torch.uint8, device=device)
        if buffer.device.type == "cpu":
            staging = None
        else:
            staging = torch.empty(max(2, min(staging_bytes, size)) // 2 * 2, dtype=torch.uint8, pin_memory=True)
        copy_through_staging(buffer, mapped, staging)
    finally:
        mapped.close()
    return RankShards(manifest, rank, buffer, directory)


def copy_through_staging(dst: torch.Tensor, src: mmap.mmap | bytes | memoryview, staging: torch.Tensor | None) -> None:
    """Copy `src` (host bytes, typically a file map) into the uint8 tensor `dst`.

    Without `staging` the copy is direct. With it, bytes go through the two halves of `staging` in
    turn: while one half's host→device copy runs, the next piece is read into the other half, and
    a half is refilled only after its previous copy finished. Host memory used: `staging` alone.

    >>> dst = torch.empty(10, dtype=torch.uint8)
    >>> copy_through_staging(dst, bytearray(range(10)), torch.empty(4, dtype=torch.uint8))
    >>> dst.tolist()
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    total = dst.numel()
    view = memoryview(src)
    try:
        if staging is None:
            if total:
                host = torch.frombuffer(view, dtype=torch.uint8, count=total)
                dst.copy_(host)
                del host
            return
        half = staging.numel() // 2
        halves = (staging[:half], staging[half:2 * half])
        on_device = dst.device.type == "cuda"
        stream = torch.cuda.current_stream(dst.device) if on_device else None
        copied = [torch.cuda.Event() if on_device else None for _ in halves]
        for i, start in enumerate(range(0, total, half)):
            k = min(half, total - start)
            h = i % 2
            event = copied[h]
            if event is not None:
                # The half is about to be overwritten: its previous host→device copy must have finished.
                event.synchronize()
            piece = torch.frombuffer(view[start:start + k], dtype=torch.uint8)
            halves[h][:k].copy_(piece)
            del piece
            dst[start:start + k].copy_(halves[h][:k], non_blocking=on_device)
            if event is not None:
                event.record(stream)
        if stream is not None:
            stream.synchronize()
    finally:
        view.release()




def _verify(manifest: Manifest, rank: int, mapped: mmap.mmap, file: Path) -> None:
    view = memoryview(mapped)
    try:
        for r in manifest.layers:
            got = digest(view[r.file_offset:r.file_offset + r.chunk_bytes])
            if got != r.checksums[rank]:
                raise RuntimeShardError(
                    f"{file}: layer {r.layer}'s chunk (bytes {r.file_offset}..{r.file_offset + r.chunk_bytes}) "
                    f"has checksum {got}, the manifest says {r.checksums[rank]}; the file is corrupt, copy it again"
                )
    finally:
        view.release()
