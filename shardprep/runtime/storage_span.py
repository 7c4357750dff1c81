"""A tensor's storage span: the elements from its first to its last, as its strides lay them out.

A server may leave a processed weight strided: vLLM's DeepGEMM path on SM100 keeps a block-FP8 scale as packed
UE8M0 int32 `[N, ⌈K/512⌉]` with strides `(1, align(N, 4))`, and DeepGEMM asserts those strides at every GEMM. Such
a tensor is packed by its span (the bytes from its storage offset to its last element, gaps included) and rebound
with `as_strided` over the gathered copy of that span, with the same shape, strides and dtype, so that a kernel
reads exactly what it read before. The strides are kept even when `is_contiguous()` says True: torch ignores the
stride of a size-1 dimension there (`[N, 1]` with strides `(1, align(N, 4))`), the kernel does not.

A layout whose elements overlap (a zero or negative stride over more than one element, or strides that interleave)
cannot be rebuilt from a span: `stride_problem` says why, and callers refuse it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def span_elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    """How many elements lie from a tensor's first element to its last (1 + Σ (size − 1)·stride; 0 if empty).

    >>> span_elements((6, 2), (1, 8))  # DeepGEMM's packed scale of N = 6: columns 8 apart
    14
    >>> span_elements((6, 1), (1, 8))
    6
    """
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride))


def row_major(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, as `torch.empty(shape).stride()` gives them.

    >>> row_major((3, 4, 5))
    (20, 5, 1)
    """
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def stride_problem(shape: Sequence[int], stride: Sequence[int]) -> str | None:
    """Why a tensor of `shape` and `stride` cannot be packed by its span and rebound (None: it can).

    >>> stride_problem((4, 3), (1, 4)) is None
    True
    >>> stride_problem((4, 3), (0, 1))
    'its elements overlap (stride 0 over 4 elements)'
    """
    negative = next((step for step in stride if step < 0), None)
    if negative is not None:
        return f"a negative stride ({negative})"
    dims = sorted((step, size) for size, step in zip(shape, stride) if size > 1)
    reach = 1  # elements spanned by the dimensions of smaller stride
    for step, size in dims:
        if step < reach:
            return f"its elements overlap (stride {step} over {size} elements)"
        reach = step * (size - 1) + reach
    return None


def span_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s span as flat bytes: a view of its storage from its storage offset to its last element (no copy), or,
    where the span has gaps (elements no index reaches), a copy with the gaps zeroed: their bytes are whatever the
    allocator left there (DeepGEMM's `align(N, 4)` padding rows), which differ from rank to rank.

    >>> base = torch.arange(8, dtype=torch.int32)
    >>> span_bytes(base.as_strided((2, 2), (1, 2), 1)).view(torch.int32).tolist()  # elements 1..4
    [1, 2, 3, 4]
    >>> span_bytes(base.as_strided((2, 2), (1, 4), 1)).view(torch.int32).tolist()  # 1, 2, then 5, 6
    [1, 2, 0, 0, 5, 6]
    """
    elements = span_elements(t.shape, t.stride())
    if elements == t.numel():
        return t.detach().as_strided((elements,), (1,), t.storage_offset()).view(torch.uint8)
    flat = torch.zeros(elements, dtype=t.dtype, device=t.device)
    flat.as_strided(t.shape, t.stride()).copy_(t.detach())
    return flat.view(torch.uint8)


def rebind(flat: torch.Tensor, shape: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """`flat`, a 1-D tensor holding a span in the tensor's dtype, seen with `shape` and `stride` again (no copy).

    >>> packed = torch.arange(8, dtype=torch.int32).as_strided((3, 2), (1, 4))
    >>> again = rebind(span_bytes(packed).view(torch.int32), packed.shape, packed.stride())
    >>> again.stride(), torch.equal(again, packed)
    ((1, 4), True)
    """
    return flat.as_strided(tuple(shape), tuple(stride), flat.storage_offset())
