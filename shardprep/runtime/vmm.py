"""CUDA virtual memory: physical device memory mapped at addresses of our choosing, seen as torch tensors.

The zero-copy own chunk (`zero_copy.py`) maps one physical allocation at two virtual addresses:
in the shard buffer, and in the part of a layer's gather view that holds this rank's chunk. This
module is the thin layer over the CUDA driver that makes that possible (`cuda.bindings.driver`):

- `create(nbytes, device, shareable)`: new physical memory (cuMemCreate), not yet mapped; a
  shareable one can be exported to the other processes of the host (`export_fd`, `import_fd`);
- `retain(address)`: the allocation behind an address that is VMM-mapped (cuMemRetainAllocationHandle);
- `map_pieces(pieces, nbytes, device)`: reserve a virtual range, map each allocation whole into it
  (cuMemMap), grant this device read/write (cuMemSetAccess), and return it as a 1-D uint8 tensor
  (through `__cuda_array_interface__`, no copy).

Every mapping maps a whole allocation from its first byte: the driver of the H200 machines
(580.159, CUDA 13.0) answered CUDA_ERROR_NOT_SUPPORTED to a cuMemMap at a nonzero offset into an
allocation (2026-11-30), so memory that two views share is allocated in the pieces they share.

Mappings are made once at startup and never change, so kernels and CUDA graphs that use the
tensors see fixed addresses. Physical memory is freed when its last mapping goes: callers release
a handle once it is mapped, and a range is unmapped when its tensor is garbage-collected.

Nothing here runs on a machine without CUDA: `unavailable(device)` says why not, and every other
function is called only when it returned None.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RuntimeShardError


class VmmError(RuntimeShardError):
    """A CUDA virtual-memory call failed (the message names the call and the driver's error)."""


def unavailable(device: torch.device) -> str | None:
    """Why CUDA virtual memory cannot be used on `device`, or None when it can.

    >>> unavailable(torch.device("cpu"))
    'the device is cpu, not CUDA'
    """
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "the cuda-bindings package is not installed (pip install cuda-bindings)"
    try:
        with _current(device):
            attribute = _driver().CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            supported = _call("cuDeviceGetAttribute", attribute, _call("cuDeviceGet", _ordinal(device)))
    except Exception as exc:  # any failure of the driver or its bindings means "not here"; say which
        return f"CUDA virtual memory does not work here ({type(exc).__name__}: {exc})"
    if not supported:
        return f"{device} does not support CUDA virtual memory management (driver too old?)"
    return None


def granularity(device: torch.device) -> int:
    """The smallest size and alignment of a mapping on `device` (2 MiB on the H200).

    >>> gran = granularity(torch.device("cuda", 0))  # doctest: +SKIP
    """
    with _current(device):
        return int(_call("cuMemGetAllocationGranularity", _prop(device),
                         _driver().CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))


@dataclass
class Physical:
    """One physical allocation (a driver handle) and its size. `release()` once it is mapped everywhere."""

    handle: Any
    nbytes: int

    def release(self) -> None:
        if self.handle is not None:
            _call("cuMemRelease", self.handle)
            self.handle = None


@dataclass(frozen=True)
class Piece:
    """The whole of `physical`, mapped at byte `at` of a virtual range."""

    at: int
    physical: Physical


def create(nbytes: int, device: torch.device, shareable: bool = False) -> Physical:
    """New physical memory on `device` (`nbytes`, a multiple of `granularity`), not mapped anywhere yet.

    `shareable`: other processes of this host may map it (`export_fd`).

    >>> slot = create(64 << 20, torch.device("cuda", 0))  # doctest: +SKIP
    """
    with _current(device):
        return Physical(_call("cuMemCreate", nbytes, _prop(device, shareable), 0), nbytes)


def retain(address: int, device: torch.device) -> Physical:
    """The allocation mapped at `address` (any byte of it); its size is not known here (0). release() it.

    >>> same = int(retain(view_ptr, dev).handle) == int(retain(shard_ptr, dev).handle)  # doctest: +SKIP
    """
    with _current(device):
        return Physical(_call("cuMemRetainAllocationHandle", address), 0)


def export_fd(address: int, device: torch.device) -> int:
    """A file descriptor for the shareable allocation mapped at `address` (send it to a peer process).

    >>> fd = export_fd(buffer.data_ptr(), buffer.device)  # doctest: +SKIP
    """
    physical = retain(address, device)
    try:
        with _current(device):
            return int(_call("cuMemExportToShareableHandle", physical.handle, _posix_fd(), 0))
    finally:
        physical.release()


def import_fd(fd: int, nbytes: int, device: torch.device) -> Physical:
    """The allocation a peer exported as `fd` (`nbytes` long), ready to be mapped here. Closes nothing.

    >>> peer_chunk = import_fd(fd, 64 << 20, torch.device("cuda", 0))  # doctest: +SKIP
    """
    with _current(device):
        return Physical(_call("cuMemImportFromShareableHandle", fd, _posix_fd()), nbytes)


def map_pieces(pieces: Sequence[Piece], nbytes: int, device: torch.device) -> torch.Tensor:
    """Reserve `nbytes` of virtual addresses, map every piece into it, and return it as a uint8 tensor.

    Pieces must cover [0, nbytes) without overlap, each at a multiple of the granularity. The
    handles are not released (the caller owns them); the range is unmapped and freed when the
    returned tensor (and every view of it) is gone.

    >>> view = map_pieces([Piece(0, peer_part), Piece(2 << 20, own_chunk)], 4 << 20, dev)  # doctest: +SKIP
    """
    cu = _driver()
    with _current(device):
        va = int(_call("cuMemAddressReserve", nbytes, granularity(device), 0, 0))
        mapped: list[tuple[int, int]] = []
        try:
            for p in pieces:
                _call("cuMemMap", va + p.at, p.physical.nbytes, 0, p.physical.handle, 0)
                mapped.append((va + p.at, p.physical.nbytes))
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = _ordinal(device)
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _call("cuMemSetAccess", va, nbytes, [access], 1)
        except BaseException:
            _unmap(va, nbytes, mapped)
            raise
    owner = _MappedRange(va, nbytes, device)
    finalizer = weakref.finalize(owner, _unmap, va, nbytes, mapped)
    finalizer.atexit = False  # at exit the driver frees everything; its context may already be gone
    return torch.as_tensor(owner, device=device)


class _MappedRange:
    """Owns a mapped virtual range; torch keeps it alive as long as a tensor uses the memory."""

    def __init__(self, va: int, nbytes: int, device: torch.device):
        self.va, self.nbytes, self.device = va, nbytes, device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # Version 2: no "stream" key, so torch does not synchronise any stream when wrapping it.
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.va, False), "version": 2}


