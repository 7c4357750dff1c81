"""The last few manifests read, by path, each with the exact bytes it was parsed from, and the collector paused
while one is parsed: what makes reading one manifest several times at startup cost a compare instead of a parse.
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class RecentReads(Generic[T]):
    """The last few manifests read, by (path, check), each with the exact bytes it was parsed from.

    Parsing is a pure function of the bytes: a file read again whose bytes are the same, compared in
    full, gives the same manifest without parsing and validating it again (a few ms instead of 40-120 for
    10,000 entries; a loader, vLLM's create_model then load_sharded, and validate each read it once). Any
    other byte, an edit or damage, is a miss, parsed and checked as ever. Each caller gets its own copy
    of the manifest's dicts (`own_copy`); everything else in a Manifest is immutable.
    """

    SIZE = 4

    def __init__(self, own_copy: Callable[[T], T]) -> None:
        self._own_copy = own_copy
        self._items: OrderedDict[tuple[str, bool], tuple[bytes, T]] = OrderedDict()
        self._lock = threading.Lock()  # ranks of one process may open their files from several threads

    def get(self, key: tuple[str, bool], raw: bytes) -> T | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0] != raw:
                return None
            self._items.move_to_end(key)
        return self._own_copy(item[1])

    def put(self, key: tuple[str, bool], raw: bytes, result: T) -> None:
        with self._lock:
            self._items[key] = (raw, result)
            self._items.move_to_end(key)
            while len(self._items) > self.SIZE:
                self._items.popitem(last=False)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a manifest is parsed and built.

    A 10,000-entry manifest allocates some 200,000 containers, none in a cycle, and every 700 of them set
    off a collection that walks the young ones again (`bench_manifest.py --fused-experts`, 3.4 MB: a later
    call took 64 ms with the collector on, 58 ms paused; docs/benchmarks.md).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
