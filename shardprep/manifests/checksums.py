"""The format's checksum: XXH3-128 with seed 0, written as 32 lowercase hex digits (most significant first).

Chunks are hashed from memory; whole files are hashed in blocks read exactly, so a file of any size
costs one block of memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .exact_read import BLOCK_BYTES, iter_blocks, open_for_reading

HASH_SEED = 0


def digest(data: Any) -> str:
    """XXH3-128 (seed 0) of a bytes-like object, as 32 hex digits.

    >>> digest(b"")
    '99aa06d3014798d86001c324468d497f'
    """
    import xxhash  # only hashing needs it; loading without verification depends on torch alone

    return xxhash.xxh3_128_hexdigest(data, seed=HASH_SEED)


def joined_digest(parts: Iterable[Any]) -> str:
    """`digest` of the bytes-like `parts` joined, without joining them (a manifest is megabytes).

    >>> joined_digest([b"ab", memoryview(b"cd")]) == digest(b"abcd")
    True
    """
    hasher = file_hasher()
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def file_hasher() -> Any:
    """A streaming XXH3-128 (seed 0): `update(bytes-like)` in order, then `hexdigest()`, as `digest` gives.

    >>> h = file_hasher(); h.update(b"ab"); h.update(b"cd"); h.hexdigest() == digest(b"abcd")
    True
    """
    import xxhash

    return xxhash.xxh3_128(seed=HASH_SEED)


def file_digest(path: str | Path, block: int = BLOCK_BYTES) -> tuple[int, str]:
    """(size, XXH3-128 hex digest) of a whole file, read in exact blocks.

    >>> file_digest("out/config.json")  # doctest: +SKIP
    """
    hasher = file_hasher()
    with open_for_reading(path) as fd:
        size = os.fstat(fd).st_size
        for _, piece in iter_blocks(fd, 0, size, path, block):
            hasher.update(piece)
    return size, hasher.hexdigest()
