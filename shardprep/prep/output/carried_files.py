"""Files of an opened output taken over whole into a new one (reshard's replicated part, export's carried files).

Each file is hard-linked (or copied) on a thread pool while the caller writes the rest, then checked against the
manifest's checksum where it landed: what is checked is what the new directory publishes (a copy's bytes, a
link's inode).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from ...errors import IntegrityError
from ...manifests.checksums import file_digest
from ...manifests.manifest import FileRecord
from .opened_output import OpenedOutput
from .writeback import Writeback
from .writer import COPY_THREADS, CopyMode, link_or_copy

T = TypeVar("T")


def write_carrying(source: OpenedOutput, files: Iterable[FileRecord], directory: Path, mode: CopyMode,
                   write: Callable[[Writeback, Callable[[], None]], T]) -> tuple[T, dict[str, bool]]:
    """`write(writeback, check_carried)`'s result, and per file of `files` whether it was hard-linked: the files
    are carried into `directory` on a thread pool (`CarriedFiles`) while `write` writes the rest (reshard's
    rank files, export's target files), `check_carried()` raising as soon as one failed its check.

    >>> records, linked = write_carrying(source, files, staging, mode, lambda wb, check: ...)  # doctest: +SKIP
    """
    with Writeback() as writeback, ThreadPoolExecutor(COPY_THREADS) as pool:
        try:
            carried = CarriedFiles(pool, source, files, directory, mode, writeback)
            result = write(writeback, carried.check)
            linked = carried.linked()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        writeback.finish()
    return result, linked


class CarriedFiles:
    """Files of OUT hard-linked (or copied) into `directory` by `pool` (`_carry`, each checked where it lands)
    while the caller writes the rest (`write_carrying`).

    >>> carried = CarriedFiles(pool, open_output("out/", purpose="exported"), files, Path("staging/"), mode,
    ...                        wb)  # doctest: +SKIP
    """

    def __init__(self, pool: Executor, source: OpenedOutput, files: Iterable[FileRecord], directory: Path,
                 mode: CopyMode, writeback: Writeback):
        self._futures = {f.path: pool.submit(_carry, source, f, directory, mode, writeback) for f in files}

    def check(self) -> None:
        """Raise what a finished copy raised: a file that failed its check stops the run now, not at the end."""
        for done in self._futures.values():
            if done.done():
                done.result()

    def linked(self) -> dict[str, bool]:
        """Per file, whether it was hard-linked, once every copy is done (raises what one raised)."""
        return {path: done.result() for path, done in self._futures.items()}


def _carry(source: OpenedOutput, record: FileRecord, directory: Path, mode: CopyMode, writeback: Writeback) -> bool:
    """Hard-link (or copy) one file of OUT into `directory`, then check the bytes it now holds there."""
    src, dest = source.root / record.path, directory / record.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    linked = link_or_copy(src, dest, mode.value)
    # Checked where it landed, so what is checked is what the new directory publishes (a copy's bytes, a link's inode).
    size, got = file_digest(dest)
    if size != record.size or got != record.xxh3_128:
        raise IntegrityError(f"{src}: {size} bytes with checksum {got}, the manifest says {record.size} bytes with "
                             f"{record.xxh3_128} (file corrupt or modified); copy it again", code="checksum_mismatch",
                             file=record.path)
    if not linked:
        writeback.start(dest, 0, size)
    return linked
