"""Open one rank's shard file: check it, and read it into one device buffer once that buffer's memory is chosen.

Only `rank_files[rank]` is opened; the other ranks' files may be absent from this machine. `open_rank`
checks the file (path, size, header, and with `verify` every chunk's checksum) and keeps it open; the
bytes are read on first use, straight into the memory that use chooses: the gatherer's zero-copy
allocations, its backend's registered memory, or (any other use) a plain buffer on the device. So
startup never holds the rank's bytes twice on the device.

The bytes are read with `pread` (only `verify` maps the file, one chunk's pages at a time): they stay in
the page cache, with no anonymous copy of the file, on a CUDA device through a bounded pinned staging
buffer, so the host's memory stays at `staging_bytes` whatever the size of the model. The buffer is
laid out like the file, header included, so `file_offset` is also the offset in the buffer. On a CPU
device the buffer itself is the "device" memory and the file is read straight into it. Paths,
checksums and the replicated part are read with the same strict readers `validate` uses
(`shardprep.manifests`).
"""

from __future__ import annotations

import mmap
import os
import stat
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError, RuntimeShardError
from ..manifests.checksums import digest
from ..manifests.dtypes import torch_dtype
from ..manifests.exact_read import open_for_reading, pread_exact, read_exact
from ..manifests.manifest import MANIFEST_NAME, Manifest, load_manifest
from ..manifests.paths import resolve_inside
from ..manifests.rank_file import check_rank_header
from ..manifests.replicated import NOTICE_FILE, check_replicated_file, read_replicated_index
from ..manifests.safetensors_header import SafetensorsHeader, read_safetensors_header
from ..manifests.swap_lock import reads_output
from ..planning.capacity import STAGING_BYTES

Allocate = Callable[[int], torch.Tensor]
"""allocate(nbytes) → a 1-D uint8 device tensor of that size (for example, registered or shareable memory)."""

ReadAt = Callable[[memoryview, int], None]
"""read(into, offset) fills all of `into` with the source's bytes from `offset` on."""


@dataclass
class _UnreadFile:
    """A checked rank file, still open, whose bytes no buffer holds yet.

    The descriptor (not the path) is kept so that the bytes read later are those of the file that was
    checked, even if the directory is replaced meanwhile (`convert --overwrite`).
    """

    fd: int
    path: Path
    device: torch.device
    staging_bytes: int


