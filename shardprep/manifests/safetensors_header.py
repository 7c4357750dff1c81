"""Strict parsing of safetensors headers: the rules the safetensors library enforces, checked up front.

A header is type-checked before any value is used, and the file must be one the library accepts:
tensors cover the data region from its first byte to the file's last with no hole and no overlap,
metadata values are strings, every dtype is known. Errors are IntegrityError (code `invalid_safetensors`)
naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import IntegrityError
from .dtypes import DTYPE_SIZES, tensor_nbytes
from .exact_read import open_for_reading, read_exact
from .problems import quoted
from .strict_json import is_int, is_str_dict, parse_json

# The safetensors library's own limit on the header's length.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: [begin, end) relative to the start of the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, checked header: tensors in header order, the metadata, and where the data region starts."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    data_start: int
    file_size: int


def read_safetensors_header(path: str | Path, *, whole_file: bool = True) -> SafetensorsHeader:
    """Read and check a safetensors file's header (the data itself is not read).

    With `whole_file=False` the file may end anywhere after its header (a copy of a checkpoint's headers,
    without its data): the tensors are checked against each other, not against the file's size, and
    `file_size` is the size the header implies.

    >>> header = read_safetensors_header("model.safetensors")  # doctest: +SKIP
    >>> header.tensors["lm_head.weight"].dtype  # doctest: +SKIP
    """
    where = str(path)
    with open_for_reading(path, "safetensors file") as fd:
        size = os.fstat(fd).st_size
        if size < 8:
            raise _invalid(where, f"truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", read_exact(fd, 8, 0, where))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _invalid(where, f"corrupt or truncated safetensors header (claims {n} bytes, file has {size})")
        raw = read_exact(fd, n, 8, where)
    return parse_safetensors_header(raw, size if whole_file else None, where)


def parse_safetensors_header(raw: bytes, file_size: int | None, where: str) -> SafetensorsHeader:
    """Check the JSON header `raw` of a safetensors file of `file_size` bytes (see `read_safetensors_header`;
    None: a file of the size its header implies).

    >>> raw = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    >>> h = parse_safetensors_header(raw, 8 + len(raw) + 2, "x")
    >>> h.tensors["a"].nbytes, h.data_start
    (2, 61)
    >>> parse_safetensors_header(raw, None, "x").file_size
    63
    """
    try:
        header = parse_json(raw, where)
    except IntegrityError:
        raise _invalid(where, "corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise _invalid(where, "corrupt safetensors header (not a JSON object)")
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and not is_str_dict(metadata):
        raise _invalid(where, "safetensors __metadata__ must map strings to strings")
    data_start = 8 + len(raw)
    tensors: dict[str, TensorInfo] = {}
    for name, info in header.items():
        tensors[name] = _tensor_info(name, info, where)
    data_size = None if file_size is None else file_size - data_start
    # Before holes and overlaps: a tensor moved past the end leaves a hole that a neighbour would be blamed for.
    past = [] if data_size is None else [t for t in tensors.values() if t.end > data_size]
    if past and data_size is not None:
        t = min(past, key=lambda t: (t.begin, t.end))  # of a truncated file, the first tensor cut off
        raise _invalid(where, f"truncated file or corrupt header: tensor {quoted(t.name)} has data_offsets "
                       f"[{t.begin}, {t.end}) past the end of the file (its data region holds {max(data_size, 0)} "
                       "bytes)", tensor=t.name)
    at = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != at:
            gap = "overlaps the previous tensor" if t.begin < at else f"leaves a hole at [{at}, {t.begin})"
            raise _invalid(where, f"tensor {quoted(t.name)} {gap} (safetensors refuses holes and overlaps)",
                           tensor=t.name)
        at = t.end
    if file_size is None or data_size is None:
        return SafetensorsHeader(tensors, metadata, data_start, data_start + at)
    if at < data_size:
        raise _invalid(where, f"{data_size - at} bytes after the last tensor (safetensors refuses trailing bytes)")
    return SafetensorsHeader(tensors, metadata, data_start, file_size)


def _tensor_info(name: str, info: object, where: str) -> TensorInfo:
    if not isinstance(info, dict):
        raise _invalid(where, f"tensor {quoted(name)} has a malformed header entry", tensor=name)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        supported = ", ".join(sorted(DTYPE_SIZES))
        raise _invalid(where, f"tensor {quoted(name)} has unsupported dtype {quoted(dtype)} (supported: {supported})",
                       tensor=name)
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise _invalid(where, f"tensor {quoted(name)} has an invalid shape {quoted(shape)}", tensor=name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _invalid(where, f"tensor {quoted(name)} has invalid data_offsets {quoted(offsets)}", tensor=name)
    nbytes = tensor_nbytes(dtype, shape, tensor=name)
    begin, end = offsets
    if nbytes != end - begin:
        raise _invalid(where, f"tensor {quoted(name)} byte range [{begin}, {end}) does not match {dtype}{shape}",
                       tensor=name)
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _invalid(where: str, why: str, tensor: str | None = None) -> IntegrityError:
    return IntegrityError(f"{where}: {why}", code="invalid_safetensors", file=where, tensor=tensor)
