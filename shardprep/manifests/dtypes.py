"""Safetensors dtype strings: their sizes and their torch dtypes. The only dtype table in shardprep.

torch is imported inside `torch_dtype` alone, so the format package stays importable without torch.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from ..errors import RuntimeShardError, SourceError

if TYPE_CHECKING:
    import torch

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

# safetensors dtype string → name of the torch dtype attribute. Older torch builds lack some of them.
TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
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


@cache
def torch_dtype(dtype: str, *, tensor: str = "?") -> torch.dtype:
    """The torch dtype of a safetensors dtype string (imports torch).

    >>> torch_dtype("BF16")
    torch.bfloat16
    """
    import torch

    attr = TORCH_NAMES.get(dtype)
    if attr is None or not hasattr(torch, attr):
        raise RuntimeShardError(
            f"tensor {tensor!r} has dtype {dtype!r}, which this torch {torch.__version__} cannot represent; "
            "upgrade torch"
        )
    result: torch.dtype = getattr(torch, attr)
    return result


def safetensors_dtype(dtype: torch.dtype, *, tensor: str = "?") -> str:
    """The safetensors dtype string of a torch dtype (the inverse of `torch_dtype`).

    >>> import torch
    >>> safetensors_dtype(torch.float8_e4m3fn)
    'F8_E4M3'
    """
    name = str(dtype).removeprefix("torch.")
    for key, attr in TORCH_NAMES.items():
        if attr == name:
            return key
    raise RuntimeShardError(f"tensor {tensor!r} has dtype {dtype}, which safetensors cannot store")
