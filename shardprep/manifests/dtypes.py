"""Safetensors dtype strings and their sizes; the only dtype table in shardprep."""

from __future__ import annotations

from ..errors import SourceError

# Element sizes in bytes, keyed by the dtype strings that safetensors writes in its headers.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def dtype_size(dtype: str, *, tensor: str = "?") -> int:
    """Bytes per element of a safetensors dtype string.

    >>> dtype_size("BF16")
    2
    """
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        supported = ", ".join(sorted(DTYPE_SIZES))
        raise SourceError(f"tensor {tensor!r} has unsupported dtype {dtype!r} (supported: {supported})") from None


def tensor_nbytes(dtype: str, shape: tuple[int, ...] | list[int], *, tensor: str = "?") -> int:
    """Bytes a dense tensor of this dtype and shape occupies.

    >>> tensor_nbytes("F32", (2, 3))
    24
    """
    n = dtype_size(dtype, tensor=tensor)
    for d in shape:
        n *= d
    return n