def _unmap(va: int, nbytes: int, mapped: list[tuple[int, int]]) -> None:
    try:
        for ptr, size in mapped:
            _call("cuMemUnmap", ptr, size)
        _call("cuMemAddressFree", va, nbytes)
    except VmmError:
        pass  # best effort at teardown: nothing can use the range any more


# -- the driver ------------------------------------------------------------------------------------
def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _call(name: str, *args: Any) -> Any:
    """driver.name(*args), with its CUresult checked; the value(s) it returns besides the status."""
    cu = _driver()
    out = getattr(cu, name)(*args)
    status, values = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if status != cu.CUresult.CUDA_SUCCESS:
        raise VmmError(f"{name} failed: {getattr(status, 'name', status)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@contextmanager
def _current(device: torch.device) -> Iterator[None]:
    # Driver calls act on the thread's current context: make it this device's primary context (torch's
    # own; cudaSetDevice creates it), and put the caller's device back afterwards.
    with torch.cuda.device(device):
        _call("cuInit", 0)
        yield


def _ordinal(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _prop(device: torch.device, shareable: bool = False) -> Any:
    cu = _driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = _ordinal(device)
    if shareable:
        prop.requestedHandleTypes = _posix_fd()
    return prop


def _posix_fd() -> Any:
    return _driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
