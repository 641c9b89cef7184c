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

Waiting polls. The ref advertisement carries an ETag; a request naming it in
`If-None-Match` is answered 304, held first when it carries `Prefer: wait=N`
(`wfm.git.refwaits`). Git never sends either header.

The module's parts: the endpoints here; what an upload-pack request may name
(`wfm.git.upload_gate`); running ``git http-backend`` (`wfm.git.backend`); the ref
advertisement's validator and waiting polls (`wfm.git.refwaits`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import pygit2
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from compiler.gitstore import device_ref
from compiler.recorded import recorded_branch
from wfm.admission.parking import raise_parked_failure
from wfm.fleet.desired import STATE_LOST_RETRY
from wfm.fleet.waiters import Rewind
from wfm.git.backend import BackendExchange, CgiRequest, Delivered, problem
from wfm.git.refwaits import RefWaits
from wfm.git.upload_gate import Gate
from wfm.problems import ProblemError

__all__ = ["REALM", "Authorize", "Lost", "git_app"]

#: A hook deciding whether the request may read device ``device_id``'s state.
Authorize = Callable[[Request, str], Awaitable[bool] | bool]
#: For a device without a branch: why that is lost state (503), or None (no state yet: 404).
Lost = Callable[[str], str | None]

#: The Basic-auth realm announced with 401 answers.
REALM = "margo-gitops"
_UPLOAD_PACK = "git-upload-pack"
_DEVICE = "/devices/{device:path}.git"
_GZIP_ENCODINGS = frozenset({"gzip", "x-gzip"})

#: The logger's name is the one operators filter on (kept when the module moved).
_log = logging.getLogger("wfm.githttp")


def git_app(repository: str | os.PathLike[str], authorize: Authorize, *,
            git: str = "git", lost: Lost | None = None,
            delivered: Delivered | None = None, waits: RefWaits | None = None) -> ASGIApp:
    """The ASGI app serving every device's branch of `repository` (mount it at ``/git``).

    `repository` is the shared bare repository (``<repos>/fleet-state.git``); `git` is the
    program run as ``<git> http-backend``. `lost(device_id)`, asked for a device without a
    branch here, says why that is lost state (answered 503) or None for a device without
    desired state yet (404); the fleet server passes what its REST manifests use
    (`wfm.fleet.desired.DesiredState.missing_branch`: on a replica, what was published), and by
    default the compiler's state next to the repository is asked. `delivered(device_id,
    commit)` is told whenever an upload-pack exchange that wanted the branch's tip ended
    with Git's whole answer sent: the server attributes the device's later status reports
    to that commit when they do not name one themselves. `waits`: the server's waiting
    polls, which conditional ref advertisements are held in (without: answered at once).
    """
    repository = Path(repository).absolute()
    server = _GitServer(repository, authorize, git,
                        lost or (lambda device_id: _recorded_loss(repository, device_id)),
                        delivered, waits or RefWaits())
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
        rewind = Rewind(receive)  # a held ref advertisement's watch keeps what it read
        response = await self.handler(Request(scope, rewind, send))
        await response(scope, rewind, send)


