"""A client that disconnects in the middle of its request body is an everyday event, not a
server error: the real `margo serve` logs it in one line, without a traceback (it logged
two tracebacks, 47 lines, per disconnect, and answered a 500 to nobody)."""

from __future__ import annotations

import base64
import contextlib
import time
from pathlib import Path

import pytest
from kits.rawhttp import connect, head
from kits.serverkit import add_client, running_server

from tools.polling import poll_until

GONE = "the client disconnected before its request body was complete"


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The server's log after a client sent half a body and went away on each route that
    reads one, one request per route; collected after the server stopped."""
    root = tmp_path_factory.mktemp("disconnects")
    data = root / "data"
    token = add_client(data, "site-a")
    (root / "secret").write_text("s3cret\n")
    (root / "operator").write_text("op-token\n")
    requests = [
        ("POST", "/hooks/git", {"X-GitHub-Event": "push",
                                "X-Hub-Signature-256": "sha256=" + "0" * 64}),
        ("POST", "/api/v1/onboarding", {}),
        ("POST", "/oauth/token", {"Content-Type": "application/x-www-form-urlencoded"}),
        ("PUT", "/api/v1/capabilities/dev-1", {"Authorization": f"Bearer {token}"}),
        ("POST", "/git/source.git/git-receive-pack", {
            "Authorization": "Basic " + base64.b64encode(b"operator:op-token").decode(),
            "Content-Type": "application/x-git-receive-pack-request"}),
    ]
    with running_server(data, "--log-level", "info", "--webhook-secret-file",
                        str(root / "secret"), "--source-url", str(root / "none"),
                        "--host-source", "--admin-token-file", str(root / "operator")) as base:
        host, port = base.removeprefix("http://").split(":")
        for done, (method, path, headers) in enumerate(requests, 1):
            with connect((host, int(port))) as sock:
                sock.sendall(head(method, path, {"Content-Type": "application/json", **headers,
                                                 "Content-Length": "1000"}) + b"{" * 500)
                time.sleep(0.2)  # the handler is reading the body
            with contextlib.suppress(TimeoutError):  # the test says what was logged instead
                poll_until("the disconnect to be logged",
                           lambda done=done: _disconnects(root) >= done, timeout=10)
    text = _log(root)
    assert text, "no server log"
    return text


def _log(root: Path) -> str:
    return "".join(path.read_text() for path in root.glob("server-*.log"))


def _disconnects(root: Path) -> int:
    """How many disconnects the log tells of, the new way or the old."""
    text = _log(root)
    return text.count(GONE) + text.count("unhandled error")


def test_no_traceback_for_a_client_that_went_away(logged: str) -> None:
    assert "Traceback" not in logged
    assert "ClientDisconnect" not in logged
    assert "unhandled error" not in logged


def test_each_disconnect_is_one_line(logged: str) -> None:
    lines = [line for line in logged.splitlines() if GONE in line]
    assert len(lines) == 5, logged
    assert all(" INFO " in line for line in lines)
