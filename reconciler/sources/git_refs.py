"""The Git source's ref advertisement read over HTTP by the client itself, so that it can be
a waiting poll (`reconciler.sources.waiting`).

libgit2 reads the advertisement (`GET .../info/refs?service=git-upload-pack`) with no way to
add a header. Reading it here costs the same one GET (fewer: the credentials go with the
first request instead of after a 401 challenge) and can be conditional: the fleet server
gives the advertisement an ETag, answers 304 to a request naming it, and holds one that also
carries `Prefer: wait=N` until the device's branch moves (`wfm.git.refwaits`). Only a tip
that moved is then fetched, with libgit2, as before. Any other smart-HTTP Git server just
answers 200 (no ETag: nothing to wait on) and the device polls as before.

Protocol v0, which every smart-HTTP server speaks when the client names no version: pkt-lines
after the `# service=git-upload-pack` line, the first ref line carrying the capabilities
after a NUL. The tip is what HEAD names (the server's view makes HEAD the device's branch).
An advertisement that cannot be read (`Unusable`) sends the source back to libgit2.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass

import httpx

from reconciler.sources import SourceError
from reconciler.sources.http_errors import translated
from reconciler.sources.waiting import WaitingPolls

__all__ = ["RefProbe", "RefsStatus", "Unusable", "head_of"]

_OID = re.compile(rb"^(?:[0-9a-f]{40}|[0-9a-f]{64})\Z")
_SERVICE = "/info/refs?service=git-upload-pack"
#: The largest advertisement read (one device's branch is a few hundred bytes).
_MAX_BYTES = 1024 * 1024
#: Statuses after which the next URL is tried (as `reconciler.failover` does).
_NO_ANSWER = frozenset({502, 503, 504})


class Unusable(Exception):
    """The advertisement is not one this reader understands: let libgit2 read it."""


class RefsStatus(Exception):
    """The server answered the advertisement with `status` (not 200, 304 or 404)."""

    def __init__(self, url: str, status: int) -> None:
        super().__init__(f"{url}: HTTP {status}")
        self.url, self.status = url, status


@dataclass(frozen=True, slots=True)
class _Known:
    etag: str
    tip: str


def head_of(body: bytes) -> str | None:
    """The commit HEAD names in a protocol-v0 advertisement (None: no HEAD, an empty
    repository). `Unusable` for anything that is not pkt-lines."""
    position, found = 0, None
    while position < len(body):
        try:
            length = int(body[position:position + 4], 16)
        except ValueError:
            raise Unusable("not a pkt-line advertisement") from None
        if length == 0:  # a flush-pkt
            position += 4
            continue
        if length < 5 or position + length > len(body):
            raise Unusable("a truncated pkt-line")
        line = body[position + 4:position + length].rstrip(b"\n").split(b"\0", 1)[0]
        position += length
        oid, _, name = line.partition(b" ")
        if name == b"HEAD" and found is None:
            if not _OID.match(oid):
                raise Unusable("HEAD names no object id")
            found = None if not oid.strip(b"0") else oid.decode("ascii")
    return found


class RefProbe:
    """Reads one repository's advertisement at each of its URLs, remembering per URL the
    ETag and tip it last read (what a conditional poll names)."""

    def __init__(self, *, username: str | None, password: str | None,
                 timeout: float) -> None:
        auth = httpx.BasicAuth(username, password) if username and password else None
        # The system's trust store, as libgit2 uses it; no proxies, as libgit2 uses none.
        self._http = httpx.Client(auth=auth, timeout=timeout, trust_env=False,
                                  verify=ssl.create_default_context(),
                                  headers={"User-Agent": "margo-gitops-device/0.1"})
        self._known: dict[str, _Known] = {}

    def tip(self, url: str, waiting: WaitingPolls | None) -> str | None:
        """The tip HEAD names at `url` (None: no branch there, 404). Conditional when this
        URL was read before, and held when `waiting` asks for a wait. Raises `SourceError`
        (no answer), `RefsStatus` (another answer), `Unusable`; a held poll may raise
        `reconciler.sources.waiting.Interrupted`."""
        known = self._known.get(url)
        held = waiting if known is not None and waiting is not None and waiting.wait() \
            else None
        headers = {"If-None-Match": known.etag, **(held.headers() if held else {})} \
            if known is not None else {}
        timeout = held.timeout(self._http.timeout) if held else self._http.timeout

        def get() -> httpx.Response:
            return self._get(url, headers, timeout)

        try:
            response = held.run(get) if held else get()
        except SourceError:
            if held is not None:
                held.cut()
            raise
        if held is not None and response.status_code in _NO_ANSWER:
            held.cut()
        elif held is not None:
            held.answered(response.headers, moved=response.status_code == 200 and
                          response.headers.get("etag") not in (None, known.etag if known
                                                                else None))
        return self._read(url, response, known)

    def _read(self, url: str, response: httpx.Response, known: _Known | None) -> str | None:
        status = response.status_code
        if status == 304 and known is not None:
            return known.tip
        if status == 404:
            self._known.pop(url, None)
            return None
        if status != 200:
            raise RefsStatus(url, status)
        tip = head_of(response.content)
        etag = response.headers.get("etag")
        if tip is not None and etag:
            self._known[url] = _Known(etag, tip)
        else:
            self._known.pop(url, None)
        return tip

    def _get(self, url: str, headers: dict[str, str],
             timeout: httpx.Timeout) -> httpx.Response:
        with translated(url), self._http.stream("GET", url.rstrip("/") + _SERVICE,
                                                headers=headers, timeout=timeout) as response:
            body = b""
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > _MAX_BYTES:
                    raise Unusable("an advertisement larger than 1 MiB")
            return httpx.Response(response.status_code, headers=response.headers,
                                  content=body)

    def close(self) -> None:
        self._http.close()

