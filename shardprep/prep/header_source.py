"""A checkpoint read from its headers alone: what `plan` and `convert --dry-run` need, without its weights.

A local directory is read as `open_source` reads it (headers only, as always). A hub repo id is not
downloaded: config.json and the index come through huggingface_hub's cache (`hf_hub_download`, kilobytes),
and each safetensors file's header through HTTP range requests on the file's hub URL, as huggingface_hub's
`get_safetensors_metadata` reads them (the first 100 kB, then the rest of a longer header). The rare
tensor bytes a plan reads (a block-FP8 checkpoint's scales, to tell whether they are powers of two
already) are fetched the same way, by range. The checkpoint counts what it fetched (`fetched_bytes`).

A checkpoint opened here has no data on disk: only a real `convert` downloads the weights.
"""

from __future__ import annotations

import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import IntegrityError, SourceError
from ..manifests.safetensors_header import MAX_HEADER_BYTES, SafetensorsHeader, parse_safetensors_header
from .source import INDEX_NAME, REPO_ID, SINGLE_NAME, SourceCheckpoint, open_source, read_source_index, tensors_of

FIRST_RANGE_BYTES = 100_000
"""The first read of a header: huggingface_hub's choice (97% of the hub's headers fit in it), one request per file."""
PARALLEL_FETCHES = 8


def open_headers(src: str | Path, revision: str | None = None) -> SourceCheckpoint:
    """The checkpoint at `src` from its headers alone: a local directory as `open_source` reads it, a hub repo
    id by HTTP range requests, with no snapshot download.

    >>> ckpt = open_headers("deepseek-ai/DeepSeek-V3")  # doctest: +SKIP
    >>> ckpt.fetched_bytes()  # doctest: +SKIP
    """
    text = str(src)
    if Path(src).exists() or "\x00" in text or not REPO_ID.match(text) or text.startswith((".", "/")):
        return open_source(src, revision)
    return _open_hub_headers(text, revision)


class _Fetcher:
    """Range reads of one repo's files at one commit, counted."""

    def __init__(self, repo_id: str, commit: str) -> None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        self.repo_id, self.commit = repo_id, commit
        self._url = lambda name: hf_hub_url(repo_id, name, revision=commit)
        self._headers = build_hf_headers()
        self._lock = threading.Lock()
        self.bytes = 0

    def count(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def read(self, name: str, start: int, nbytes: int) -> tuple[bytes, int | None]:
        """`nbytes` from `start` of file `name` (fewer at its end), and the file's size from Content-Range."""
        from huggingface_hub import get_session
        from huggingface_hub.utils import hf_raise_for_status

        try:
            response = get_session().get(self._url(name), headers={
                **self._headers, "Range": f"bytes={start}-{start + nbytes - 1}"}, follow_redirects=True)
            hf_raise_for_status(response)
        except Exception as exc:  # httpx's and huggingface_hub's errors: one line naming the file
            raise SourceError(f"{self.repo_id}/{name}: cannot read from the hub: {str(exc).splitlines()[0]}") from None
        data = response.content
        self.count(len(data))
        if response.status_code != 206 and start:
            raise SourceError(f"{self.repo_id}/{name}: the hub answered a range request with the whole file")
        total = response.headers.get("Content-Range", "").rpartition("/")[2]
        size = int(total) if total.isdigit() else (len(data) if response.status_code == 200 else None)
        return data[:nbytes], size

    def tensor_bytes(self, name: str, start: int, nbytes: int) -> bytes:
        data, _ = self.read(name, start, nbytes)
        if len(data) != nbytes:
            raise SourceError(f"{self.repo_id}/{name}: {len(data)} bytes at {start} from the hub, expected {nbytes}")
        return data

    def header(self, name: str) -> SafetensorsHeader:
        where = f"{self.repo_id}/{name}"
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


def _download(repo_id: str, name: str, revision: str | None) -> Path | None:
    """One small file through huggingface_hub's cache; None when the repo has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import HfHubHTTPError

    try:
        return Path(hf_hub_download(repo_id, name, revision=revision))
    except LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: offline, not absent
        raise SourceError(f"{repo_id}: not in the local HF cache and the hub cannot be reached "
                          "(HF_HUB_OFFLINE is set or no network); download it first") from None
    except EntryNotFoundError:
        return None
    except RepositoryNotFoundError:
        raise SourceError(f"{repo_id}: no such repository on the hub (or it is private)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise SourceError(f"{repo_id}: cannot fetch {name} from the hub: {str(exc).splitlines()[0]}") from None


def _open_hub_headers(repo_id: str, revision: str | None) -> SourceCheckpoint:
    config = _download(repo_id, "config.json", revision)
    index = _download(repo_id, INDEX_NAME, revision)
    if config is None and index is None:
        raise SourceError(f"{repo_id}: no config.json and no {INDEX_NAME} on the hub")
    # The cache lays a snapshot out as snapshots/<commit>/: the commit the revision resolved to, which every
    # later range read asks for, so that all the headers come from one commit.
    root = (config or index).parent  # type: ignore[union-attr]
    fetcher = _Fetcher(repo_id, root.name)
    fetcher.count(sum(p.stat().st_size for p in (config, index) if p is not None))
    weight_map, metadata = read_source_index(index) if index is not None else (None, {})
    names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_NAME]
    with ThreadPoolExecutor(PARALLEL_FETCHES) as pool:
        headers = dict(zip(names, pool.map(fetcher.header, names)))
    files, tensors = tensors_of(root, names, headers.__getitem__, weight_map)
    return SourceCheckpoint(root, files, tensors, [], repo_id, revision, root.name, metadata,
                            read_range=fetcher.tensor_bytes, fetched_bytes=lambda: fetcher.bytes)
