"""Running ``git http-backend`` for one device request, streaming both ways.

The request body is streamed into ``http-backend``'s stdin (through the upload gate,
`wfm.git.upload_gate`) and its output is streamed back (packs are never held in memory); no
shell is involved and inherited ``GIT_*`` variables are dropped (except ``GIT_TRACE*``). Each
request runs against a throw-away view directory whose HEAD is the device's branch. The
process group is killed when the client disconnects or after `PROCESS_TIMEOUT` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import os
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from wfm.git import upload_gate
from wfm.git.upload_gate import CHUNK, Gate, Refused

__all__ = ["BACKEND_GONE", "PROCESS_TIMEOUT", "BackendExchange", "CgiRequest", "Delivered",
           "problem", "write_to_backend"]

#: Told (device id, commit) after an upload-pack exchange that sent the device its branch's
#: tip completed: what the device was last handed out (`wfm.fleet.attribution`).
Delivered = Callable[[str, str], None]

#: Seconds one Git exchange may take before its processes are killed.
PROCESS_TIMEOUT = 300.0
#: What writing to a Git backend that has exited raises: BrokenPipeError or
#: ConnectionResetError with asyncio's own loop, RuntimeError ("the handler is closed")
#: with uvloop, which the server runs on.
BACKEND_GONE = (BrokenPipeError, ConnectionResetError, RuntimeError)
_MAX_CGI_HEAD = 64 * 1024
_STDERR_KEPT = 8 * 1024
_VIEW_NAME = "device.git"
# Settings every exchange runs with, after the per-device hideRefs pair (`wfm.git.githttp`: why).
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


async def write_to_backend(stdin: asyncio.StreamWriter, data: bytes) -> bool:
    """Write `data` to a Git backend's stdin; False when the backend has stopped reading
    (it answered without the rest of the request: its own answer says why)."""
    try:
        stdin.write(data)
        await stdin.drain()
    except BACKEND_GONE:
        return False
    return True


def problem(status: int, detail: str, *, headers: Mapping[str, str] | None = None) -> Response:
    """An RFC 9457 problem response with the plain ``about:blank`` type."""
    body = {"type": "about:blank", "title": http.HTTPStatus(status).phrase, "status": status,
            "detail": detail}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}),
                        media_type="application/problem+json")


@dataclass(frozen=True, slots=True)
class CgiRequest:
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
    gate: Gate | None


class _ClientGone(Exception):
    """The client disconnected; there is nobody left to answer."""


class BackendExchange(Response):
    """Runs ``git http-backend`` for one request, streaming both ways.

    A Response subclass because it needs the raw ASGI channel: the request body goes to Git
    while it arrives, Git's output goes out while it is produced, and a disconnect must be
    noticed while Git is still working.
    """

    def __init__(self, cgi: CgiRequest, delivered: Delivered | None = None,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """`headers`: added to what Git answers (the ref advertisement's ETag)."""
        super().__init__(status_code=200)
        self.cgi, self.delivered, self.extra = cgi, delivered, tuple(headers)

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
                await problem(503, "Git is not available on the server")(scope, receive, send)
                return
            try:
                async with asyncio.timeout(PROCESS_TIMEOUT):
                    sent = await _exchange(self.cgi, process, scope, receive, tracking_send,
                                           self.extra)
                self._tell_delivered(sent, process)
            except TimeoutError:
                _log.warning("git %s for device %r killed after %.0f s", self.cgi.service,
                             self.cgi.device_id, PROCESS_TIMEOUT)
                if not started:
                    await problem(504, "Git took too long")(scope, receive, send)
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


def _cgi_environment(cgi: CgiRequest, view_root: Path) -> dict[str, str]:
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
              *_FORCED_CONFIG, ("http.maxRequestBuffer", str(upload_gate.MAX_REQUEST_BYTES))]
    env["GIT_CONFIG_COUNT"] = str(len(config))
    for i, (key, value) in enumerate(config):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    return env


async def _spawn(cgi: CgiRequest, view_root: Path) -> asyncio.subprocess.Process:
    """Start ``git http-backend`` in its own process group (so `_reap` also ends the
    ``upload-pack`` and ``pack-objects`` it starts)."""
    return await asyncio.create_subprocess_exec(
        cgi.git, "http-backend", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=_cgi_environment(cgi, view_root), cwd=view_root, start_new_session=True,
        limit=_MAX_CGI_HEAD)


async def _exchange(cgi: CgiRequest, process: asyncio.subprocess.Process, scope: Scope,
                    receive: Receive, send: Send,
                    extra: tuple[tuple[bytes, bytes], ...] = ()) -> bool:
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
        except Refused as refusal:
            _kill(process)
            _log.warning("git %s for device %r not run: %s", cgi.service, cgi.device_id,
                         refusal)
            await problem(refusal.status, str(refusal))(scope, receive, send)
            return False
        if status == 200:
            headers.extend(extra)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if await _pump(process.stdout, receive, send):
            await process.wait()
            return status == 200
        return False
    finally:
        feeder.cancel()
        head.cancel()
        await _log_stderr(cgi, stderr, process)


async def _feed(receive: Receive, stdin: asyncio.StreamWriter, cgi: CgiRequest) -> None:
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
    status, headers = 200, list[tuple[bytes, bytes]]()
    while True:
        try:
            line = await stdout.readuntil(b"\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            raise Refused(502, "git http-backend gave no valid CGI response") from None
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
            read = asyncio.ensure_future(stdout.read(CHUNK))
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
    while chunk := await stderr.read(CHUNK):
        kept += chunk[: max(0, _STDERR_KEPT - len(kept))]
    return bytes(kept)


async def _log_stderr(cgi: CgiRequest, stderr: asyncio.Task[bytes],
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
