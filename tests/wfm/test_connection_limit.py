"""`margo serve --max-connections N`: at most N connections are served at once (idle
keep-alive ones count); a request on one more is answered 503 and that connection closed,
and the server serves again as soon as one of the N goes. Against a real server."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.serverkit import margo, running_server

from tools.polling import poll_until


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(tmp_path_factory.mktemp("limit") / "data",
                        "--max-connections", "3") as url:
        yield url


def opened(base: str) -> http.client.HTTPConnection:
    host, port = base.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=10)


def livez(connection: http.client.HTTPConnection) -> int:
    connection.request("GET", "/livez")
    response = connection.getresponse()
    response.read()
    return response.status


def test_one_connection_past_the_limit_is_answered_503_and_closed(base: str) -> None:
    # The kit's own readiness probes have gone (they do not keep their connections).
    held = [opened(base) for _ in range(3)]
    try:
        # (a 503 closes that connection, and http.client opens it again on the next try)
        poll_until("three served connections",
                   lambda: [livez(c) for c in held] == [200, 200, 200], timeout=10)
        assert [livez(c) for c in held] == [200, 200, 200]  # kept alive, all three
        extra = opened(base)
        extra.request("GET", "/livez")
        refused = extra.getresponse()
        assert refused.status == 503
        assert refused.getheader("connection") == "close"
        refused.read()
        extra.close()  # (the server notices a moment later)
        poll_until("the served ones served again", lambda: livez(held[1]) == 200, timeout=10)
        held.pop().close()

        def served_again() -> bool:
            late = opened(base)
            try:
                return livez(late) == 200
            finally:
                late.close()

        poll_until("a connection served once one of the three went", served_again, timeout=10)
    finally:
        for connection in held:
            connection.close()


def test_a_limit_below_one_is_refused_before_starting(tmp_path: Path) -> None:
    result = margo("serve", "--data", str(tmp_path / "data"), "--port", "1",
                   "--max-connections", "0", check=False)
    assert result.returncode != 0
    assert "--max-connections must be at least 1" in result.stderr
