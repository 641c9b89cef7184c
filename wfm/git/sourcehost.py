"""A fleet-source repository hosted by the server: platform engineers `git push` to it.

`margo serve --host-source` keeps `<data>/hosted-source.git` and serves it at
`/git/source.git` for fetch and push (HTTP basic, password = the operator token). A push
that updates the compiled branch triggers a compile as soon as it is accepted. Pushes are
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
from wfm.fleet.sources import git_environment
from wfm.git.backend import BACKEND_GONE, write_to_backend
from wfm.git.receivehook import HOOK_NAME, hook_script
from wfm.identity.credentials import parse_basic, same_secret
from wfm.problems import ProblemError, problem_response
from wfm.telemetry.metrics import PUSHES

if TYPE_CHECKING:
    from wfm.fleet.coordination import Coordinator

__all__ = ["ensure_repository", "source_app"]

MAX_PUSH_BYTES = 64 * 1024 * 1024
_SERVICES = ("git-upload-pack", "git-receive-pack")
#: A ref the push's report says was not updated (`ng <ref> <why>`, pkt-line framed).
_REFUSED = re.compile(rb"(?:^|[^g-zA-Z])ng refs/")


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


def _authorized(request: Request, admin_token: str | None) -> bool:
    if not admin_token:
        return False
    pair = parse_basic(request.headers.get("authorization", ""))
    return pair is not None and same_secret(pair[1], admin_token)


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


def source_app(repository: Path, admin_token: str | None, on_push: Callable[[float], None], *,
               replicas: Callable[[], Coordinator | None] = lambda: None) -> ASGIApp:
    """Fetch and push for the hosted source repository (mount at `/git/source.git`). With
    `replicas` (its coordinator, once the server runs), a fetch first brings the repository
    up to what the replicas published, and a push runs in this replica's turn at the source
    and is published before the next push starts (`wfm.fleet.coordination.SourceUpdate`).
    `on_push(arrived)`: a push was accepted; `arrived`, when its request came (Unix time)."""

    async def endpoint(request: Request) -> Response:
        arrived = time.time()
        rest = request.path_params["rest"]
        service = request.query_params.get("service") or rest.rsplit("/", 1)[-1]
        if not _authorized(request, admin_token):
            error = ProblemError(401, "the operator token is required (HTTP basic password)",
                                 headers={"WWW-Authenticate": 'Basic realm="margo-gitops"'})
            return problem_response(error, instance=request.url.path)
        if service not in _SERVICES or rest not in ("info/refs", *_SERVICES):
            return problem_response(ProblemError(404, "only smart HTTP is served"),
                                    instance=request.url.path)
        coordinator = replicas()
        pushing = rest == "git-receive-pack" or service == "git-receive-pack"
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
            if isinstance(exc, ClientDisconnect):
                raise  # wfm.server.app logs it in one line
            return problem_response(exc, instance=request.url.path)
        if turn is not None:
            await run_in_threadpool(turn.finish, publish=rest == "git-receive-pack"
                                    and status == 200)
        if rest == "git-receive-pack":
            PUSHES.labels("failed" if status != 200 else "refused"
                          if _REFUSED.search(payload) else "accepted").inc()
        if rest == "git-receive-pack" and status == 200:
            on_push(arrived)  # the pushed refs are in place once receive-pack has answered
        return Response(payload, status_code=status, headers=headers)

    return Router(routes=[Route("/{rest:path}", endpoint, methods=["GET", "POST"])])
