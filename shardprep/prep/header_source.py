"""A checkpoint read from its headers alone: what `plan` and `convert --dry-run` need, without its weights.

A local directory is read as `open_source` reads it (headers only, as always). A hub repo id is not
downloaded: config.json and the index are fetched whole (each within its size cap) and each safetensors file's
header by HTTP range requests on the file's hub URL, as huggingface_hub's `get_safetensors_metadata` reads them
(the first 100 kB, then the rest of a longer header), all through `hub/http.py`'s bounded reads. The rare
tensor bytes a plan reads (a block-FP8 checkpoint's scales, to tell whether they are powers of two already)
are fetched the same way, by range. The checkpoint counts what it fetched (`fetched_bytes`). Nothing is
written to the HF cache.

The hub is untrusted input: the index's shard names are checked before any is fetched, config.json's figures
before any arithmetic, and the first failed fetch stops the others (docs/reliability.md, "A hostile hub").
Offline (HF_HUB_OFFLINE=1), or when the hub cannot be reached, a complete copy in the local HF cache is read
instead; without one, that is one line at once.

A checkpoint opened here has no data on disk: only a real `convert` downloads the weights.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from ..errors import HubError, IntegrityError, SourceError
from ..manifests.safetensors_header import MAX_HEADER_BYTES, SafetensorsHeader, parse_safetensors_header
from .hub.cache import cached_snapshot
from .hub.http import COMMIT, HubReader
from .hub.repo_id import hub_repo_id
from .source import (
    INDEX_NAME,
    MAX_CONFIG_BYTES,
    MAX_INDEX_BYTES,
    SINGLE_NAME,
    SourceCheckpoint,
    check_shard_names,
    open_source,
    parse_config,
    parse_source_index,
    read_source_index,
    tensors_of,
)

FIRST_RANGE_BYTES = 100_000
"""The first read of a header: huggingface_hub's choice (97% of the hub's headers fit in it), one request per file."""
PARALLEL_FETCHES = 8
T = TypeVar("T")


def open_headers(src: str | Path, revision: str | None = None) -> SourceCheckpoint:
    """The checkpoint at `src` from its headers alone: a local directory as `open_source` reads it, a hub repo
    id by bounded HTTP range requests, with no snapshot download.

    >>> ckpt = open_headers("deepseek-ai/DeepSeek-V3")  # doctest: +SKIP
    >>> ckpt.fetched_bytes()  # doctest: +SKIP
    """
    repo_id = hub_repo_id(src)
    if repo_id is None:
        return open_source(src, revision)
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        cached = _cached_checkpoint(repo_id, revision)
        if cached is None:
            at = f" at revision {revision!r}" if revision else ""
            raise HubError(f"{repo_id}: HF_HUB_OFFLINE is set and the local HF cache holds no complete copy of "
                           f"it{at}; unset HF_HUB_OFFLINE to read its headers from the hub, or download it first",
                           reason="offline")
        return cached
    reader = HubReader(repo_id)
    try:
        return open_hub_headers(reader, revision)
    except HubError as exc:
        if exc.reason not in ("dns", "unreachable"):
            raise
        # No network, as hf_hub_download would: a complete copy in the cache serves instead.
        cached = _cached_checkpoint(repo_id, revision)
        if cached is None:
            raise
        return cached
    finally:
        reader.close()


def open_hub_headers(reader: HubReader, revision: str | None) -> SourceCheckpoint:
    """The checkpoint of `reader`'s repo at `revision` from its headers alone, read by HTTP range at one commit
    (the checkpoint's `commit`).

    >>> ckpt = open_hub_headers(HubReader("deepseek-ai/DeepSeek-V3"), None)  # doctest: +SKIP
    """
    repo_id = reader.repo_id
    config = reader.fetch("config.json", revision, cap=MAX_CONFIG_BYTES)
    # Every later read asks for the commit this one resolved the revision to, so that all come from one commit.
    index = reader.fetch(INDEX_NAME, config.commit if config and config.commit else revision, cap=MAX_INDEX_BYTES)
    if config is None and index is None:
        at = f" at revision {revision!r}" if revision else ""
        raise SourceError(f"{repo_id}: no config.json and no {INDEX_NAME} on the hub{at}; is it a model repository?")
    commit = next((b.commit for b in (config, index) if b is not None and b.commit), None)
    if commit is None or not COMMIT.fullmatch(commit):
        raise HubError(f"{repo_id}: the hub's answer names no commit (X-Repo-Commit"
                       f"{'' if commit is None else ' is not a commit id'}), so its files cannot be read at one "
                       f"commit: is HF_ENDPOINT ({reader.endpoint}) a Hugging Face hub?", reason="not_a_hub")
    config_data = parse_config(config.data, f"{repo_id}/config.json") if config is not None else None
    where = f"{repo_id}/{INDEX_NAME}"
    weight_map, metadata = parse_source_index(index.data, where) if index is not None else (None, {})
    names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_NAME]
    check_shard_names(names, where)  # before a single shard is asked for
    fetcher = _Fetcher(reader, commit, has_index=index is not None)
    headers = _all_or_first_failure(fetcher.header, names)
    root = Path(repo_id)  # no directory: where messages say the files are
    files, tensors = tensors_of(root, names, headers.__getitem__, weight_map)
    return SourceCheckpoint(root, files, tensors, [], repo_id, revision, commit, metadata,
                            read_range=fetcher.tensor_bytes, fetched_bytes=lambda: reader.fetched_bytes,
                            remote_config=config_data)


def _all_or_first_failure(fetch: Callable[[str], T], names: list[str]) -> dict[str, T]:
    """`fetch` of every name, PARALLEL_FETCHES at a time; the first failure cancels every fetch not yet started
    (a hub that fails each one must not be asked 163 times, a timeout at a time), then is raised."""
    failed = threading.Event()

    def fetch_unless_failed(name: str) -> T:
        if failed.is_set():  # a worker freed by a failure takes no new name before the cancel below
            raise _Skipped(name)
        try:
            return fetch(name)
        except BaseException:
            failed.set()
            raise

    pool = ThreadPoolExecutor(PARALLEL_FETCHES)
    futures = []
    try:
        futures = [pool.submit(fetch_unless_failed, name) for name in names]
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after it, every future not cancelled is done
    for future in futures:
        error = None if future.cancelled() else future.exception()
        if error is not None and not isinstance(error, _Skipped):
            raise error
    return {name: future.result() for name, future in zip(names, futures)}


class _Skipped(Exception):
    """A fetch not started, because another one had failed."""


class _Fetcher:
    """Range reads of one repo's files at one commit."""

    def __init__(self, reader: HubReader, commit: str, *, has_index: bool) -> None:
        self.reader, self.commit, self.has_index = reader, commit, has_index

    def read(self, name: str, start: int, nbytes: int) -> tuple[bytes, int | None]:
        """`nbytes` from `start` of file `name` (fewer at its end), and the file's size where the hub says it."""
        body = self.reader.fetch(name, self.commit, first=start, nbytes=nbytes)
        if body is None:
            repo = self.reader.repo_id
            if self.has_index:
                raise SourceError(f"{repo}/{INDEX_NAME}: names shard {name!r}, which the hub does not have")
            raise SourceError(f"{repo}: no {INDEX_NAME} and no {SINGLE_NAME} on the hub")
        return body.data, body.size

    def tensor_bytes(self, name: str, start: int, nbytes: int) -> bytes:
        data, _ = self.read(name, start, nbytes)
        if len(data) != nbytes:
            raise SourceError(f"{self.reader.repo_id}/{name}: {len(data)} bytes at {start} from the hub, expected "
                              f"{nbytes}")
        return data

    def header(self, name: str) -> SafetensorsHeader:
        where = f"{self.reader.repo_id}/{name}"
        first, size = self.read(name, 0, FIRST_RANGE_BYTES)
        if len(first) < 8 or size is None:
            raise SourceError(f"{where}: truncated safetensors file, or the hub gave no size for it")
        (n,) = struct.unpack("<Q", first[:8])
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SourceError(f"{where}: corrupt or truncated safetensors header (claims {n} bytes, file has {size})")
        raw = first[8:8 + n]
        if len(raw) < n:
            raw += self.tensor_bytes(name, 8 + len(raw), n - len(raw))
        try:
            return parse_safetensors_header(raw, size, where)
        except IntegrityError as exc:
            raise SourceError(str(exc)) from None


def _cached_checkpoint(repo_id: str, revision: str | None) -> SourceCheckpoint | None:
    """The repo's snapshot in the local HF cache, read as a local directory, when it holds every file the
    headers come from; None otherwise (a cache holding config.json alone cannot answer for the shards)."""
    snapshot = cached_snapshot(repo_id, revision, ("config.json", INDEX_NAME, SINGLE_NAME))
    if snapshot is None:
        return None
    if (snapshot / INDEX_NAME).is_file():
        names = sorted(set(read_source_index(snapshot / INDEX_NAME)[0].values()))
        check_shard_names(names, str(snapshot / INDEX_NAME))
    else:
        names = [SINGLE_NAME]
    if not all((snapshot / name).is_file() for name in names):
        return None
    return replace(open_source(snapshot), repo_id=repo_id, revision=revision, commit=snapshot.name)
