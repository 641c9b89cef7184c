"""Test kit: the Git smart-HTTP app (`wfm.git.githttp`) under a real uvicorn on loopback, and
the pieces of Git's wire protocol the tests speak to it by hand.

    app = Starlette(routes=[Mount("/git", app=git_app(repo, basic_authorizer(TOKENS)))])
    with serving(app) as base:
        httpx.post(f"{base}/git/devices/dev-a.git/git-upload-pack",
                   content=v2_request("want <oid>", "done"), ...)
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping

import uvicorn
from starlette.requests import Request
from starlette.types import ASGIApp

from tools.polling import poll_until

__all__ = ["UPLOAD_PACK_REQUEST", "basic_authorizer", "git_env", "pkt", "serving",
           "v2_request"]

UPLOAD_PACK_REQUEST = "application/x-git-upload-pack-request"


def basic_authorizer(tokens: Mapping[str, str]) -> Callable[[Request, str], Awaitable[bool]]:
    """An authorize hook for `git_app`: HTTP Basic, user = device id, password = that
    device's token in `tokens`."""

    async def authorize(request: Request, device_id: str) -> bool:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        expected = tokens.get(device_id)
        return (user == device_id and expected is not None
                and hmac.compare_digest(password, expected))

    return authorize


@contextlib.contextmanager
def serving(app: ASGIApp, *, log_level: str = "warning") -> Iterator[str]:
    """Serve `app` with a real uvicorn on 127.0.0.1 (free port) in a thread; yield its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                           ws="none", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        poll_until("uvicorn to start", lambda: server.started or not thread.is_alive(),
                   timeout=10, interval=0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def git_env() -> dict[str, str]:
    """The environment for the real git CLI, isolated from the caller's configuration and
    never prompting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_TERMINAL_PROMPT="0", GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull)
    return env


def pkt(line: str | bytes) -> bytes:
    """One pkt-line."""
    data = line.encode() if isinstance(line, str) else line
    return b"%04x" % (len(data) + 4) + data


def v2_request(*args: str, command: str = "fetch") -> bytes:
    """A protocol-v2 request as `git fetch` sends it."""
    return (pkt(f"command={command}\n") + pkt("agent=git/test\n") + pkt("object-format=sha1\n")
            + b"0001" + b"".join(pkt(a + "\n") for a in args) + b"0000")
