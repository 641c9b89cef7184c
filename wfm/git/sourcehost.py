"""A fleet-source repository hosted by the server: platform engineers `git push` to it.

`margo serve --host-source` keeps `<data>/hosted-source.git` and serves it at
`/git/source.git` for fetch and push (HTTP basic, the password an operator credential: the
admin token, a registered operator's token or an OIDC token; fetching needs the viewer role,
pushing the operator role). A push that updates the compiled branch triggers a compile as
soon as it is accepted; each push is recorded in the audit trail (accepted, refused by the
hook or below the role, failed). Pushes are
small (descriptors and intents), so request and response bodies are buffered here, unlike
the streaming device hosting in `wfm.git.githttp`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import ASGIApp

from compiler.stalelocks import recover_stale_locks
from margo.files import write_atomically
from wfm.fleet.audit import FAILED, OK, REFUSED, Auditor
from wfm.fleet.sources import git_environment
from wfm.git.backend import BACKEND_GONE, write_to_backend
from wfm.git.receivehook import HOOK_NAME, hook_script
from wfm.identity.credentials import parse_basic
from wfm.identity.operators import (
    Operator,
    OperatorAuth,
    Role,
    bearer_token,
    caller_address,
    refusal,
)
from wfm.problems import ProblemError, problem_response
from wfm.telemetry.metrics import PUSHES

if TYPE_CHECKING:
    from wfm.fleet.coordination import Coordinator

__all__ = ["ensure_repository", "source_app"]

MAX_PUSH_BYTES = 64 * 1024 * 1024
_SERVICES = ("git-upload-pack", "git-receive-pack")
#: Each ref of the push's report (pkt-line framed): `ok <ref>`, or `ng <ref> <why>` for one
#: that was not updated.
_REPORTED = re.compile(rb"(?:^|[^g-zA-Z])(ok|ng) (refs/[^\s\x00]+)(?: ([^\n\x00]*))?")


def ensure_repository(path: Path, branch: str = "main") -> None:
    """Create the hosted bare repository on first use, and (re)install the hook that refuses
    a push to `branch` the compiler could not read (`wfm.git.receivehook`): written at every
    start, so it always runs this server's interpreter."""
    if not (path / "HEAD").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(path)], check=True,
                       env=git_environment())
    hooks = path / "hooks"
    hooks.mkdir(exist_ok=True)
    write_atomically(hooks / HOOK_NAME, hook_script(f"refs/heads/{branch}"), mode=0o755)


def _caller(request: Request, auth: OperatorAuth) -> Operator | None:
    """Who the request's credential proves: Git sends it as the HTTP basic password (the
    user name is not read), a tool may send it as a bearer token. Nobody on a server with
    no operator credentials: its hosted source cannot be pushed to by anyone."""
    if auth.open:
        return None
    pair = parse_basic(request.headers.get("authorization", ""))
    return auth.authenticate(pair[1] if pair is not None else bearer_token(request))


class _BelowRole(ProblemError):
    """403: a known caller below the role a request needs (a push's is audited)."""

    def __init__(self, caller: Operator, role: Role, pushing: bool) -> None:
        refused = refusal(caller, role, "pushing" if pushing else "fetching")
        super().__init__(403, refused.detail)
        self.caller, self.pushing = caller, pushing


def _admit(request: Request, auth: OperatorAuth, rest: str) -> tuple[Operator, bool]:
    """(caller, whether it pushes) of a request the caller may make: fetching needs the
    viewer role, pushing the operator role. ProblemError otherwise (401, 404, 403)."""
    service = request.query_params.get("service") or rest.rsplit("/", 1)[-1]
    caller = _caller(request, auth)
    if caller is None:
        raise ProblemError(401, "an operator credential is required (the HTTP basic "
                           "password)", headers={"WWW-Authenticate":
                                                 'Basic realm="margo-gitops"'})
    if service not in _SERVICES or rest not in ("info/refs", *_SERVICES):
        raise ProblemError(404, "only smart HTTP is served")
    pushing = rest == "git-receive-pack" or service == "git-receive-pack"
    needed = Role.OPERATOR if pushing else Role.VIEWER
    if not caller.may(needed):
        raise _BelowRole(caller, needed, pushing)
    return caller, pushing


async def _audited(audit: Auditor | None, request: Request, caller: Operator, outcome: str,
                   detail: str) -> None:
    if audit is not None:
        await audit.record(caller, "source.push", "source.git", outcome=outcome,
                           detail=detail, address=caller_address(request))


def _push_outcome(status: int, payload: bytes) -> tuple[str, str, str]:
    """(the pushes metric's label, the audit outcome, what the report says of each ref)."""
    if status != 200:
        return "failed", FAILED, f"git answered {status}"
    reported = _REPORTED.findall(payload)
    detail = "; ".join(f"{ref.decode(errors='replace')} " + (
        "updated" if verdict == b"ok" else
        f"refused: {(why or b'').decode(errors='replace').strip()}")
        for verdict, ref, why in reported) or "no ref reported"
    if any(verdict == b"ng" for verdict, _, _ in reported):
        return "refused", REFUSED, detail
    return "accepted", OK, detail


