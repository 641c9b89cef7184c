"""Git smart-HTTP hosting of each device's desired state, read-only, one branch per device.

`git_app` is an ASGI app the fleet server mounts at ``/git``. For a device ``D`` (ids may
contain ``/``, e.g. ``gw1/child``) it serves exactly two endpoints of the smart protocol::

    GET  /devices/D.git/info/refs?service=git-upload-pack
    POST /devices/D.git/git-upload-pack

Everything else (``git-receive-pack``: devices never write; dumb-HTTP paths such as
``info/refs`` without ``?service`` or ``objects/...``, which would list every device's refs)
is answered with an ``application/problem+json`` 403 or 404. Every device request first
calls ``authorize(request, D)``; False gives 401 with ``WWW-Authenticate: Basic`` so stock
Git asks for / sends credentials. Only an authorized caller learns whether ``D`` has a branch
(404 otherwise). The hook must not read the request body: the body belongs to Git.

How one device is confined to its branch in the SHARED repository
(``<repos>/fleet-state.git``, see `compiler.gitstore`):

- Refs. ``git http-backend`` runs per request with configuration passed in the environment
  (``GIT_CONFIG_COUNT``): ``uploadpack.hideRefs=refs/`` then
  ``uploadpack.hideRefs=!refs/heads/devices/<encoded D>`` (last match wins), so both protocol
  v0 advertisements and v2 ``ls-refs`` list only the device's branch.
- Objects, protocol v0/v1. ``upload-pack`` only accepts ``want`` lines naming advertised tips
  (the SHA1-in-want options are forced off), so other devices' objects cannot be fetched.
- Objects, protocol v2. MEASURED (git 2.39): a v2 ``fetch`` accepts ANY object id as a
  ``want``, whatever ``uploadpack.allowAnySHA1InWant`` and ``hideRefs`` say (gitprotocol-v2:
  "Wants can be anything and are not limited to advertised objects"). Hidden refs alone would
  therefore let a device that learnt another device's commit id fetch that state. So every
  upload-pack request body is parsed here as it streams through (decompressing ``gzip``),
  and refused with 403 before Git sees a ``want`` that is not a commit on the device's
  branch (its tip or an ancestor) or the tip's tree or one of its entries (what a partial
  clone fetches lazily). Only the ``ls-refs`` and ``fetch`` commands are let through;
  ``want-ref`` and ``deepen-not`` (which name refs, so their errors would tell which device
  branches exist) are refused in either protocol.
- ``have`` and ``shallow`` lines, both protocols. MEASURED (git 2.39): upload-pack takes
  them at their word for any object in the repository. With ``thin-pack`` and a shallow
  request (``deepen`` or a ``shallow`` line), a ``have <another device's commit>`` makes that
  commit's files delta bases, so the pack carried the caller's document as copy
  instructions over the other device's document (and its size); and ``shallow <another
  device's commit>`` with an infinite ``deepen`` "unshallows" that commit, sending its
  parents' state outright, want gate or not. So the lines Git is given are rewritten: a
  ``have`` or ``shallow`` line naming anything but a commit on the device's branch reaches
  Git naming the null id instead, an object that exists nowhere, so Git answers as for any
  id it lacks (the caller just gets more of its own objects). The body Git receives is
  therefore the checked, decompressed one.
- What remains: nothing in an answer tells whether an object id exists elsewhere in the
  shared repository (a foreign ``want`` is refused like a missing one, foreign ``have`` and
  ``shallow`` lines are answered like missing ones), except how long the check took.

HEAD. Each request runs against a throw-away "view" directory holding only ``HEAD`` (a
symbolic ref to the device's branch) and a ``commondir`` file naming the shared repository
(the documented layout of linked work trees, gitrepository-layout(5)): refs, objects and
configuration come from the shared repository, HEAD is the device's own. So HEAD is
advertised as a symref to the device branch (v0 ``symref=`` capability, v2 ``symref-target``)
and a plain ``git clone URL`` checks out the device's branch (local branch
``devices/<encoded D>``); ``git clone --branch devices/<encoded D> URL`` and
``git fetch URL refs/heads/devices/<encoded D>`` work as well. The shared repository's own
HEAD is never consulted, and no file is ever written into it. (So ``GIT_PROJECT_ROOT`` is
the view's temporary parent directory, not the shared repository's.)

Process handling: the request body is streamed into ``http-backend``'s stdin and its output
is streamed back (packs are never held in memory); no shell is involved and inherited
``GIT_*`` variables are dropped (except ``GIT_TRACE*``). The process group is killed when the
client disconnects or after `PROCESS_TIMEOUT` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import inspect
import logging
import os
import re
import signal
import tempfile
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pygit2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from compiler.gitstore import device_ref
from compiler.state import recorded_branch
from wfm.fleet.desired import STATE_LOST_RETRY

__all__ = [
    "BACKEND_GONE",
    "MAX_REQUEST_BYTES",
    "PROCESS_TIMEOUT",
    "REALM",
    "Authorize",
    "Delivered",
    "Lost",
    "git_app",
    "write_to_backend",
]

#: A hook deciding whether the request may read device ``device_id``'s state.
Authorize = Callable[[Request, str], Awaitable[bool] | bool]
#: For a device without a branch: why that is lost state (503), or None (no state yet: 404).
Lost = Callable[[str], str | None]
#: Told (device id, commit) after an upload-pack exchange that sent the device its branch's
#: tip completed: what the device was last handed out (`wfm.fleet.attribution`).
Delivered = Callable[[str, str], None]

#: Seconds one Git exchange may take before its processes are killed.
PROCESS_TIMEOUT = 300.0
#: Most (decompressed) bytes of an upload-pack request we parse; legitimate ones are far smaller.
MAX_REQUEST_BYTES = 64 * 1024 * 1024
#: The Basic-auth realm announced with 401 answers.
REALM = "margo-gitops"
#: What writing to a Git backend that has exited raises: BrokenPipeError or
#: ConnectionResetError with asyncio's own loop, RuntimeError ("the handler is closed")
#: with uvloop, which the server runs on.
BACKEND_GONE = (BrokenPipeError, ConnectionResetError, RuntimeError)


async def write_to_backend(stdin: asyncio.StreamWriter, data: bytes) -> bool:
    """Write `data` to a Git backend's stdin; False when the backend has stopped reading
    (it answered without the rest of the request: its own answer says why)."""
    try:
        stdin.write(data)
        await stdin.drain()
    except BACKEND_GONE:
        return False
    return True

_UPLOAD_PACK = "git-upload-pack"
_CHUNK = 64 * 1024
_MAX_CGI_HEAD = 64 * 1024
_STDERR_KEPT = 8 * 1024
_VIEW_NAME = "device.git"
_DEVICE = "/devices/{device:path}.git"
_HEX4 = re.compile(rb"[0-9a-fA-F]{4}")
_OID_HEX = re.compile(rb"[0-9a-fA-F]{40}")
_V2_COMMANDS = frozenset({b"ls-refs", b"fetch"})
_REFUSED_V2_ARGS = (b"want-ref ", b"deepen-not ")
_GZIP_ENCODINGS = frozenset({"gzip", "x-gzip"})
# Settings every exchange runs with, after the per-device hideRefs pair (see module docstring).
_FORCED_CONFIG: tuple[tuple[str, str], ...] = (
    ("uploadpack.allowAnySHA1InWant", "false"),
    ("uploadpack.allowReachableSHA1InWant", "false"),
    ("uploadpack.allowTipSHA1InWant", "false"),
    ("uploadpack.allowRefInWant", "false"),
    ("transfer.advertiseObjectInfo", "false"),
    ("http.uploadpack", "true"),
    ("http.receivepack", "false"),
    ("http.getanyfile", "false"),
)

#: The logger's name is the one operators filter on (kept when the module moved).
_log = logging.getLogger("wfm.githttp")


def git_app(repository: str | os.PathLike[str], authorize: Authorize, *,
            git: str = "git", lost: Lost | None = None,
            delivered: Delivered | None = None) -> ASGIApp:
    """The ASGI app serving every device's branch of `repository` (mount it at ``/git``).

    `repository` is the shared bare repository (``<repos>/fleet-state.git``); `git` is the
    program run as ``<git> http-backend``. `lost(device_id)`, asked for a device without a
    branch here, says why that is lost state (answered 503) or None for a device without
    desired state yet (404); the fleet server passes what its REST manifests use
    (`wfm.fleet.desired.DesiredState.missing_branch`: on a replica, what was published), and by
    default the compiler's state next to the repository is asked. `delivered(device_id,
    commit)` is told whenever an upload-pack exchange that wanted the branch's tip ended
    with Git's whole answer sent: the server attributes the device's later status reports
    to that commit when they do not name one themselves.
    """
    repository = Path(repository).absolute()
    server = _GitServer(repository, authorize, git,
                        lost or (lambda device_id: _recorded_loss(repository, device_id)),
                        delivered)
    return Router(routes=[
        Route(f"{_DEVICE}/info/refs", _Endpoint(server.info_refs)),
        Route(f"{_DEVICE}/{_UPLOAD_PACK}", _Endpoint(server.upload_pack)),
        Route(f"{_DEVICE}/git-receive-pack", _Endpoint(_read_only)),
        Route("/{path:path}", _Endpoint(_not_served)),
    ])


# --- routing ------------------------------------------------------------------------------


class _Endpoint:
    """A request -> response handler as a plain ASGI app. Why: Starlette routes plain
    functions for GET only and answers other methods with a text/plain 405; an ASGI app
    receives every method, so the handler answers with problem+json itself."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]]) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handler(Request(scope, receive, send))
        await response(scope, receive, send)


class _GitServer:
    """The two endpoints; everything they need to start one `_BackendExchange`."""

    def __init__(self, repository: Path, authorize: Authorize, git: str, lost: Lost,
                 delivered: Delivered | None) -> None:
        self.repository, self.authorize, self.git, self.lost = repository, authorize, git, lost
        self.delivered = delivered

    async def info_refs(self, request: Request) -> Response:
        """The ref advertisement (v0) or capability advertisement (v2) of upload-pack."""
        if request.method != "GET":
            return _method_not_allowed("GET")
        service = request.query_params.get("service")
        if service != _UPLOAD_PACK:
            return await _read_only(request) if service else _dumb_refused()
        return await self._serve(request, "info/refs", query="service=" + _UPLOAD_PACK)

    async def upload_pack(self, request: Request) -> Response:
        """One upload-pack exchange (a negotiation round or the pack itself)."""
        if request.method != "POST":
            return _method_not_allowed("POST")
        return await self._serve(request, _UPLOAD_PACK, query="")

    async def _serve(self, request: Request, service: str, *, query: str) -> Response:
        """Authorize, then 404 for devices without a branch, else hand over to Git."""
        device_id = request.path_params["device"]
        if not await _call_authorize(self.authorize, request, device_id):
            return _problem(401, f"credentials for device {device_id!r} are required",
                            headers={"WWW-Authenticate": f'Basic realm="{REALM}"'})
        try:
            ref = device_ref(device_id)
        except ValueError:
            return _problem(404, f"{device_id!r} is not a device id")
        tip = await asyncio.to_thread(_branch_tip, self.repository, ref)
        if tip is None:
            # A branch the compiler made and the repository lost is lost state, never an
            # empty repository (`wfm.fleet.desired.StateLost` has why).
            why = await asyncio.to_thread(self.lost, device_id)
            if why is not None:
                return _problem(503, why, headers={"Retry-After": str(STATE_LOST_RETRY)})
            return _problem(404, f"device {device_id!r} has no desired state yet")
        protocol = _protocol_version(request.headers.get("git-protocol", ""))
        encoding = request.headers.get("content-encoding")
        if encoding is not None and encoding.strip().lower() not in _GZIP_ENCODINGS:
            return _problem(415, f"request bodies may only be gzip-encoded, not {encoding!r}")
        gzipped = encoding is not None
        gate = _Gate(self.repository, tip, gzipped=gzipped) if service == _UPLOAD_PACK else None
        return _BackendExchange(_CgiRequest(
            git=self.git, repository=self.repository, ref=ref, device_id=device_id,
            service=service, method=request.method, query=query, protocol=protocol,
            content_type=request.headers.get("content-type"),
            content_length=request.headers.get("content-length"),
            # (upload-pack is given the gate's plain rewrite instead: `_cgi_environment`)
            content_encoding="gzip" if gzipped else None, gate=gate),
            delivered=self.delivered if gate is not None else None)


async def _call_authorize(authorize: Authorize, request: Request, device_id: str) -> bool:
    """Accept both sync and async hooks; anything but True is a refusal."""
    verdict = authorize(request, device_id)
    if inspect.isawaitable(verdict):
        verdict = await verdict
    return verdict is True


def _recorded_loss(repository: Path, device_id: str) -> str | None:
    """`lost` without a fleet server around: what the compiler's state next to the
    repository says the branch should be (`compiler.state.recorded_branch`)."""
    recorded = recorded_branch(repository.parent, device_id)
    if recorded is None:
        return None
    _log.error("device %r: its branch is missing or unreadable in %s (the last compile left "
               "it at %s)", device_id, repository, recorded)
    return (f"the desired state of device {device_id!r} is not available: its branch is "
            "missing from the server's repository, which needs repair")


def _branch_tip(repository: Path, ref: str) -> str | None:
    """The device branch's commit id, None without a branch (or without a repository yet:
    the first compile creates it)."""
    try:
        found = pygit2.Repository(str(repository)).references.get(ref)
        return None if found is None else str(found.peel(pygit2.Commit).id)
    except (pygit2.GitError, KeyError, ValueError):
        return None


def _protocol_version(header: str) -> int:
    """The version Git would pick from a ``Git-Protocol`` value (the highest known
    ``version=N`` item). Git is given only this normalised value: unknown keys and versions
    never reach it."""
    versions = [0]
    for item in header.split(":"):
        key, _, value = item.partition("=")
        if key == "version" and value in ("1", "2"):
            versions.append(int(value))
    return max(versions)


async def _read_only(_request: Request) -> Response:
    return _problem(403, "device repositories are read-only: git-receive-pack is not served")


def _dumb_refused() -> Response:
    return _problem(403, "only Git's smart HTTP protocol is served "
                         "(info/refs?service=git-upload-pack)")


async def _not_served(_request: Request) -> Response:
    return _problem(404, "not a Git endpoint of this server (clone "
                         "/git/devices/<device id>.git)")


def _method_not_allowed(allowed: str) -> Response:
    return _problem(405, f"use {allowed} here", headers={"Allow": allowed})


def _problem(status: int, detail: str, *, headers: Mapping[str, str] | None = None) -> Response:
    """An RFC 9457 problem response with the plain ``about:blank`` type."""
    body = {"type": "about:blank", "title": http.HTTPStatus(status).phrase, "status": status,
            "detail": detail}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}),
                        media_type="application/problem+json")


# --- request inspection -------------------------------------------------------------------


class _Refused(Exception):
    """A request Git must not see; `status` and the message become the problem answer."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


class _PktLines:
    """Incremental pkt-line splitter: feed any chunking, get complete packets back.

    Stricter than Git (which dies on the same input), never more lenient: a length must be
    four hex digits, 0000/0001/0002 are the special packets, 0003 and lengths beyond 65520
    are malformed, and a body may not end inside a packet.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[bytes, bytes | None]]:
        """The packets completed by `data`: (its bytes as sent, its payload or None for a
        special packet). The bytes are what is forwarded, so Git sees exactly what was sent."""
        self._buffer += data
        while len(self._buffer) >= 4:
            head = bytes(self._buffer[:4])
            if not _HEX4.fullmatch(head):
                raise _Refused(400, "malformed pkt-line in the request")
            length = int(head, 16)
            if length in (0, 1, 2):
                del self._buffer[:4]
                yield head, None
                continue
            if length == 3 or length > 65520:
                raise _Refused(400, "malformed pkt-line length in the request")
            if len(self._buffer) < length:
                return
            packet = bytes(self._buffer[:length])
            del self._buffer[:length]
            yield packet, packet[4:]

    def finish(self) -> None:
        """Refuse a body that ended inside a packet (Git would hang up on it too)."""
        if self._buffer:
            raise _Refused(400, "the request ends inside a pkt-line")


class _Inflater:
    """Streaming inverse of the request's Content-Encoding, in bounded pieces.

    It accepts gzip and zlib headers (``inflateInit2(.., 15 + 32)``) and exactly one
    compressed stream: ``git http-backend`` stops inflating at the end of the first one and
    drops the rest, so a body of two gzip members (or anything after the end) reached
    upload-pack cut short and was answered with an empty 200. Such a body, and one that
    ends inside the stream, is refused with 400 instead (Git's own client sends one member).
    """

    def __init__(self, gzipped: bool) -> None:
        self._inflate = zlib.decompressobj(15 + 32) if gzipped else None
        self.total = 0

    def feed(self, data: bytes, *, last: bool = False) -> Iterator[bytes]:
        """Decompressed pieces of at most `_CHUNK` bytes; refuses oversized requests, and
        (`last`: the body ends with `data`) bodies that are not exactly one stream."""
        for piece in self._pieces(data):
            self.total += len(piece)
            if self.total > MAX_REQUEST_BYTES:
                raise _Refused(413, f"upload-pack requests are limited to "
                                    f"{MAX_REQUEST_BYTES} bytes")
            yield piece
        if last and self._inflate is not None and not self._inflate.eof:
            raise _Refused(400, "the gzip-encoded request ends inside its compressed stream")

    def _pieces(self, data: bytes) -> Iterator[bytes]:
        if self._inflate is None:
            yield data
            return
        pending = data
        try:
            while not self._inflate.eof:
                piece = self._inflate.decompress(pending, _CHUNK)
                yield piece
                pending = self._inflate.unconsumed_tail
                if not pending and len(piece) < _CHUNK:
                    break
        except zlib.error as exc:
            raise _Refused(400, f"the gzip-encoded request is corrupt: {exc}") from None
        if self._inflate.eof and (self._inflate.unused_data or pending):
            raise _Refused(400, "the gzip-encoded request has data after the end of its "
                                "compressed stream (a second gzip member?); Git reads one")


class _Gate:
    """What of an upload-pack request Git may see: refuses requests that want objects that
    are not the device's, and makes ``have`` and ``shallow`` lines naming anything but a
    commit on the device's branch name a missing object instead (see the module docstring
    for what they leaked).

    Each chunk is decompressed and split into packets; only complete, checked packets are
    forwarded, so Git never receives a line that was not checked (nor a partial one).
    """

    def __init__(self, repository: Path, tip: str, *, gzipped: bool) -> None:
        self.branch = _Branch(repository, tip)
        self._inflater = _Inflater(gzipped)
        self._lines = _PktLines()
        #: The request wants the branch's tip: the exchange hands the device its newest state.
        self.wants_tip = False

    async def check(self, chunk: bytes, *, last: bool) -> bytes:
        """The part of the request completed by `chunk` that Git may see (decompressed);
        raises `_Refused` for a request Git must not see at all."""
        packets: list[tuple[bytes, bytes | None]] = []
        for piece in self._inflater.feed(chunk, last=last):
            packets.extend(self._lines.feed(piece))
        if last:
            self._lines.finish()
        wants: set[str] = set()
        claimed: set[str] = set()
        kept: list[tuple[bytes, _Line]] = []
        for packet, payload in packets:
            line = _Line.parse(payload)
            wants |= line.wants
            if line.claims is not None:
                claimed.add(line.claims)
            kept.append((packet, line))
        self.wants_tip = self.wants_tip or self.branch.tip in wants
        if not wants and not claimed:
            return b"".join(packet for packet, _ in kept)
        foreign, own = await asyncio.to_thread(self.branch.sort, wants, claimed)
        if foreign:
            raise _Refused(403, f"object {min(foreign)} is not part of this device's state")
        return b"".join(packet if line.claims is None or line.claims in own
                        else _pkt_line(line.keyword + _MISSING) for packet, line in kept)


def _pkt_line(payload: bytes) -> bytes:
    return b"%04x" % (len(payload) + 4) + payload


#: What a ``have`` or ``shallow`` line naming another device's object becomes: the null id,
#: which no object has, so Git answers exactly as for any id it lacks. (Not dropped: a v2
#: request whose haves all vanished would get a pack where the client expects
#: acknowledgments.)
_MISSING = b" " + b"0" * 40 + b"\n"


@dataclass(frozen=True, slots=True)
class _Line:
    """What one request line asks of upload-pack: the objects it `wants`, the object it
    `claims` the caller has (``have``) or is shallow at (``shallow``), that `keyword`."""

    wants: frozenset[str] = frozenset()
    claims: str | None = None
    keyword: bytes = b""

    @classmethod
    def parse(cls, payload: bytes | None) -> _Line:
        """Refuses v2 commands and arguments that could reach beyond the device's branch,
        and malformed lines naming objects (Git would die on them)."""
        if payload is None:
            return _NOTHING
        line = payload[:-1] if payload.endswith(b"\n") else payload  # PACKET_READ_CHOMP_NEWLINE
        if line.startswith(b"command=") and line[len(b"command="):] not in _V2_COMMANDS:
            raise _Refused(403, f"protocol v2 {line.decode('ascii', 'replace')!r} is not served")
        if line.startswith(_REFUSED_V2_ARGS):
            raise _Refused(403, f"{line.split(b' ')[0].decode()!r} is not served")
        keyword, _, rest = line.partition(b" ")
        if keyword not in _NAMING_OBJECTS:
            return _NOTHING
        # Git's get_oid_hex reads 40 hex digits of either case, ignores the rest (v0 want
        # lines carry capabilities after the id)
        oid = rest[:40]
        if not _OID_HEX.fullmatch(oid):
            raise _Refused(400, f"malformed {keyword.decode()} line in the request")
        name = oid.decode("ascii").lower()
        if keyword == b"want":
            return cls(wants=frozenset({name}))
        return cls(claims=name, keyword=keyword)


_NOTHING = _Line()
_NAMING_OBJECTS = frozenset({b"want", b"have", b"shallow"})


class _Branch:
    """The objects of one device branch, for the gate's questions. Used from one worker
    thread at a time (the gate awaits each answer), with its own Repository.

    The branch's commits are walked lazily from the tip and remembered: clients send their
    haves newest first, so a fetch that shares history walks only down to the newest common
    commit; a foreign id costs one walk of the whole branch per request, never more.
    """

    def __init__(self, repository: Path, tip: str) -> None:
        self.repository, self.tip = repository, tip
        self._repo: pygit2.Repository | None = None
        self._walk: Iterator[pygit2.Commit] | None = None
        self._commits: set[str] = set()
        self._current: set[str] | None = None

    def sort(self, wants: Iterable[str], claimed: Iterable[str]) -> tuple[set[str], set[str]]:
        """(the wanted ids that are not the device's, the claimed ids that are commits on
        its branch). A want may be a commit on the branch, or the tip's tree or one of its
        (flat) entries: what a partial clone fetches lazily."""
        foreign = {w for w in wants if not self._on_branch(w) and w not in self._tip_tree()}
        return foreign, {c for c in claimed if self._on_branch(c)}

    def _on_branch(self, oid: str) -> bool:
        while oid not in self._commits:
            if self._walk is None:
                self._walk = iter(self._repository().walk(pygit2.Oid(hex=self.tip)))
            commit = next(self._walk, None)
            if commit is None:
                return False
            self._commits.add(str(commit.id))
        return True

    def _tip_tree(self) -> set[str]:
        if self._current is None:
            tree = self._repository()[pygit2.Oid(hex=self.tip)].peel(pygit2.Tree)
            self._current = {str(tree.id)} | {str(entry.id) for entry in tree}
        return self._current

    def _repository(self) -> pygit2.Repository:
        if self._repo is None:
            self._repo = pygit2.Repository(str(self.repository))
        return self._repo


# --- running git http-backend -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _CgiRequest:
    """Everything one ``git http-backend`` run needs from the HTTP request."""

    git: str
    repository: Path
    ref: str
    device_id: str
    service: str
    method: str
    query: str
    protocol: int
    content_type: str | None
    content_length: str | None
    content_encoding: str | None
    gate: _Gate | None


class _ClientGone(Exception):
    """The client disconnected; there is nobody left to answer."""


class _BackendExchange(Response):
    """Runs ``git http-backend`` for one request, streaming both ways.

    A Response subclass because it needs the raw ASGI channel: the request body goes to Git
    while it arrives, Git's output goes out while it is produced, and a disconnect must be
    noticed while Git is still working.
    """

    def __init__(self, cgi: _CgiRequest, delivered: Delivered | None = None) -> None:
        super().__init__(status_code=200)
        self.cgi, self.delivered = cgi, delivered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        with tempfile.TemporaryDirectory(prefix="margo-githttp-") as root:
            view_root = Path(root)
            _make_view(view_root, self.cgi.repository, self.cgi.ref)
            try:
                process = await _spawn(self.cgi, view_root)
            except OSError as exc:
                _log.error("cannot run %r: %s", self.cgi.git, exc)
                await _problem(503, "Git is not available on the server")(scope, receive, send)
                return
            try:
                async with asyncio.timeout(PROCESS_TIMEOUT):
                    sent = await _exchange(self.cgi, process, scope, receive, tracking_send)
                self._tell_delivered(sent, process)
            except TimeoutError:
                _log.warning("git %s for device %r killed after %.0f s", self.cgi.service,
                             self.cgi.device_id, PROCESS_TIMEOUT)
                if not started:
                    await _problem(504, "Git took too long")(scope, receive, send)
            except _ClientGone:
                _log.info("client of device %r went away during git %s", self.cgi.device_id,
                          self.cgi.service)
            finally:
                await _reap(process)


    def _tell_delivered(self, sent: bool, process: asyncio.subprocess.Process) -> None:
        """After Git's whole answer went out and Git succeeded: tell who wants to know that
        the device was handed its branch's tip (a hook that fails is logged, never the
        device's problem)."""
        gate = self.cgi.gate
        if not (sent and process.returncode == 0 and self.delivered is not None
                and gate is not None and gate.wants_tip):
            return
        try:
            self.delivered(self.cgi.device_id, gate.branch.tip)
        except Exception:  # a defect in the hook: the exchange itself went well
            _log.exception("recording what device %r was handed out failed",
                           self.cgi.device_id)


def _make_view(root: Path, repository: Path, ref: str) -> Path:
    """``<root>/device.git``: HEAD -> the device branch, everything else from `repository`."""
    view = root / _VIEW_NAME
    view.mkdir()
    (view / "HEAD").write_text(f"ref: {ref}\n", encoding="ascii")
    (view / "commondir").write_text(f"{repository}\n", encoding="utf-8")
    return view


def _cgi_environment(cgi: _CgiRequest, view_root: Path) -> dict[str, str]:
    """Our environment without GIT_* (which could redirect or reconfigure Git; traces are
    kept for debugging) plus the CGI variables and this device's configuration."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GIT_") or k.startswith("GIT_TRACE")}
    env.update(GIT_PROJECT_ROOT=str(view_root), GIT_HTTP_EXPORT_ALL="1",
               PATH_INFO=f"/{_VIEW_NAME}/{cgi.service}", REQUEST_METHOD=cgi.method,
               QUERY_STRING=cgi.query, GATEWAY_INTERFACE="CGI/1.1",
               REMOTE_USER=cgi.device_id)
    optional = {"CONTENT_TYPE": cgi.content_type, "CONTENT_LENGTH": cgi.content_length,
                "HTTP_CONTENT_ENCODING": cgi.content_encoding,
                "GIT_PROTOCOL": f"version={cgi.protocol}" if cgi.protocol else None}
    if cgi.gate is not None:
        # Git reads the gate's rewrite, plain and of its own length, up to EOF; the limit on
        # what http-backend buffers is then ours (its default of 10 MiB applied to the
        # compressed body before).
        del optional["CONTENT_LENGTH"], optional["HTTP_CONTENT_ENCODING"]
    env.update({k: v for k, v in optional.items() if v is not None})
    config = [("uploadpack.hideRefs", "refs/"), ("uploadpack.hideRefs", f"!{cgi.ref}"),
              *_FORCED_CONFIG, ("http.maxRequestBuffer", str(MAX_REQUEST_BYTES))]
    env["GIT_CONFIG_COUNT"] = str(len(config))
    for i, (key, value) in enumerate(config):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    return env


async def _spawn(cgi: _CgiRequest, view_root: Path) -> asyncio.subprocess.Process:
    """Start ``git http-backend`` in its own process group (so `_reap` also ends the
    ``upload-pack`` and ``pack-objects`` it starts)."""
    return await asyncio.create_subprocess_exec(
        cgi.git, "http-backend", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=_cgi_environment(cgi, view_root), cwd=view_root, start_new_session=True,
        limit=_MAX_CGI_HEAD)


async def _exchange(cgi: _CgiRequest, process: asyncio.subprocess.Process, scope: Scope,
                    receive: Receive, send: Send) -> bool:
    """Feed the body, relay Git's CGI answer; a refused request is answered by us. Whether
    Git's whole answer was sent and Git has exited."""
    assert process.stdin and process.stdout and process.stderr
    stderr = asyncio.create_task(_collect_stderr(process.stderr))
    feeder = asyncio.create_task(_feed(receive, process.stdin, cgi))
    head = asyncio.create_task(_read_cgi_head(process.stdout))
    try:
        try:
            # Both must finish: the head comes first (http-backend writes it before reading),
            # and nothing is relayed before the whole body passed the gate.
            done, _ = await asyncio.wait({feeder, head}, return_when=asyncio.FIRST_EXCEPTION)
            errors = [task.exception() for task in (feeder, head) if task in done]
            if error := next((e for e in errors if e is not None), None):
                raise error
            status, headers = head.result()
        except _Refused as refusal:
            _kill(process)
            _log.warning("git %s for device %r not run: %s", cgi.service, cgi.device_id,
                         refusal)
            await _problem(refusal.status, str(refusal))(scope, receive, send)
            return False
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if await _pump(process.stdout, receive, send):
            await process.wait()
            return status == 200
        return False
    finally:
        feeder.cancel()
        head.cancel()
        await _log_stderr(cgi, stderr, process)


async def _feed(receive: Receive, stdin: asyncio.StreamWriter, cgi: _CgiRequest) -> None:
    """Copy the request body into Git's stdin as it arrives, each chunk as the gate
    rewrote it; stdin is closed only after a complete, accepted body."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        last = not message.get("more_body", False)
        if cgi.gate is not None:
            chunk = await cgi.gate.check(chunk, last=last)
        if chunk and not await write_to_backend(stdin, chunk):
            return  # Git stopped reading: its own answer says why
        if last:
            break
    stdin.close()


async def _read_cgi_head(stdout: asyncio.StreamReader) -> tuple[int, list[tuple[bytes, bytes]]]:
    """Parse the CGI header block: ``Status:`` becomes the status code, the rest are passed
    on as response headers."""
    status, headers = 200, []
    while True:
        try:
            line = await stdout.readuntil(b"\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            raise _Refused(502, "git http-backend gave no valid CGI response") from None
        line = line.rstrip(b"\r\n")
        if not line:
            return status, headers
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        if name == b"status":
            status = int(value.split()[0]) if value[:3].isdigit() else 502
        elif name:
            headers.append((name, value))


async def _pump(stdout: asyncio.StreamReader, receive: Receive, send: Send) -> bool:
    """Relay Git's output; False if the client disconnected first (Git is then killed)."""
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        while True:
            read = asyncio.ensure_future(stdout.read(_CHUNK))
            await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                read.cancel()
                return False
            chunk = read.result()
            if not chunk:
                break
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
    finally:
        gone.cancel()


async def _disconnect(receive: Receive) -> None:
    """Return when the client disconnects (any leftover body messages are dropped)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _collect_stderr(stderr: asyncio.StreamReader) -> bytes:
    """Git's diagnostics, the first `_STDERR_KEPT` bytes kept; read to the end so a chatty
    Git never blocks on a full pipe."""
    kept = bytearray()
    while chunk := await stderr.read(_CHUNK):
        kept += chunk[: max(0, _STDERR_KEPT - len(kept))]
    return bytes(kept)


async def _log_stderr(cgi: _CgiRequest, stderr: asyncio.Task[bytes],
                      process: asyncio.subprocess.Process) -> None:
    """Log what Git said on stderr (refusals like "not our ref" land here); the diagnostics
    of a Git we are about to kill are dropped."""
    if process.returncode is None:
        stderr.cancel()
        return
    text = (await stderr).decode("utf-8", "replace").strip()
    if text:
        _log.warning("git %s for device %r: %s", cgi.service, cgi.device_id, text)


def _kill(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the whole process group while its leader is unreaped (so the id is ours)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


async def _reap(process: asyncio.subprocess.Process) -> None:
    """Kill the Git processes unless they finished, and wait for the leader."""
    _kill(process)
    with contextlib.suppress(ProcessLookupError):
        await asyncio.shield(process.wait())
