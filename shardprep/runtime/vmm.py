"""CUDA virtual memory: physical device memory mapped at addresses of our choosing, seen as torch tensors.

The zero-copy own chunk (`zero_copy.py`) maps one physical page range at two virtual addresses:
the shard buffer, and the part of a layer's gather view that holds this rank's chunk. This module
is the thin layer over the CUDA driver that makes that possible (`cuda.bindings.driver`):

- `create(nbytes, device)`: new physical memory (cuMemCreate), not yet mapped;
- `backing(tensor)`: the physical allocation behind an address that is already VMM-mapped
  (cuMemRetainAllocationHandle + cuMemGetAddressRange), with the address's offset inside it;
- `map_pieces(pieces, nbytes, device)`: reserve a virtual range, map each piece of physical memory
  into it (cuMemMap at an offset of the allocation), grant this device read/write (cuMemSetAccess),
  and return it as a 1-D uint8 tensor (through `__cuda_array_interface__`, no copy).

Mappings are made once at startup and never change, so kernels and CUDA graphs that use the
tensors see fixed addresses. Physical memory is freed when its last mapping goes: a handle is
released as soon as it is mapped, and a range is unmapped when its tensor is garbage-collected.

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
    """The smallest size and alignment of a mapping on `device` (2 MiB on Hopper).

    >>> granularity(torch.device("cuda", 0))  # doctest: +SKIP
    2097152
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
    """`nbytes` of `physical`, from byte `offset` of it, mapped at byte `at` of a virtual range."""

    at: int
    nbytes: int
    physical: Physical
    offset: int


def create(nbytes: int, device: torch.device) -> Physical:
    """New physical memory on `device` (`nbytes`, a multiple of `granularity`), not mapped anywhere yet.

    >>> slot = create(64 << 20, torch.device("cuda", 0))  # doctest: +SKIP
    """
    with _current(device):
        return Physical(_call("cuMemCreate", nbytes, _prop(device), 0), nbytes)


def backing(tensor: torch.Tensor) -> tuple[Physical, int]:
    """The physical allocation that `tensor`'s first byte lives in, and that byte's offset inside it.

    Fails (VmmError) unless the tensor's memory is VMM-mapped (torch symmetric memory, `allocate`)
    and all of it lies in that one allocation. The returned handle is retained: release() it.

    >>> physical, offset = backing(shards.buffer)  # doctest: +SKIP
    """
    ptr = tensor.data_ptr()
    with _current(tensor.device):
        handle = _call("cuMemRetainAllocationHandle", ptr)
        try:
            base, size = _call("cuMemGetAddressRange", ptr)
            base, size = int(base), int(size)
            nbytes = tensor.numel() * tensor.element_size()
            if ptr + nbytes > base + size:
                raise VmmError(f"the buffer ({nbytes} bytes) spans more than the one allocation ({size} bytes) "
                               "it starts in")
        except BaseException:
            _call("cuMemRelease", handle)
            raise
    return Physical(handle, size), ptr - base


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 tensor of `nbytes` on `device` in one VMM allocation (rounded up to the granularity).

    Memory that `backing()` can find, so that pieces of it can be mapped a second time elsewhere.
    It is not counted by torch.cuda.memory_allocated().

    >>> buffer = allocate(1 << 30, torch.device("cuda", 0))  # doctest: +SKIP
    """
    size = _round_up(max(nbytes, 1), granularity(device))
    physical = create(size, device)
    try:
        return map_pieces([Piece(0, size, physical, 0)], size, device)[:nbytes]
    finally:
        physical.release()  # the mapping keeps the memory alive


def map_pieces(pieces: Sequence[Piece], nbytes: int, device: torch.device) -> torch.Tensor:
    """Reserve `nbytes` of virtual addresses, map every piece into it, and return it as a uint8 tensor.

    Pieces must cover [0, nbytes) without overlap, with every `at`, `nbytes` and `offset` a multiple
    of the granularity. The handles are not released (the caller owns them); the range is unmapped
    and freed when the returned tensor (and every view of it) is gone.

    >>> view = map_pieces([Piece(0, 2 << 20, slot, 0), Piece(2 << 20, 2 << 20, shard, 8 << 20)],
    ...                   4 << 20, torch.device("cuda", 0))  # doctest: +SKIP
    """
    cu = _driver()
    with _current(device):
        va = int(_call("cuMemAddressReserve", nbytes, granularity(device), 0, 0))
        mapped: list[tuple[int, int]] = []
        try:
            for p in pieces:
                _call("cuMemMap", va + p.at, p.nbytes, p.offset, p.physical.handle, 0)
                mapped.append((va + p.at, p.nbytes))
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


def _prop(device: torch.device) -> Any:
    cu = _driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = _ordinal(device)
    return prop


def _round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment
