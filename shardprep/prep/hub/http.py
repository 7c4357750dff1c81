"""Bounded reads of a hub repo's files over HTTP: each request ends in time, reads no more than it asked for, and
fails as one HubError whose line says what happened.

`plan` and `convert --dry-run` on a hub id read config.json, the index and each safetensors header by HTTP range
(`prep/header_source.py`). Whatever answers at HF_ENDPOINT is untrusted here: a mirror, a proxy or a captive portal may
ignore `Range` and send a whole shard, compress a body into a bomb, stall, trickle a byte a second, never end a
chunked body, loop on redirects, or answer 401, 403, 429 or 5xx for reasons of its own. The bounds:

- Time: every request, from connecting to its last byte (redirects included), ends within `timeout_s`
  (SHARDPREP_HUB_TIMEOUT, default 30 s). A watchdog shuts the socket down at that deadline, so neither a
  stall nor a trickle (a byte now and then, which no per-read timeout catches) outlives it.
- Bytes: a range request takes back at most the range it asked for, or a whole small file. A 206 whose
  Content-Range is not that range is refused from its headers alone, before a byte of its body is read. A 200
  (the server ignored `Range`) is the whole file: taken, and the range cut from it, when the file is no longer
  than WHOLE_ANSWER_BYTES (or the range), refused unread beyond it. A body without a length is read up to
  one byte past its bound. A whole
  file (config.json, the index) is refused unread when its Content-Length is over its cap, and the read stops
  one byte past the cap otherwise. Bodies are asked for unencoded (`Accept-Encoding: identity`) and never
  decoded: a compressed answer is refused unread.
- Retries: at most RETRIES more tries, and only where trying again can help (a 5xx, a 429, a body cut short);
  a Retry-After longer than the timeout ends the command instead of waiting.
- Redirects: at most MAX_REDIRECTS, to http(s) only; the token goes to the first URL's origin alone, never
  to another host (the hub sends its files from a CDN).

[Note: why not huggingface_hub's HTTP session] Its session (requests before 1.0, httpx since, httpx2 from 2.0)
has no timeout here, decompresses transparently, retries five times and waits as long as any Retry-After asks,
and `response.content` reads a body whole before its size can be checked. So these reads go through
`http.client`, which does none of that on its own. huggingface_hub still builds the URLs (HF_ENDPOINT) and the
headers (the token: HF_TOKEN or `hf auth login`'s), and says whether the hub is offline (HF_HUB_OFFLINE).
Proxies are honoured as urllib reads them (HTTPS_PROXY, HTTP_PROXY, NO_PROXY; http:// proxies only).
"""

from __future__ import annotations

import base64
import http.client
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from ...errors import HubError, SourceError

TIMEOUT_ENV = "SHARDPREP_HUB_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 86_400.0
RETRIES = 2
"""Tries after the first, for answers that another try can mend (5xx, 429, a body cut short)."""
BACKOFF_S = (1.0, 2.0)
MAX_REDIRECTS = 10
READ_CHUNK = 64 << 10
REDIRECT_BODY_BYTES = 64 << 10
DOWNLOAD_MIN_BYTES_PER_S = 1 << 20
"""A whole shard's download may take the timeout plus its size at this rate: a stall or a trickle still ends."""
WHOLE_ANSWER_BYTES = 1 << 20
"""A range read answered with the whole file (200: the server ignores Range) takes it when the file is no longer
than this (or than the range): ten times a header's first read, so a small file served by a plain HTTP server
is read, and a shard is not."""
"""A redirect's body is read (so that its connection can be used again) only up to this."""
COMMIT = re.compile(r"[0-9a-f]{40}")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_REDIRECTS = (301, 302, 303, 307, 308)


