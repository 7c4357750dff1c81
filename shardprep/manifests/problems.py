"""What `validate` reports: one problem, with a stable code and where it is. Pure data.

The codes are stable snake_case strings, listed in docs/reliability.md; tools may match on them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import IntegrityError, ManifestError

# Names read from hostile files can be megabytes long; a message stays one readable line.
MAX_NAME_CHARS = 120


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an output directory: `code` (stable), a one-line `message`, and where.

    >>> Problem("checksum_mismatch", "shards/rank-00001-of-00002.safetensors: layer 3 chunk checksum mismatch",
    ...         file="shards/rank-00001-of-00002.safetensors", layer=3).code
    'checksum_mismatch'
    """

    code: str
    message: str
    file: str | None = None
    layer: int | None = None
    tensor: str | None = None

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, exc: IntegrityError | ManifestError) -> Problem:
        """The problem a reader's exception describes."""
        if isinstance(exc, IntegrityError):
            return cls(exc.code, str(exc), exc.file, exc.layer, exc.tensor)
        return cls(exc.code, str(exc))

    def error(self) -> IntegrityError:
        """This problem as the exception a loader raises."""
        return IntegrityError(self.message, code=self.code, file=self.file, layer=self.layer, tensor=self.tensor)


def quoted(name: object) -> str:
    """`repr(name)`, cut to a readable length (a name read from a hostile file can be any size).

    >>> quoted("layer.1"), len(quoted("x" * 10_000)) < 200
    ("'layer.1'", True)
    """
    text = repr(name)
    if len(text) <= MAX_NAME_CHARS:
        return text
    return f"{text[:MAX_NAME_CHARS]}…({len(text)} chars)"
