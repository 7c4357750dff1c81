"""A local HTTP server standing in for the hub: `resolve` URLs with HEAD, GET and Range, and a count of the bytes sent.

Point huggingface_hub at it with HF_ENDPOINT. It serves each repo from a local directory at one commit, answers
what `hf_hub_download` asks (X-Repo-Commit, ETag, Content-Length) and range requests with 206 and Content-Range,
and refuses to send a whole file of more than WHOLE_FILE_LIMIT bytes, so a client that downloads weights fails at
once instead of streaming gigabytes of holes.
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

WHOLE_FILE_LIMIT = 16 << 20
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class FakeHub:
    """Serves `repos` ({repo_id: directory}) at `commit`; `sent_bytes` counts the body bytes sent, `requests`
    the paths asked for."""

    def __init__(self, repos: dict[str, Path], commit: str = "0123456789abcdef0123456789abcdef01234567") -> None:
        self.repos, self.commit = repos, commit
        self.sent_bytes = 0
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        rng = h.headers.get("Range")
        with self._lock:
            self.requests.append((h.command, h.path, rng))
        m = _RESOLVE.match(unquote(h.path.split("?")[0]))
        repo = self.repos.get(m["repo"]) if m else None
        if m is None or repo is None:
            return self._error(h, 404, "RepoNotFound")
        if m["rev"] not in ("main", self.commit):
            return self._error(h, 404, "RevisionNotFound")
        path = repo / m["file"]
        if not path.is_file():
            return self._error(h, 404, "EntryNotFound")
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        r = _RANGE.match(rng or "")
        if r:
            start, end, status = int(r[1]), min(int(r[2] or size - 1), size - 1), 206
        elif body and size > WHOLE_FILE_LIMIT:
            return self._error(h, 416, "WholeFileRefused")
        h.send_response(status)
        h.send_header("X-Repo-Commit", self.commit)
        h.send_header("ETag", f'"{m["file"]}-{size}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.end_headers()
        if body:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(end - start + 1)
            with self._lock:
                self.sent_bytes += len(data)
            h.wfile.write(data)

    def _error(self, h: BaseHTTPRequestHandler, code: int, error: str) -> None:
        h.send_response(code)
        h.send_header("X-Error-Code", error)
        h.send_header("Content-Length", "0")
        h.end_headers()