def hub_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds one request to the hub may take, connecting included: SHARDPREP_HUB_TIMEOUT, 30 when unset.

    >>> hub_timeout({}), hub_timeout({"SHARDPREP_HUB_TIMEOUT": "120"})
    (30.0, 120.0)
    >>> hub_timeout({"SHARDPREP_HUB_TIMEOUT": "0"})
    Traceback (most recent call last):
    ...
    shardprep.errors.SourceError: SHARDPREP_HUB_TIMEOUT='0': must be a number of seconds above 0, at most 86400
    """
    text = environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN fails this too
        raise SourceError(f"{TIMEOUT_ENV}={text!r}: must be a number of seconds above 0, at most {MAX_TIMEOUT_S:g}")
    return value


@dataclass(frozen=True)
class HubBody:
    """What one read returned: the bytes, the whole file's size where the answer says it, and the commit the
    revision resolved to (the hub's X-Repo-Commit), where the answer carries it."""

    data: bytes
    size: int | None
    commit: str | None
    next_page: str | None = None
    """The URL of the API answer's next page (its `Link: <…>; rel="next"`), for a list the hub pages."""


class _Retry(Exception):
    """An answer that another try may mend; `wait_s` is how long the server asked to be left alone."""

    def __init__(self, message: str, reason: str, wait_s: float | None = None):
        super().__init__(message)
        self.reason, self.wait_s = reason, wait_s


class HubReader:
    """Bounded reads of one hub repo's files (see the module docstring), counted in `fetched_bytes`.

    >>> reader = HubReader("deepseek-ai/DeepSeek-V3")  # doctest: +SKIP
    >>> config = reader.fetch("config.json", None, cap=16 << 20)  # doctest: +SKIP
    """

    def __init__(self, repo_id: str, timeout_s: float | None = None) -> None:
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        self.repo_id = repo_id
        self.timeout_s = hub_timeout() if timeout_s is None else timeout_s
        self.endpoint = constants.ENDPOINT.rstrip("/")
        self._hf_hub_url = hf_hub_url
        headers = build_hf_headers()
        self._auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        self._plain = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        self._tls = _tls_context()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[http.client.HTTPConnection] = []
        self.fetched_bytes = 0

    def url(self, name: str, revision: str | None) -> str:
        """The hub URL of file `name` at `revision` (the default branch for None), as huggingface_hub builds it."""
        try:
            return self._hf_hub_url(self.repo_id, name, revision=revision)
        except ValueError as exc:  # huggingface_hub's HFValidationError: not a repo id the hub accepts
            raise SourceError(f"{self.repo_id}: not a hub repo id ({str(exc).splitlines()[0]})") from None

    def fetch(self, name: str, revision: str | None, *, first: int = 0, nbytes: int | None = None,
              cap: int = 0) -> HubBody | None:
        """`nbytes` of file `name` from byte `first` (fewer at its end), or with `nbytes` None the whole file, at
        most `cap` bytes; None when the hub says it has no such file (404 EntryNotFound)."""
        url = self.url(name, revision)
        return self._tries(lambda: self._fetch_once(url, f"{self.repo_id}/{name}", revision, first, nbytes, cap))

    def fetch_api(self, path: str, cap: int) -> HubBody | None:
        """The hub API's answer at `path` (below `/api/`, or the URL of a next page on the hub), at most `cap`
        bytes; None for a 404 without a code.

        >>> reader.fetch_api(f"models/{reader.repo_id}/tree/main?recursive=true", 16 << 20)  # doctest: +SKIP
        """
        url = path if _origin(path) == _origin(self.endpoint) else f"{self.endpoint}/api/{path}"
        return self._tries(lambda: self._fetch_once(url, f"{self.repo_id} (the hub's file list)", None, 0, None, cap))

    def download(self, name: str, revision: str, size: int, sink: Callable[[bytes], None],
                 restart: Callable[[], None]) -> HubBody | None:
        """The whole file `name`, `size` bytes, handed to `sink` as it arrives; `restart` is called before each
        try, so that a try after a body cut short starts again from byte 0. The time bound is the timeout plus
        `size` at DOWNLOAD_MIN_BYTES_PER_S; None when the hub has no such file.

        >>> reader.download("model-00001-of-00002.safetensors", commit, size, f.write, f.truncate)  # doctest: +SKIP
        """
        url = self.url(name, revision)
        seconds = self.timeout_s + size / DOWNLOAD_MIN_BYTES_PER_S

        def once() -> HubBody | None:
            restart()
            return self._fetch_once(url, f"{self.repo_id}/{name}", revision, 0, None, size, sink, seconds)
        return self._tries(once)

    def _tries(self, once: Callable[[], HubBody | None]) -> HubBody | None:
        for attempt in range(RETRIES + 1):
            try:
                return once()
            except _Retry as exc:
                wait_s = exc.wait_s if exc.wait_s is not None else BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
                if attempt == RETRIES:
                    raise HubError(f"{exc} (tried {RETRIES + 1} times)", reason=exc.reason) from None
                time.sleep(wait_s)
        raise AssertionError("unreachable")  # the loop returns or raises

    def close(self) -> None:
        """Close every connection kept open for the next request."""
        with self._lock:
            conns, self._open = self._open, []
        for conn in conns:
            conn.close()

    def _count(self, n: int) -> None:
        with self._lock:
            self.fetched_bytes += n

    def _fetch_once(self, url: str, where: str, revision: str | None, first: int, nbytes: int | None,
                    cap: int, sink: Callable[[bytes], None] | None = None,
                    seconds: float | None = None) -> HubBody | None:
        deadline = time.monotonic() + (self.timeout_s if seconds is None else seconds)
        headers = {**self._plain, "Accept-Encoding": "identity"}
        if nbytes is not None:
            headers["Range"] = f"bytes={first}-{first + nbytes - 1}"
        origin, commit = _origin(url), None
        for _ in range(MAX_REDIRECTS + 1):
            sent = {**headers, **(self._auth if _origin(url) == origin else {})}
            with self._request(url, sent, deadline, where) as response:
                commit = commit or response.getheader("X-Repo-Commit")
                location = response.getheader("Location")
                if response.status in _REDIRECTS and location:
                    self._drain_redirect(response)
                    url = urllib.parse.urljoin(url, location.strip())
                    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                        raise HubError(f"{where}: {_host(url)} redirects to a URL that is not http(s)",
                                       reason="bad_answer")
                    continue
                if response.status in (200, 206) and sink is not None:
                    return HubBody(b"", self._stream(response, url, where, cap, sink), commit)
                if response.status in (200, 206):
                    data, size = self._body(response, url, where, first, nbytes, cap)
                    return HubBody(data, size, commit, _next_page(response.getheader("Link"), url))
                self._refuse(response, url, where, revision)
                return None  # 404 EntryNotFound: no such file
        raise HubError(f"{where}: more than {MAX_REDIRECTS} redirects (a redirect loop?), the last to "
                       f"{_printable(url)}", reason="too_many_redirects")

    @contextmanager
    def _request(self, url: str, headers: dict[str, str], deadline: float,
                 where: str) -> Iterator[http.client.HTTPResponse]:
        """One GET, its answer yielded; socket and protocol failures become one HubError (or _Retry)."""
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.hostname, parts.port)
        timeout = deadline - time.monotonic()
        conns = self._connections()
        conn, reused = conns.pop(key, None), True
        if conn is None:
            conn, reused = self._connect(parts, timeout, where), False
        watchdog = _Watchdog(conn, timeout)
        response = None
        try:
            try:
                response = self._send(conn, url, parts, headers, timeout)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if not reused or watchdog.fired:
                    raise
                # A kept-alive connection the server has closed meanwhile: once more, on a new one.
                watchdog.cancel()
                conn.close()
                conn = self._connect(parts, deadline - time.monotonic(), where)
                watchdog = _Watchdog(conn, deadline - time.monotonic())
                response = self._send(conn, url, parts, headers, deadline - time.monotonic())
            yield response
        except Exception as exc:
            # Once the watchdog has shut the socket, whatever broke (a short body, a lost status line) was the
            # deadline's doing: say so, and do not try again.
            if isinstance(exc, (HubError, _Retry)) and not watchdog.fired:
                raise
            raise self._failure(exc, url, where, watchdog.fired or time.monotonic() >= deadline) from None
        finally:
            fired = watchdog.cancel()
            if response is not None and not response.isclosed() and response.length == 0:
                response.read()  # nothing is left: this only marks the answer as read, as keep-alive needs
            if response is not None and response.isclosed() and not response.will_close and not fired:
                conns[key] = conn
            else:
                conn.close()

    def _connections(self) -> dict[tuple[str, str | None, int | None], http.client.HTTPConnection]:
        """This thread's open connections by (scheme, host, port): HTTP keep-alive between its requests."""
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        return conns

    def _connect(self, parts: urllib.parse.SplitResult, timeout: float, where: str) -> http.client.HTTPConnection:
        host, https = parts.hostname or "", parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        proxy = _proxy_for(parts.scheme, host)
        conn: http.client.HTTPConnection
        if proxy is None:
            conn = (http.client.HTTPSConnection(host, port, timeout=timeout, context=self._tls) if https
                    else http.client.HTTPConnection(host, port, timeout=timeout))
        else:
            p = urllib.parse.urlsplit(proxy)
            if p.scheme != "http" or not p.hostname:
                raise HubError(f"{where}: proxy {_printable(proxy)} is not an http:// proxy, the only kind shardprep "
                               "reads the hub through", reason="unreachable")
            auth = {}
            if p.username:
                pair = f"{urllib.parse.unquote(p.username)}:{urllib.parse.unquote(p.password or '')}"
                auth["Proxy-Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
            if https:
                conn = http.client.HTTPSConnection(p.hostname, p.port or 80, timeout=timeout, context=self._tls)
                conn.set_tunnel(host, port, headers=auth)
            else:
                conn = http.client.HTTPConnection(p.hostname, p.port or 80, timeout=timeout)
                conn.proxy_headers = auth  # type: ignore[attr-defined]  # sent with each request (see _send)
        with self._lock:
            self._open.append(conn)
        return conn

    @staticmethod
    def _send(conn: http.client.HTTPConnection, url: str, parts: urllib.parse.SplitResult,
              headers: dict[str, str], timeout: float) -> http.client.HTTPResponse:
        conn.timeout = max(timeout, 0.001)
        if conn.sock is not None:
            conn.sock.settimeout(conn.timeout)
        proxy_headers = getattr(conn, "proxy_headers", None)
        # Through an http:// proxy a plain-HTTP request names the whole URL; otherwise the path alone.
        target = url if proxy_headers is not None else (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target, headers={**headers, **(proxy_headers or {})})
        return conn.getresponse()

    def _failure(self, exc: Exception, url: str, where: str, timed_out: bool) -> Exception:
        """The HubError (or _Retry) that a socket or protocol failure of one request means."""
        host = _host(url)
        if timed_out or isinstance(exc, (TimeoutError, socket.timeout)):
            return HubError(f"{where}: no complete answer from {host} within {self.timeout_s:g} s (it stalled, or "
                            f"sent too slowly; {TIMEOUT_ENV} gives a slow network more time)", reason="timeout")
        if isinstance(exc, socket.gaierror):
            return HubError(f"{self.repo_id}: cannot reach the hub: {host} does not resolve ({exc.strerror}); without "
                            "a network, HF_HUB_OFFLINE=1 reads the local HF cache instead", reason="dns")
        if isinstance(exc, http.client.IncompleteRead):
            return _Retry(f"{where}: {host} cut the answer short (the connection ended in the middle of it)",
                          "broken_body")
        if isinstance(exc, (http.client.HTTPException, ConnectionResetError, BrokenPipeError)):
            return _Retry(f"{where}: {host} broke the answer off ({type(exc).__name__}: "
                          f"{_printable(str(exc)) or 'the connection ended'})", "broken_body")
        if isinstance(exc, ssl.SSLError):
            return HubError(f"{where}: TLS with {host} failed ({_printable(exc.reason or str(exc))}); a proxy that "
                            "intercepts HTTPS needs its certificate in SSL_CERT_FILE", reason="unreachable")
        if isinstance(exc, OSError):
            return HubError(f"{self.repo_id}: cannot reach the hub at {host}: {exc.strerror or exc}; without a "
                            "network, HF_HUB_OFFLINE=1 reads the local HF cache instead", reason="unreachable")
        return HubError(f"{where}: reading from {host} failed ({type(exc).__name__}: {_printable(str(exc))})",
                        reason="bad_answer")

    def _drain_redirect(self, response: http.client.HTTPResponse) -> None:
        """Read a short redirect body so that its connection can serve the next request; a long one is not read."""
        length = _int_header(response, "Content-Length")
        if length is not None and length <= REDIRECT_BODY_BYTES:
            self._count(len(self._read(response, length)))

    def _read(self, response: http.client.HTTPResponse, limit: int) -> bytes:
        """At most `limit` bytes of the body, one system call at a time, counted as they arrive."""
        data = bytearray()
        while len(data) < limit:
            chunk = response.read1(min(READ_CHUNK, limit - len(data)))
            if not chunk:
                break
            data += chunk
            self._count(len(chunk))
        return bytes(data)

    def _body(self, response: http.client.HTTPResponse, url: str, where: str, first: int, nbytes: int | None,
              cap: int) -> tuple[bytes, int | None]:
        """The body of a 200 or 206, read within its bound; refused from its headers where they break it."""
        host = _host(url)
        encoding = (response.getheader("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            raise HubError(f"{where}: {host} sent it {_printable(encoding)}-encoded though shardprep asks for it "
                           "unencoded; refused unread (it is never decoded)", reason="encoded")
        length = _int_header(response, "Content-Length")
        if nbytes is None:  # the whole file, at most `cap` bytes
            if response.status != 200:
                raise HubError(f"{where}: {host} answered a request for the whole file with a part of it (206)",
                               reason="bad_answer")
            if length is not None and length > cap:
                raise HubError(f"{where}: {length} bytes on the hub, more than a {_what(where)} may be ({cap}); "
                               "refused unread", reason="too_large")
            data = self._read(response, cap + 1 if length is None else length)
            if len(data) > cap:
                raise HubError(f"{where}: more than a {_what(where)} may be ({cap} bytes); stopped reading there",
                               reason="too_large")
            self._check_complete(data, length, where, host)
            return data, len(data)
        last = first + nbytes - 1
        if response.status == 206:
            m = _CONTENT_RANGE.fullmatch((response.getheader("Content-Range") or "").strip())
            if m is None:
                raise HubError(f"{where}: {host} answered a range request with 206 but no valid Content-Range",
                               reason="bad_answer")
            start, end, total = int(m[1]), int(m[2]), None if m[3] == "*" else int(m[3])
            if start != first or not start <= end <= last or (total is not None and end >= total):
                raise HubError(f"{where}: asked for bytes {first}-{last}, {host} answered bytes {start}-{end} of "
                               f"{m[3]}; refused unread", reason="out_of_range")
            expected = end - start + 1
            if length is not None and length != expected:
                raise HubError(f"{where}: {host} announced bytes {start}-{end} in a body of {length} bytes",
                               reason="bad_answer")
        else:  # 200: the server ignored Range and sends the whole file, an answer where it fits the budget
            budget = max(nbytes, WHOLE_ANSWER_BYTES)
            if length is not None and length > budget:
                raise HubError(f"{where}: {host} answered a range request (bytes {first}-{last}) with the whole "
                               f"file ({length} bytes, more than the {budget} a read of {nbytes} bytes may take); "
                               "refused unread: the server (a mirror or proxy?) ignores Range", reason="out_of_range")
            data = self._read(response, budget + 1 if length is None else length)
            if len(data) > budget:
                raise HubError(f"{where}: {host} answered a range request (bytes {first}-{last}) with more than "
                               f"the {budget} bytes a read of {nbytes} bytes may take: the server (a mirror or "
                               "proxy?) ignores Range; stopped reading there", reason="out_of_range")
            self._check_complete(data, length, where, host)
            return data[first:first + nbytes], len(data)
        data = self._read(response, expected + 1)
        if len(data) > expected:
            raise HubError(f"{where}: {host} sent more than the {expected} bytes it announced; stopped reading "
                           "there", reason="out_of_range")
        self._check_complete(data, expected, where, host)
        return data, total

    def _stream(self, response: http.client.HTTPResponse, url: str, where: str, size: int,
                sink: Callable[[bytes], None]) -> int:
        """A whole file of `size` bytes, each piece handed to `sink` as it arrives; never a byte past `size`."""
        host = _host(url)
        encoding = (response.getheader("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity" or response.status != 200:
            raise HubError(f"{where}: {host} answered a request for the whole file with "
                           f"{'a part of it (206)' if response.status == 206 else _printable(encoding) + ' encoding'}"
                           "; refused unread", reason="bad_answer")
        length = _int_header(response, "Content-Length")
        if length is not None and length != size:
            raise HubError(f"{where}: {host} announced {length} bytes, the hub's file list {size}; refused unread",
                           reason="bad_answer")
        done = 0
        while done <= size:
            chunk = response.read1(min(READ_CHUNK, size + 1 - done))
            if not chunk:
                break
            done += len(chunk)
            self._count(len(chunk))
            if done > size:
                raise HubError(f"{where}: {host} sent more than the {size} bytes of the file; stopped reading there",
                               reason="out_of_range")
            sink(chunk)
        if done < size:
            raise _Retry(f"{where}: {host} cut the answer short ({done} of {size} bytes)", "broken_body")
        return done

    @staticmethod
    def _check_complete(data: bytes, expected: int | None, where: str, host: str) -> None:
        if expected is not None and len(data) < expected:
            raise _Retry(f"{where}: {host} cut the answer short ({len(data)} of {expected} bytes)", "broken_body")

    def _refuse(self, response: http.client.HTTPResponse, url: str, where: str, revision: str | None) -> None:
        """Raise what an answer other than 200/206/3xx means; return only for a file the repo does not have."""
        status, host, repo = response.status, _host(url), self.repo_id
        code = response.getheader("X-Error-Code") or ""
        said = _printable(response.getheader("X-Error-Message") or "")
        detail = f": {said}" if said else ""
        sent = "a token was sent (HF_TOKEN)" if self._auth else "no token was sent (HF_TOKEN)"
        if status == 404 and code == "RevisionNotFound":
            raise HubError(f"{repo}: the hub has no revision {revision!r} (a branch, tag or commit of {repo})",
                           reason="revision_not_found")
        if code == "RepoNotFound" and status in (401, 404):
            private = ("your token (HF_TOKEN) cannot read it" if self._auth
                       else "no token was sent: set HF_TOKEN to one that can read it")
            raise HubError(f"{repo}: no such repository on {host}, or it is private and {private}",
                           reason="repo_not_found")
        if code == "GatedRepo" or (status in (401, 403) and "gated" in said.lower()):
            page = f"{self.endpoint}/{repo}"
            if self._auth and status == 403:
                raise HubError(f"{repo}: a gated repository, and your token (HF_TOKEN) has no access to it yet: ask "
                               f"for access on {page} (403)", reason="gated")
            raise HubError(f"{repo}: a gated repository: ask for access on {page}, then set HF_TOKEN (or run "
                           f"`hf auth login`) to a token of that account ({status})", reason="gated")
        if status == 404 and code in ("EntryNotFound", ""):
            return  # the repo has no such file at this revision
        if status == 401:
            if self._auth:
                raise HubError(f"{where}: {host} does not accept your token, HF_TOKEN (401 Unauthorized{detail})",
                               reason="unauthorized")
            raise HubError(f"{where}: {host} asks for a token (401 Unauthorized{detail}): a private or gated "
                           "repository needs HF_TOKEN set to one that can read it", reason="unauthorized")
        if status == 403:
            raise HubError(f"{where}: {host} refused the request (403 Forbidden{detail}); {sent}",
                           reason="forbidden")
        reason_phrase = _printable(response.reason or "")
        if status == 429:
            wait_s = _retry_after(response.getheader("Retry-After"))
            if wait_s is not None and wait_s > self.timeout_s:
                raise HubError(f"{where}: rate limited by {host} (429), which asks to wait {wait_s:.0f} s, longer "
                               f"than {TIMEOUT_ENV} ({self.timeout_s:g} s); try again later (a token, HF_TOKEN, "
                               "has a higher limit)", reason="rate_limited")
            raise _Retry(f"{where}: rate limited by {host} (429 {reason_phrase}{detail})", "rate_limited", wait_s)
        if status >= 500:
            raise _Retry(f"{where}: {host} answered {status} {reason_phrase}{detail}: the hub (or a proxy before it) "
                         "is failing; try again later", "server_error")
        raise HubError(f"{where}: {host} answered {status} {reason_phrase}{detail}", reason="bad_answer")


class _Watchdog:
    """Shuts a connection's socket down at a deadline, so that no read (headers, body, TLS record) outlives it."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self.fired = False
        self._cancelled = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(seconds, 0.0), self._fire, (conn,))
        self._timer.daemon = True
        self._timer.start()

    def _fire(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:  # never after cancel(): a connection kept for the next request must stay whole
            if self._cancelled:
                return
            self.fired = True
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cancel(self) -> bool:
        """Stop the watchdog; True when it fired first."""
        self._timer.cancel()
        with self._lock:
            self._cancelled = True
            return self.fired


def _tls_context() -> ssl.SSLContext:
    """The system's trust store (SSL_CERT_FILE and SSL_CERT_DIR honoured), plus certifi's where it is installed:
    what huggingface_hub's clients trust."""
    context = ssl.create_default_context()
    try:
        import certifi

        context.load_verify_locations(certifi.where())
    except (ImportError, OSError):
        pass
    return context


def _proxy_for(scheme: str, host: str) -> str | None:
    if urllib.request.proxy_bypass(host):
        return None
    return urllib.request.getproxies().get(scheme)


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


def _host(url: str) -> str:
    return _printable(urllib.parse.urlsplit(url).netloc.rpartition("@")[2]) or "the hub"


def _what(where: str) -> str:
    return "config.json" if where.endswith("/config.json") else "safetensors index"


def _next_page(link: str | None, url: str) -> str | None:
    """The `rel="next"` URL of a Link header, when it is on `url`'s origin (a page elsewhere is not followed).

    >>> _next_page('<https://hf.co/api/models/a/b/tree/main?cursor=x>; rel="next"', "https://hf.co/api/x")
    'https://hf.co/api/models/a/b/tree/main?cursor=x'
    """
    m = re.search(r'<([^>]+)>\s*;\s*rel="?next"?', link or "")
    if m is None:
        return None
    target = urllib.parse.urljoin(url, m[1])
    return target if _origin(target) == _origin(url) else None


def _int_header(response: http.client.HTTPResponse, name: str) -> int | None:
    value = (response.getheader(name) or "").strip()
    return int(value) if value.isdigit() and len(value) < 20 else None


def _retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After asks for (a number or an HTTP date); None when it is absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(min(int(value[:12]), 10**9))
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _printable(text: str, limit: int = 200) -> str:
    """A server's words (a header, a URL) made safe for one line: no control characters, bounded length."""
    clean = "".join(c if c.isprintable() else "?" for c in text[:limit + 1]).strip()
    return clean if len(clean) <= limit else clean[:limit] + "…"
