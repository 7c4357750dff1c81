"""The manifest's checksum of itself (format version 2): `manifest_xxh3_128` is the XXH3-128 of the file's own
text with those 32 hex digits written as zeros, so every byte of the output is covered, the manifest included.
"""

from __future__ import annotations

import json  # noqa: F401  (the doctest's)
import re
from typing import Any

from .checksums import joined_digest

# The manifest's checksum of itself, and its value while the text is being hashed.
SELF_DIGEST_KEY = "manifest_xxh3_128"
UNSEALED = "0" * 32


def seal(text: str) -> str:
    """Put the manifest's own checksum into its text: XXH3-128 of the text with the digest's 32 hex digits
    as zeros, written in their place. Every byte of the file is then covered, the manifest included.

    >>> sealed = seal('{"a": 1, "manifest_xxh3_128": "' + UNSEALED + '"}')
    >>> check_seal(sealed.encode(), json.loads(sealed)) is None
    True
    """
    raw = text.encode()
    spans = _seal_spans(raw)
    if len(spans) != 1:
        raise ValueError(f"a manifest text must hold one {SELF_DIGEST_KEY}, found {len(spans)}")
    a, b = spans[0]
    return (raw[:a] + _self_digest(raw, a, b).encode() + raw[b:]).decode()


def check_seal(raw: bytes, data: Any) -> str | None:
    """Why the manifest file `raw` (parsed: `data`) fails its own checksum, or None when it holds."""
    want = data.get(SELF_DIGEST_KEY) if isinstance(data, dict) else None
    spans = _seal_spans(raw)
    if len(spans) != 1 or not isinstance(want, str):
        return f"the file must hold exactly one {SELF_DIGEST_KEY} (found {len(spans)})"
    a, b = spans[0]
    got = _self_digest(raw, a, b)
    if raw[a:b].decode() != want or got != want:
        return (f"{SELF_DIGEST_KEY} is {raw[a:b].decode()} but the file's checksum is {got} (the manifest was "
                "modified or damaged; re-run convert)")
    return None


def _self_digest(raw: bytes, a: int, b: int) -> str:
    # The checksum of the text with its own digest, at raw[a:b], written as zeros.
    view = memoryview(raw)
    return joined_digest((view[:a], UNSEALED.encode(), view[b:]))


def _seal_spans(raw: bytes) -> list[tuple[int, int]]:
    return [m.span(1) for m in _SEAL.finditer(raw)]


_SEAL = re.compile(rb'"manifest_xxh3_128"\s*:\s*"([0-9a-f]{32})"')
