"""Several URLs for one fleet server: replicas on one database, reached without a balancer
or around one (`server.fallbackUrls`, docs/device.md "Several server URLs").

A balancer that does not health-check keeps sending a device's requests to a dead replica:
a Git device took 57 to over 120 s to get through. A device that knows more than one URL
need not wait for anyone: when a request finds its URL dead, it tries the next URL at once,
and stays on the one that answered (sticky), for every later request.

What moves a request on (`connection_failure`, `unavailable`): no connection (refused,
unreachable, DNS, a TLS handshake that fails or a server identity refused), no answer within
the timeout, a connection that breaks before the answer, and 502, 503 or 504. A gateway
answers those for a dead replica behind it. A live WFM answers 503 with `Retry-After` when it
cannot take the request now (its database unreachable or locked, a device branch being
repaired on this replica, too many connections): that is no reason to stop, but it is a
reason to ask another replica, which may well have its database. If no other URL does
better, the answer of the URL in use stands (or, when it gave none, the first answer, whose
URL is then the one in use), `Retry-After` and all, and the device waits as it was told;
during an outage of the shared database that costs one more request per other URL every
`RECHECK_SECONDS`. Every other answer, error or not (401, 404, 422, 500, ...), is the
server's: the device stays where it is.

Every request the device client makes may be sent twice (GET, PUT of a status or capability
document, the onboarding POST that gives a key its existing client back), so a request that
timed out on one URL is sent to the next without harm.

A kept-alive connection the server closed just as the request went out on it (its idle
timeout ran out at that moment: `httpx.RemoteProtocolError` "Server disconnected", or
`ReadError` for the reset) is no sign of a dead URL: the server did not act on the request. An
idempotent request (GET, HEAD, PUT, DELETE, OPTIONS: RFC 9110, 9.2.2) with a body that can be
sent again is then sent once more on a new connection, to the same URL, before anything
else is decided. Only on a reused connection: one that breaks right after it was opened is
the server's answer, and moves on as above. (httpcore's own check of an idle connection
before reuse misses a close that arrives while the request is being written.)

`ServerList` is the choice shared by all users of one list (the HTTP client and, when its
URLs follow the server's, the Git source): one device, one view of which URL works. Back
to the first URL: `failback` seconds after leaving it (and again every `failback` seconds
while it fails), one request tries it first; if it answers, the device stays there. A URL
that failed is skipped by other requests for `RECHECK_SECONDS` unless it is the one in use,
so a device whose every URL is down pays, after the first request, one failed attempt per
request, as with one URL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

__all__ = ["DEFAULT_FAILBACK_SECONDS", "RECHECK_SECONDS", "UNAVAILABLE", "FailoverClient",
           "ServerList", "connection_failure", "unavailable"]

log = logging.getLogger("margo.device")

#: How long the device stays on a fallback URL before it tries the first one again.
DEFAULT_FAILBACK_SECONDS = 600.0
#: How long a URL that failed is left out of other requests' attempts (module docstring).
RECHECK_SECONDS = 30.0

#: Transport errors that say nothing came back from this URL (httpx's names).
_NO_ANSWER = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout, httpx.WriteTimeout,
              httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def connection_failure(exc: Exception) -> bool:
    """Whether a transport error means this URL gave no answer (module docstring); local
    faults (a pool timeout, a malformed request) would fail on every URL alike."""
    return isinstance(exc, _NO_ANSWER)


#: Answers that send a request on to the next URL (module docstring).
UNAVAILABLE = frozenset({502, 503, 504})


def unavailable(response: httpx.Response) -> bool:
    """Whether the answer says this URL cannot serve the request now (module docstring)."""
    return response.status_code in UNAVAILABLE


class ServerList:
    """Which of several equivalent URLs is in use, and in what order one request tries
    them (module docstring). `labels` name them in logs; indices are what callers map to
    their own URLs (server URLs, or the Git repositories under them)."""

    def __init__(self, labels: Sequence[str], *, failback: float = DEFAULT_FAILBACK_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not labels:
            raise ValueError("a server list needs at least one URL")
        self.labels = tuple(labels)
        self._failback = failback
        self._clock = clock
        self._active = 0
        self._skip_until = [0.0] * len(self.labels)
        self._failback_at: float | None = None
        self._last_failure = [""] * len(self.labels)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def active(self) -> int:
        """The index of the URL in use."""
        return self._active

    def order(self) -> list[int]:
        """The indices one request tries, in turn: the first URL when a failback is due,
        the one in use, then the others in list order unless they failed just now."""
        with self._lock:
            now = self._clock()
            first: list[int] = []
            if self._failback_at is not None and now >= self._failback_at:
                first = [0]
                self._failback_at = now + self._failback
            others = [i for i in range(len(self.labels))
                      if i != self._active and i not in first and self._skip_until[i] <= now]
            return [*first, self._active, *others]

    def answered(self, index: int) -> None:
        """`index` answered: it is the one in use from now on."""
        with self._lock:
            self._skip_until[index] = 0.0
            previous, self._active = self._active, index
            if index == previous:
                return
            if index == 0:
                self._failback_at = None
                log.warning("server %s answers again; using it again instead of %s",
                            self.labels[0], self.labels[previous])
                return
            if self._failback_at is None and self._failback > 0:
                self._failback_at = self._clock() + self._failback
            log.warning("server %s failed (%s); using %s from now on",
                        self.labels[previous], self._last_failure[previous] or "no answer",
                        self.labels[index])

    def failed(self, index: int, reason: str) -> None:
        """`index` gave no answer (`reason` says how): skipped for a while by others."""
        with self._lock:
            self._skip_until[index] = self._clock() + RECHECK_SECONDS
            self._last_failure[index] = reason


#: Methods a request of which may be sent again (RFC 9110, 9.2.2).
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
#: What a kept-alive connection the server closed before answering gives (module docstring).
_CLOSED_UNDER_US = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class _ConnectWatch:
    """httpcore's `trace` extension for one attempt: whether it opened a connection (any
    `connection.connect_*` event); otherwise it went out on a kept-alive one. Passes every
    event on to the caller's own `trace`, if any."""

    def __init__(self, inner: Callable[[str, dict[str, Any]], Any] | None) -> None:
        self.inner = inner
        self.connected = False

    def __call__(self, name: str, info: dict[str, Any]) -> Any:
        if name.startswith("connection.connect_"):
            self.connected = True
        return self.inner(name, info) if self.inner is not None else None


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class FailoverClient(httpx.Client):
    """An `httpx.Client` over several server URLs (`urls[0]` is its `base_url`): each request
    goes to the URL in use and moves on to the next when that one gives no answer (module
    docstring). Authentication runs per attempt, so rc.2 signatures cover the URL the
    request is really sent to. With one URL it is exactly an `httpx.Client`."""

    def __init__(self, urls: Sequence[str], *, servers: ServerList | None = None,
                 **kwargs: Any) -> None:
        self.urls = tuple(url.rstrip("/") for url in urls)
        self.servers = servers or ServerList(self.urls)
        if len(self.servers) != len(self.urls):
            raise ValueError("the server list and the URLs differ in length")
        super().__init__(base_url=self.urls[0], **kwargs)

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        """Send `request` to the URL in use, moving on as the module docstring says. When
        no URL did better: the 502/503/504 of the URL in use, else the first such answer
        (its URL, alive if unable for now, becomes the one in use), else the first error."""
        relative = self._relative(request.url)
        headers = request.headers.copy()
        if len(self.urls) == 1 or relative is None:
            return self._send_fresh(request, headers, **kwargs)
        errors: list[httpx.TransportError] = []
        answers: dict[int, httpx.Response] = {}
        try:
            for index in self.servers.order():
                attempt = _retarget(request, httpx.URL(self.urls[index] + relative), headers)
                try:
                    response = self._send_fresh(attempt, headers, **kwargs)
                except httpx.TransportError as exc:
                    if not connection_failure(exc):
                        raise
                    self.servers.failed(index, _describe(exc))
                    errors.append(exc)
                    continue
                if unavailable(response):
                    self.servers.failed(index, f"HTTP {response.status_code}")
                    answers[index] = response
                    continue
                self.servers.answered(index)
                return response
            if not answers:
                raise errors[0]
            index = self.servers.active if self.servers.active in answers else next(iter(answers))
            self.servers.answered(index)
            return answers.pop(index)
        finally:
            for unused in answers.values():
                unused.close()

    def _send_fresh(self, request: httpx.Request, headers: httpx.Headers,
                    **kwargs: Any) -> httpx.Response:
        """Send `request`, and once more on a new connection when it went out on a kept-alive
        one the server had closed (module docstring); `headers`: those it had before auth."""
        extensions = request.extensions
        watch = _ConnectWatch(extensions.get("trace"))
        request.extensions = {**extensions, "trace": watch}
        try:
            return super().send(request, **kwargs)
        except _CLOSED_UNDER_US as exc:
            if watch.connected or request.method not in _IDEMPOTENT or \
                    not isinstance(request.stream, httpx.ByteStream):
                raise
            log.info("%s %s: the server closed the kept-alive connection (%s); sending it "
                     "again on a new one", request.method, request.url, _describe(exc))
        again = _retarget(request, request.url, headers)
        again.extensions = extensions
        return super().send(again, **kwargs)

    def _relative(self, url: httpx.URL) -> str | None:
        """The part of `url` after the first server URL (starting with `/`), or None for a
        URL elsewhere, which is sent as it is."""
        base, text = str(self.base_url).rstrip("/"), str(url)
        rest = text[len(base):]
        return rest if text.startswith(base) and rest.startswith("/") else None


def _retarget(request: httpx.Request, url: httpx.URL,
              headers: httpx.Headers) -> httpx.Request:
    """A copy of `request` for `url`, with the headers it had before any attempt (auth adds
    its own per attempt) and the `Host` of the new URL."""
    fresh = headers.copy()
    fresh.pop("host", None)
    return httpx.Request(request.method, url, headers=fresh, content=request.content or None,
                         extensions=request.extensions)
