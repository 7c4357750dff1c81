"""Damaging an output on purpose, for the tests that prove a damaged output is refused (one place for every suite:
the main one, vLLM's and SGLang's engine tests).

>>> flip_byte(out / manifest.rank_files[1], record.file_offset + 7)  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path, at: int) -> None:
    """Flip one bit (0x40) of the byte at offset `at` of `path`, in place: the size stays, the digest does not."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x40]))