class _GitServer:
    """The two endpoints; everything they need to start one `BackendExchange`."""

    def __init__(self, repository: Path, authorize: Authorize, git: str, lost: Lost,
                 delivered: Delivered | None, waits: RefWaits) -> None:
        self.repository, self.authorize, self.git, self.lost = repository, authorize, git, lost
        self.delivered, self.waits = delivered, waits

    async def info_refs(self, request: Request) -> Response:
        """The ref advertisement (v0) or capability advertisement (v2) of upload-pack."""
        if request.method != "GET":
            return _method_not_allowed("GET")
        raise_parked_failure(request.scope)  # a held advertisement whose hold failed
        service = request.query_params.get("service")
        if service != _UPLOAD_PACK:
            return await _read_only(request) if service else _dumb_refused()
        return await self._serve(request, "info/refs", query="service=" + _UPLOAD_PACK)

    async def upload_pack(self, request: Request) -> Response:
        """One upload-pack exchange (a negotiation round or the pack itself)."""
        if request.method != "POST":
            return _method_not_allowed("POST")
        return await self._serve(request, _UPLOAD_PACK, query="")

    async def _serve(self, request: Request, service: str, query: str,
                     applied: str | None = None) -> Response:
        """Authorize, then 404 for devices without a branch, else hand over to Git (a ref
        advertisement may be answered 304 or held first: `wfm.git.refwaits`; `applied`:
        served again after it was held)."""
        device_id = request.path_params["device"]
        if not await _call_authorize(self.authorize, request, device_id):
            return problem(401, f"credentials for device {device_id!r} are required",
                            headers={"WWW-Authenticate": f'Basic realm="{REALM}"'})
        try:
            ref = device_ref(device_id)
        except ValueError:
            return problem(404, f"{device_id!r} is not a device id")
        since = self.waits.mark()
        tip = await asyncio.to_thread(_branch_tip, self.repository, ref)
        if tip is None:
            # A branch the compiler made and the repository lost is lost state, never an
            # empty repository (`wfm.fleet.desired.StateLost` has why).
            why = await asyncio.to_thread(self.lost, device_id)
            if why is not None:
                return problem(503, why, headers={"Retry-After": str(STATE_LOST_RETRY)})
            # Read again: a compile may have moved the branches since (`missing_branch`).
            tip = await asyncio.to_thread(_branch_tip, self.repository, ref)
        if tip is None:
            return problem(404, f"device {device_id!r} has no desired state yet")
        extra: list[tuple[bytes, bytes]] = []
        if service == "info/refs":
            answer = await self.waits.answer(
                request, device_id, ref, tip, since=since, applied=applied,
                tip_of=partial(asyncio.to_thread, _branch_tip, self.repository, ref),
                fresh=partial(self._serve, request, service, query),
                authorized=partial(_still_authorized, self.authorize, request, device_id))
            if isinstance(answer, Response):
                return answer
            extra = answer
        protocol = _protocol_version(request.headers.get("git-protocol", ""))
        encoding = request.headers.get("content-encoding")
        if encoding is not None and encoding.strip().lower() not in _GZIP_ENCODINGS:
            return problem(415, f"request bodies may only be gzip-encoded, not {encoding!r}")
        gzipped = encoding is not None
        gate = Gate(self.repository, tip, gzipped=gzipped) if service == _UPLOAD_PACK else None
        return BackendExchange(CgiRequest(
            git=self.git, repository=self.repository, ref=ref, device_id=device_id,
            service=service, method=request.method, query=query, protocol=protocol,
            content_type=request.headers.get("content-type"),
            content_length=request.headers.get("content-length"),
            # (upload-pack is given the gate's plain rewrite instead: `_cgi_environment`)
            content_encoding="gzip" if gzipped else None, gate=gate),
            delivered=self.delivered if gate is not None else None, headers=extra)


async def _still_authorized(authorize: Authorize, request: Request, device_id: str) -> None:
    """A held advertisement's caller, authorized again (credentials changed meanwhile):
    refused as a request arriving now would be."""
    if not await _call_authorize(authorize, request, device_id):
        raise ProblemError(401, f"credentials for device {device_id!r} are required",
                           headers={"WWW-Authenticate": f'Basic realm="{REALM}"'})


async def _call_authorize(authorize: Authorize, request: Request, device_id: str) -> bool:
    """Accept both sync and async hooks; anything but True is a refusal."""
    verdict = authorize(request, device_id)
    if inspect.isawaitable(verdict):
        verdict = await verdict
    return verdict is True


def _recorded_loss(repository: Path, device_id: str) -> str | None:
    """`lost` without a fleet server around: what the compiler's state next to the
    repository says the branch should be (`compiler.recorded.recorded_branch`)."""
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
    return problem(403, "device repositories are read-only: git-receive-pack is not served")


def _dumb_refused() -> Response:
    return problem(403, "only Git's smart HTTP protocol is served "
                         "(info/refs?service=git-upload-pack)")


async def _not_served(_request: Request) -> Response:
    return problem(404, "not a Git endpoint of this server (clone "
                         "/git/devices/<device id>.git)")


def _method_not_allowed(allowed: str) -> Response:
    return problem(405, f"use {allowed} here", headers={"Allow": allowed})