async def _run_backend(repository: Path, request: Request, rest: str) -> tuple[int, dict[str, str],
                                                                               bytes]:
    body = await request.body()
    if len(body) > MAX_PUSH_BYTES:
        raise ProblemError(413, f"pushes are limited to {MAX_PUSH_BYTES} bytes")
    env = {**git_environment(), "GIT_PROJECT_ROOT": str(repository.parent),
           "GIT_HTTP_EXPORT_ALL": "1",
           "PATH_INFO": f"/{repository.name}/{rest}", "REQUEST_METHOD": request.method,
           "QUERY_STRING": request.url.query, "CONTENT_LENGTH": str(len(body)),
           "CONTENT_TYPE": request.headers.get("content-type", ""), "REMOTE_USER": "operator",
           "GIT_CONFIG_COUNT": "2", "GIT_CONFIG_KEY_0": "http.receivepack",
           "GIT_CONFIG_VALUE_0": "true", "GIT_CONFIG_KEY_1": "receive.denyDeletes",
           "GIT_CONFIG_VALUE_1": "true"}
    if request.headers.get("content-encoding"):
        env["HTTP_CONTENT_ENCODING"] = request.headers["content-encoding"]
    if request.headers.get("git-protocol"):
        env["GIT_PROTOCOL"] = request.headers["git-protocol"]
    process = await asyncio.create_subprocess_exec(
        "git", "http-backend", env=env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out = await asyncio.wait_for(_communicate(process, body), timeout=300)
    except TimeoutError:
        process.kill()
        raise ProblemError(504, "git did not finish in time") from None
    head, _, payload = out.partition(b"\r\n\r\n")
    if not _:
        head, _, payload = out.partition(b"\n\n")
    status, headers = 200, {}
    for line in head.decode("latin-1").splitlines():
        name, _, value = line.partition(":")
        if name.lower() == "status":
            status = int(value.strip().split()[0])
        elif name:
            headers[name.strip()] = value.strip()
    return status, headers, payload


async def _communicate(process: asyncio.subprocess.Process, body: bytes) -> bytes:
    """`process.communicate(body)`'s stdout, except that a backend that exits without
    reading its input (a request it answers at once, such as a refusal) is no error: its
    output says what happened. (With uvloop, writing to a pipe whose reader has exited
    raises RuntimeError, which `communicate` lets through as a server error: see
    `wfm.git.backend.BACKEND_GONE`.)"""
    stdin, stdout, stderr = process.stdin, process.stdout, process.stderr
    assert stdin is not None and stdout is not None and stderr is not None

    async def feed() -> None:
        if body:
            await write_to_backend(stdin, body)  # if it has exited, its output tells why
        with contextlib.suppress(*BACKEND_GONE):
            stdin.close()

    _, out, _ = await asyncio.gather(feed(), stdout.read(), stderr.read())
    await process.wait()
    return out


def source_app(repository: Path, auth: OperatorAuth, on_push: Callable[[float], None], *,
               replicas: Callable[[], Coordinator | None] = lambda: None,
               audit: Auditor | None = None) -> ASGIApp:
    """Fetch (the viewer role) and push (the operator role) for the hosted source
    repository (mount at `/git/source.git`). With `replicas` (its coordinator, once the
    server runs), a fetch first brings the repository up to what the replicas published,
    and a push runs in this replica's turn at the source and is published before the next
    push starts (`wfm.fleet.coordination.SourceUpdate`). `on_push(arrived)`: a push was
    accepted; `arrived`, when its request came (Unix time). `audit`: where each push (and
    each refused below the role) is recorded."""

    async def endpoint(request: Request) -> Response:
        arrived = time.time()
        rest = request.path_params["rest"]
        try:
            caller, pushing = _admit(request, auth, rest)
        except ProblemError as exc:
            if isinstance(exc, _BelowRole) and exc.pushing:
                await _audited(audit, request, exc.caller, REFUSED, exc.detail)
            return problem_response(exc, instance=request.url.path)
        coordinator = replicas()
        turn = coordinator.source_update() if coordinator is not None and pushing else None
        try:
            if turn is not None:
                await run_in_threadpool(turn.begin)
            elif coordinator is not None:
                await run_in_threadpool(coordinator.sync_source)
            if pushing:  # a push killed with the server left its lock: not every push after
                await run_in_threadpool(recover_stale_locks, repository)
            status, headers, payload = await _run_backend(repository, request, rest)
        except (ProblemError, ClientDisconnect) as exc:
            if turn is not None:  # the replicas' turn at the source ends either way
                await run_in_threadpool(turn.finish, publish=False)
            if rest == "git-receive-pack":
                await _audited(audit, request, caller, FAILED,
                               str(exc) or "the client went away")
            if isinstance(exc, ClientDisconnect):
                raise  # wfm.server.app logs it in one line
            return problem_response(exc, instance=request.url.path)
        if turn is not None:
            await run_in_threadpool(turn.finish, publish=rest == "git-receive-pack"
                                    and status == 200)
        if rest == "git-receive-pack":
            label, outcome, detail = _push_outcome(status, payload)
            PUSHES.labels(label).inc()
            await _audited(audit, request, caller, outcome, detail)
        if rest == "git-receive-pack" and status == 200:
            on_push(arrived)  # the pushed refs are in place once receive-pack has answered
        return Response(payload, status_code=status, headers=headers)

    return Router(routes=[Route("/{rest:path}", endpoint, methods=["GET", "POST"])])