class RankShards:
    """One rank's chunks of every layer, in one flat uint8 buffer laid out like the rank file.

    Layer ℓ's chunk is `buffer[file_offset : file_offset + chunk_bytes]`, the same offsets on every rank.
    Made by `open_rank`, which reads the file on first use: `rehome(allocate)` reads it straight into
    memory from `allocate` (the gatherer does), `buffer` or `chunk(ℓ)` into a plain buffer on `device`.
    `RankShards(manifest, rank, buffer)` wraps bytes already in memory.

    >>> shards = open_rank("out/", rank=0, device="cuda:0")  # doctest: +SKIP
    >>> shards.chunk(1).numel() == shards.manifest.layer(1).chunk_bytes  # doctest: +SKIP
    """

    _buffer: torch.Tensor | None  # None until the file is read
    _unread: _UnreadFile | None  # the checked file until then

    def __init__(self, manifest: Manifest, rank: int, buffer: torch.Tensor, directory: str | Path | None = None):
        self._setup(manifest, rank, directory, buffer.device)
        self._buffer = self._checked(buffer)

    @classmethod
    def _of_unread(cls, manifest: Manifest, rank: int, directory: Path, file: _UnreadFile,
                   whole: Manifest | None = None) -> RankShards:
        """Shards whose bytes are still in `file`, read on first use; the descriptor is closed then, or with them.

        `whole`: DIR's manifest when `manifest` is its target part (`without_draft`), for the replicated part.
        """
        shards = cls.__new__(cls)
        shards._setup(manifest, rank, directory, file.device)
        shards._whole = whole or manifest
        shards._unread = file
        shards._close = weakref.finalize(shards, os.close, file.fd)
        return shards

    def _setup(self, manifest: Manifest, rank: int, directory: str | Path | None, device: torch.device) -> None:
        self.manifest = manifest
        self._whole = manifest  # DIR's whole manifest (the draft's layers included), for the replicated part
        self.rank = rank
        self.world_size = manifest.world_size
        self.directory = Path(directory) if directory is not None else None
        self._records = {r.layer: r for r in manifest.layers}
        self._device = device
        self._buffer = None
        self._unread = None
        self._close: Callable[[], Any] = lambda: None

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def nbytes(self) -> int:
        """Bytes of the device buffer: Σ chunk_bytes plus the gaps before and between chunks (header, alignment)."""
        return self.manifest.rank_file_bytes

    @property
    def loaded(self) -> bool:
        """True once the rank's bytes are in the buffer (False between open_rank and their first use)."""
        return self._buffer is not None

    @property
    def buffer(self) -> torch.Tensor:
        """The device buffer; the first use reads the rank file into a plain `torch.empty` on `device`.

        >>> shards.buffer.numel() == shards.manifest.rank_file_bytes  # doctest: +SKIP
        """
        if self._buffer is None:
            self._read_into(torch.empty(self.nbytes, dtype=torch.uint8, device=self._device))
        assert self._buffer is not None
        return self._buffer

    def chunk(self, layer: int) -> torch.Tensor:
        """This rank's chunk of `layer` (a view of the buffer, no copy).

        >>> shards.chunk(1)  # doctest: +SKIP
        """
        try:
            r = self._records[layer]
        except KeyError:
            raise RuntimeShardError(f"layer {layer} is not in the manifest (it has {sorted(self._records)})") from None
        return self.buffer[r.file_offset:r.file_offset + r.chunk_bytes]

    def read_chunk(self, layer: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's chunk of `layer` on `device`, read from the rank file alone, the rest of the file left unread
        (copied from the buffer if it is loaded already); into `into` (chunk_bytes of uint8) if given.

        For a loader that handles one layer at a time (vLLM's sharded mode processing quantized targets): the
        rank's bytes are then never all in memory at once.

        >>> own = shards.read_chunk(1)  # doctest: +SKIP
        """
        try:
            r = self._records[layer]
        except KeyError:
            raise RuntimeShardError(f"layer {layer} is not in the manifest (it has {sorted(self._records)})") from None
        out = torch.empty(r.chunk_bytes, dtype=torch.uint8, device=self._device) if into is None else into
        if out.dtype != torch.uint8 or out.shape != (r.chunk_bytes,) or not out.is_contiguous():
            raise RuntimeShardError(f"layer {layer}'s chunk needs {r.chunk_bytes} contiguous bytes, got {out.dtype} "
                                    f"of shape {list(out.shape)}")
        if self._buffer is not None:
            return out.copy_(self.chunk(layer))
        unread = self._unread
        if unread is None:
            raise RuntimeShardError(f"rank {self.rank}'s shard file could not be read (see the first error); "
                                    "open_rank again")
        staging = None
        if out.device.type != "cpu":
            staging = torch.empty(max(2, min(unread.staging_bytes, r.chunk_bytes)) // 2 * 2, dtype=torch.uint8,
                                  pin_memory=True)
        read = _file_reader(unread, self.rank)
        copy_through_staging(out, lambda into, offset: read(into, r.file_offset + offset), staging)
        return out

    def rehome(self, allocate: Allocate) -> None:
        """Put the buffer in memory from `allocate` (a backend's registered or shareable memory).

        Before the first use the rank file is read straight into that memory: nothing else is
        allocated on the device. Once loaded, the buffer is copied: one device copy and, until it
        returns, twice the buffer's memory.

        >>> shards.rehome(backend.allocate_local)  # doctest: +SKIP
        """
        moved = self._checked(allocate(self.nbytes))
        if self._buffer is None:
            self._read_into(moved)
            return
        moved.copy_(self._buffer)
        self._buffer, self._device = moved, moved.device

    def load_replicated(self, device: str | torch.device = "cpu", verify: bool = True) -> dict[str, torch.Tensor]:
        """Every non-target tensor of the directory these shards came from: `load_replicated(DIR, ...)`.

        >>> rest = shards.load_replicated("cuda:0")  # doctest: +SKIP
        >>> rest["model.embed_tokens.weight"].shape  # doctest: +SKIP
        """
        if self.directory is None:
            raise RuntimeShardError("these shards were not opened from a directory; use open_rank(DIR, rank)")
        return load_replicated(self.directory, self._whole, device, verify)

    def _checked(self, buffer: torch.Tensor) -> torch.Tensor:
        size = self.manifest.rank_file_bytes
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != size:
            raise RuntimeShardError(f"a rank buffer must be a 1-D uint8 tensor of {size} bytes, "
                                    f"got {buffer.dtype} of shape {list(buffer.shape)}")
        return buffer

    def _read_into(self, buffer: torch.Tensor) -> None:
        unread = self._unread
        if unread is None:
            raise RuntimeShardError(f"rank {self.rank}'s shard file could not be read (see the first error); "
                                    "open_rank again")
        self._unread = None  # one attempt: a failed read leaves no half-filled buffer behind
        try:
            staging = None
            if buffer.device.type != "cpu":
                staging = torch.empty(max(2, min(unread.staging_bytes, buffer.numel())) // 2 * 2, dtype=torch.uint8,
                                      pin_memory=True)
            copy_through_staging(buffer, _file_reader(unread, self.rank), staging)
        finally:
            self._close()
        self._buffer, self._device = buffer, buffer.device


@reads_output  # the old output or the new one, never half of each, while --overwrite replaces it
def load_replicated(directory: str | Path, manifest: Manifest, device: str | torch.device = "cpu",
                    verify: bool = True) -> dict[str, torch.Tensor]:
    """Every non-target tensor, read from the output directory's safetensors files onto `device`, all at once.

    Through the safetensors library: on the CPU the tensors map the files (page cache, no copy), which
    suits a caller that keeps them as its parameters (`build_model`). Checked as `iter_replicated` says.

    >>> rest = load_replicated("out/", load_manifest("out/"))  # doctest: +SKIP
    """
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name, path, _ in _replicated_files(directory, manifest, verify):
        try:
            out.update(load_file(path, device=str(torch.device(device))))
        except Exception as exc:  # the library's own SafetensorError, or torch lacking a dtype
            raise IntegrityError(f"{name}: the safetensors library cannot load it "
                                 f"({' '.join(str(exc).split())[:200]})", code="invalid_safetensors",
                                 file=name) from None
    return out


@reads_output  # held until the generator ends: every file from one output
def iter_replicated(directory: str | Path, manifest: Manifest, device: str | torch.device = "cpu",
                    verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every non-target tensor, each read into memory of its own when it is asked for.

    For a caller that copies each tensor into a parameter of its own (vLLM's `model.load_weights`): it
    then holds one tensor more than its parameters at any time, never the replicated part twice, nor a
    whole file's mapped pages. Each tensor is read with `pread` into a new host tensor (moved to
    `device` if that is not the CPU) that nothing else references.

    The index and every file go through the strict reader `validate` uses: safe paths only, sizes as
    the manifest says, headers the safetensors library would accept holding exactly what the index
    lists, and with `verify` (the default) each file's XXH3-128 checked before any of its tensors is
    handed out, which reads it once more. Raises IntegrityError naming the file otherwise. No rank file
    is read.

    >>> model.load_weights(iter_replicated("out/", load_manifest("out/")))  # doctest: +SKIP
    """
    device = torch.device(device)
    for _, path, header in _replicated_files(directory, manifest, verify):
        dtypes = {t.name: torch_dtype(t.dtype, tensor=t.name) for t in header.tensors.values()}
        with open_for_reading(path, "safetensors file") as fd:
            for t in header.tensors.values():
                data = torch.empty(t.nbytes, dtype=torch.uint8)
                pread_exact(fd, _host_bytes(data), header.data_start + t.begin, path)
                yield t.name, data.view(dtypes[t.name]).view(t.shape).to(device)


def _replicated_files(directory: str | Path, manifest: Manifest,
                      verify: bool) -> Iterator[tuple[str, Path, SafetensorsHeader]]:
    """(name in the index, checked path, checked header) of every replicated safetensors file, in index order."""
    directory = Path(directory)
    index, problems = read_replicated_index(directory, manifest, verify=verify)
    if problems:
        raise problems[0].error()
    for name in index.files():
        if name == NOTICE_FILE and manifest.version >= 2:
            continue
        path = check_replicated_file(directory, manifest, name, verify=verify)
        header = read_safetensors_header(path)
        held = set(header.tensors)
        listed = index.tensors_of(name)
        if held != listed:
            odd = sorted(held ^ listed)[0]
            raise IntegrityError(f"{name}: does not hold exactly the tensors {manifest.replicated_index} "
                                 f"maps to it ({odd!r} differs); copy the whole output directory again",
                                 code="index_mismatch", file=name, tensor=odd)
        yield name, path, header


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
    draft: bool = True,
) -> RankShards:
    """Open `rank`'s shard file of an output directory of `shardprep convert`: check it now, read it on first use.

    `world_size` (when given) must match the manifest's. The rank file's path must stay inside `path`
    (no absolute path, `..` or symlink out), its size must be the manifest's, and (format version 2) its
    header must be the bytes the manifest implies. `verify=True` also checks this rank's XXH3-128
    checksum of every chunk. The file then stays open (a descriptor, no mapping) until its bytes are
    read into their buffer, once: by the gatherer straight into the memory it gathers from, or by
    any other first use of `buffer`/`chunk` into a `torch.empty` on `device`. `allocate(nbytes)`
    chooses the memory now (for backends that need registered or shareable memory): the file is read
    into it before open_rank returns. `manifest`: DIR's, when the caller has already loaded it (it is
    read again otherwise). `draft=False` serves the target model alone: the draft's layers (`manifest.draft`,
    which come last in the file) are checked with the rest (size, header, and with `verify` their checksums)
    but never read into the buffer, and the shards' manifest is `manifest.without_draft()`.

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
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the device torch.empty would pick, named now
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        raise RuntimeShardError(f"{file}: rank {rank}'s shard file is missing; copy it next to {where.name}") from None
    except (OSError, ValueError) as exc:
        raise RuntimeShardError(f"{file}: cannot read rank {rank}'s shard file "
                                f"({getattr(exc, 'strerror', None) or exc})") from None
    try:
        _check_rank_file(fd, file, rank, manifest, verify)
    except BaseException:
        os.close(fd)
        raise
    served = manifest if draft else manifest.without_draft()
    shards = RankShards._of_unread(served, rank, directory, _UnreadFile(fd, file, device, staging_bytes), manifest)
    if allocate is not None:
        shards.rehome(allocate)
    return shards


def _check_rank_file(fd: int, file: Path, rank: int, manifest: Manifest, verify: bool) -> None:
    """Size, header and (with `verify`) every chunk's checksum of the open rank file, or RuntimeShardError."""
    size = manifest.rank_file_bytes
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RuntimeShardError(f"{file}: cannot read rank {rank}'s shard file (not a regular file)")
        if st.st_size < size:
            raise RuntimeShardError(f"{file}: {st.st_size} bytes, but the manifest needs {size}; the file is truncated")
        if st.st_size > size:
            raise RuntimeShardError(f"{file}: {st.st_size} bytes, but the manifest says {size}; the file is not the "
                                    "one this manifest describes")
        check_rank_header(read_exact(fd, len(manifest.rank_header), 0, file), manifest.rank_header, file, str(file))
        if verify:
            _verify(fd, file, rank, manifest)
    except (OSError, ValueError) as exc:  # ValueError: mmap of a file that shrank meanwhile
        raise RuntimeShardError(f"{file}: cannot read rank {rank}'s shard file "
                                f"({getattr(exc, 'strerror', None) or exc})") from None


def _verify(fd: int, file: Path, rank: int, manifest: Manifest) -> None:
    """Check every chunk's XXH3-128, hashed in place from a read-only map of the file.

    No anonymous copy is made, and each chunk's pages leave the process once hashed (they stay in the
    page cache for the read that follows), so mapped file pages peak at one chunk; the map is closed
    before open_rank returns.
    """
    with mmap.mmap(fd, manifest.rank_file_bytes, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            for r in manifest.layers:
                got = digest(view[r.file_offset:r.file_offset + r.chunk_bytes])
                if got != r.checksums[rank]:
                    raise RuntimeShardError(
                        f"{file}: layer {r.layer}'s chunk (bytes {r.file_offset}..{r.file_offset + r.chunk_bytes}) "
                        f"has checksum {got}, the manifest says {r.checksums[rank]}; the file is corrupt, copy it again"
                    )
                start = r.file_offset - r.file_offset % mmap.PAGESIZE
                mapped.madvise(mmap.MADV_DONTNEED, start, r.file_offset + r.chunk_bytes - start)
        finally:
            view.release()


def _file_reader(unread: _UnreadFile, rank: int) -> ReadAt:
    def read(into: memoryview, offset: int) -> None:
        try:
            pread_exact(unread.fd, into, offset, unread.path)
        except OSError as exc:
            raise RuntimeShardError(f"{unread.path}: cannot read rank {rank}'s shard file "
                                    f"({exc.strerror or exc})") from None

    return read


def copy_through_staging(dst: torch.Tensor, src: ReadAt | bytes | bytearray | memoryview | mmap.mmap,
                         staging: torch.Tensor | None) -> None:
    """Copy `src` (host bytes, or `read(into, offset)` that fills `into` from a file) into the uint8 tensor `dst`.

    Without `staging` (`dst` on the CPU) the bytes go straight into `dst`. With it, they go through
    the two halves of `staging` in turn: while one half's host→device copy runs, the next piece is
    read into the other half, and a half is refilled only after its previous copy finished. Host
    memory used: `staging` alone.

    >>> dst = torch.empty(10, dtype=torch.uint8)
    >>> copy_through_staging(dst, bytearray(range(10)), torch.empty(4, dtype=torch.uint8))
    >>> dst.tolist()
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    if not callable(src):
        view = memoryview(src)
        try:
            copy_through_staging(dst, _bytes_reader(view), staging)
        finally:
            view.release()  # a file map can be closed only once no view of it is left
        return
    total = dst.numel()
    if staging is None:
        if dst.device.type != "cpu":
            raise RuntimeShardError(f"copying into {dst.device} needs a pinned staging buffer")
        if total:
            src(_host_bytes(dst), 0)
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
        src(_host_bytes(halves[h][:k]), start)
        dst[start:start + k].copy_(halves[h][:k], non_blocking=on_device)
        if event is not None:
            event.record(stream)
    if stream is not None:
        stream.synchronize()


def _bytes_reader(view: memoryview) -> ReadAt:
    def read(into: memoryview, offset: int) -> None:
        into[:] = view[offset:offset + len(into)]

    return read


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, writable in place (no copy)."""
    return t.numpy().data
