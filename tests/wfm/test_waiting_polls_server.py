"""Waiting polls, the server's side (issue 34; docs/server.md "Waiting polls"), against the
real `margo serve`: a conditional manifest poll (rc.3 and rc.2 paths) or ref advertisement
with `Prefer: wait=N` is held until the client's state changes or N seconds pass, then
answered as an immediate poll would be, with `Preference-Applied`; everything else is
answered as before. The bounds: `--max-wait` clamps N, `--max-waiters` sheds the excess
with a plain answer, a client that disconnects is released, and a server that stops answers
its held polls at once (never a 5xx).

Held requests are seen through the server's own figures (`GET /metrics`:
`margo_waiting_polls_held`, `margo_waiting_polls_total{outcome}`), so the tests wait for
states, not for time; the only time asserted is a lower bound (a held poll was held) or a
bound far above what waiting takes.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.fleetserver import FleetServer, capabilities, one_device_server
from kits.metricskit import figure, held_polls
from kits.serverkit import add_client, two_replicas, use_store
from prometheus_client.parser import text_string_to_metric_families

from tools.devices import intent
from tools.margoserver import margo_server
from tools.polling import poll_until
from wfm.fleet.waiters import requested_wait

MANIFEST = "application/vnd.margo.manifest.v1+json"
REFS = "/info/refs?service=git-upload-pack"
DEVICE = "waiting-1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    with one_device_server(tmp_path_factory.mktemp("waiting"), DEVICE, extra_args=(
            "--max-wait", "10", "--max-waiters", "2")) as running:
        yield running


def ended(base: str, outcome: str) -> float:
    return figure(base, f'margo_waiting_polls_total{{outcome="{outcome}"}}')


def poll(http: httpx.Client, path: str, etag: str | None,
         prefer: str | bytes | None = None) -> tuple[httpx.Response, float]:
    """A manifest poll (conditional on `etag`); the answer and how long it took."""
    sent: dict[str, str | bytes] = {"Accept": MANIFEST}
    if etag is not None:
        sent["If-None-Match"] = etag
    if prefer is not None:
        sent["Prefer"] = prefer
    started = time.monotonic()
    response = http.get(path, headers=sent)
    return response, time.monotonic() - started


def in_background(call: Callable[[], Any]) -> Callable[[], Any]:
    """Run `call` in a thread now; the returned function waits for its result."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(timeout=60)
        assert result, "the background request did not finish"
        return result[0]

    return join


@pytest.mark.parametrize("path", ["/api/v1/deployments", "/api/v1/clients/edge/deployments"],
                         ids=["rc.3", "rc.2"])
def test_a_waiting_poll_is_answered_as_an_immediate_poll_only_later(
        server: FleetServer, path: str) -> None:
    with server.client(timeout=30) as http:
        first, _ = poll(http, path, None, "wait=2")  # not conditional: at once, as before
        assert first.status_code == 200 and "preference-applied" not in first.headers
        etag = first.headers["etag"]
        other, _ = poll(http, path, '"sha256:00"', "wait=2")  # not what it holds: at once
        assert other.status_code == 200 and "preference-applied" not in other.headers
        plain, _ = poll(http, path, etag)  # no preference: at once
        assert plain.status_code == 304 and "preference-applied" not in plain.headers
        waited, seconds = poll(http, path, etag, "respond-async, wait=1;x=y")
        assert (waited.status_code, waited.headers["preference-applied"]) == (304, "wait=1")
        assert waited.headers["etag"] == etag and seconds >= 0.9


def _route_figures(base: str, route: str) -> dict[tuple[str, str], float]:
    """The request metrics' samples for GETs of `route`: (sample name, status code or "")
    -> value (histogram buckets left out)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {(sample.name, sample.labels.get("code", "")): sample.value
            for family in text_string_to_metric_families(text)
            if family.name.startswith("margo_http_request")
            for sample in family.samples
            if sample.labels.get("route") == route and sample.labels.get("method") == "GET"
            and not sample.name.endswith("_bucket")}


@pytest.mark.parametrize(("path", "route"), [
    ("/api/v1/deployments", "/api/v1/deployments"),
    ("/api/v1/clients/edge/deployments", "/api/v1/clients/{clientId}/deployments")],
    ids=["rc.3", "rc.2"])
def test_a_held_poll_is_counted_once_when_answered_over_its_whole_time(
        server: FleetServer, path: str, route: str) -> None:
    """A held poll waits outside the middleware stack and goes back through it to be
    answered (`wfm.admission.parking`): the request metrics count it once, as answered,
    with the time it was held; its first pass, which answers nothing, is never counted
    (as the 500 an unanswered request would be)."""
    ok = ("margo_http_requests_total", "200")
    answered = _route_figures(server.base, route).get(ok, 0.0)

    def counted() -> dict[tuple[str, str], float]:
        figures = _route_figures(server.base, route)
        return figures if figures.get(ok) == answered + 1 else {}

    with server.client(timeout=30) as http:
        etag = poll(http, path, None)[0].headers["etag"]  # (each path's manifest its own)
        before = poll_until("that poll counted", counted)
        waited, seconds = poll(http, path, etag, "wait=1")
    assert waited.headers["preference-applied"] == "wait=1" and seconds >= 0.9

    def moved() -> dict[tuple[str, str], float]:  # (`/metrics` is cached for a moment)
        after = _route_figures(server.base, route)
        return {key: after[key] - before.get(key, 0.0) for key in after
                if after[key] != before.get(key, 0.0)}

    changes = poll_until("the poll counted", moved)
    assert {key: value for key, value in changes.items()
            if key[0] == "margo_http_requests_total"} == {
        ("margo_http_requests_total", "304"): 1.0}
    assert changes[("margo_http_request_duration_seconds_count", "")] == 1.0
    assert 0.9 <= changes[("margo_http_request_duration_seconds_sum", "")] <= seconds + 0.5


@pytest.mark.parametrize(("values", "expected"), [
    (["wait=5"], 5), (["respond-async, wait=5"], 5), (["WAIT = 7 ;x=1"], 7),
    (['wait="9"'], 9), (["wait=5", "wait=6"], 5), (["wait=0"], 0), (["wait=100"], 60),
    (["wait=99999999999999999999999"], 60), (["wait=soon"], None), (["wait=1.5"], None),
    (["wait=-1"], None), (["wait"], None), (["return=minimal"], None), ([], None),
])
def test_the_wait_a_request_asks_for(values: list[str], expected: int | None) -> None:
    """RFC 7240: comma-separated preferences, parameters after `;`, names in any case, a
    quoted value; the first `wait` counts; clamped to the server's longest; a malformed
    one is none."""
    assert requested_wait(values, limit=60) == expected


@pytest.mark.parametrize("prefer", ["wait=soon", "wait", "wait=-1", "wait=1.5", ";;,,=",
                                    "wait=\u0661".encode(), "w\u00e4it=1".encode()])
def test_a_malformed_preference_is_ignored(server: FleetServer, prefer: str | bytes) -> None:
    """RFC 7240: a preference the server does not understand is ignored (answered at once,
    as a plain poll); never an error."""
    with server.client(timeout=30) as http:
        _, etag = server.manifest()
        response, _ = poll(http, "/api/v1/deployments", etag, prefer)
        assert response.status_code == 304 and "preference-applied" not in response.headers


def test_a_held_poll_is_answered_when_the_state_changes(server: FleetServer) -> None:
    """Held for at most --max-wait (10 s here, asked 100), answered 200 once the change
    is compiled."""
    _, etag = server.manifest()
    with server.client(timeout=30) as http:
        answer = in_background(lambda: poll(http, "/api/v1/deployments", etag, 'wait="100"'))
        poll_until("the poll held", lambda: held_polls(server.base) >= 1)
        server.edit_intent(DEVICE, intent(DEVICE, greeting="Changed"))
        response, _ = answer()
    assert response.status_code == 200 and response.headers["etag"] != etag
    assert response.headers["preference-applied"] == "wait=10"
    assert response.json()["deployments"]


def test_past_max_waiters_polls_are_answered_at_once_and_a_disconnect_frees_its_place(
        server: FleetServer) -> None:
    _, etag = server.manifest()
    gone = ended(server.base, "gone")
    with server.client(timeout=30) as first, server.client(timeout=30) as extra:
        holding = [in_background(lambda h=h: poll(h, "/api/v1/deployments", etag, "wait=3"))
                   for h in (first,)]
        raw = _raw_waiting_poll(server, etag)
        poll_until("two polls held", lambda: held_polls(server.base) == 2)
        shed, _ = poll(extra, "/api/v1/deployments", etag, "wait=3")  # --max-waiters 2
        assert shed.status_code == 304 and "preference-applied" not in shed.headers
        raw.close()  # the client goes away: its place is free at once
        poll_until("the disconnect noticed", lambda: ended(server.base, "gone") > gone)
        again, _ = poll(extra, "/api/v1/deployments", etag, "wait=1")
        assert again.headers.get("preference-applied") == "wait=1"
        for join in holding:
            assert join()[0].status_code == 304


def _raw_waiting_poll(server: FleetServer, etag: str) -> socket.socket:
    """A waiting poll on a socket of our own (to close it while it is held)."""
    port = int(server.base.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"GET /api/v1/deployments HTTP/1.1\r\nHost: test\r\nAccept: {MANIFEST}\r\n"
                 f"Authorization: Bearer {server.token}\r\nIf-None-Match: {etag}\r\n"
                 "Prefer: wait=3\r\n\r\n".encode())
    return sock


def test_the_ref_advertisement_is_conditional_and_held_for_git_devices(
        server: FleetServer) -> None:
    """Git never sends these headers (a plain advertisement is what it always was); the
    device client does."""
    with httpx.Client(base_url=server.git_url(DEVICE), timeout=30,
                      auth=(server.client_id, server.token)) as git:
        plain = git.get(REFS)
        etag = plain.headers["etag"]
        assert plain.status_code == 200 and etag.startswith('W/"sha256:')
        assert plain.content.startswith(b"001e# service=git-upload-pack\n")
        assert git.get(REFS, headers={"If-None-Match": etag}).status_code == 304
        started = time.monotonic()
        waited = git.get(REFS, headers={"If-None-Match": etag, "Prefer": "wait=1"})
        assert (waited.status_code, waited.headers["preference-applied"]) == (304, "wait=1")
        assert time.monotonic() - started >= 0.9
        answer = in_background(lambda: git.get(
            REFS, headers={"If-None-Match": etag, "Prefer": "wait=10"}))
        poll_until("the advertisement held", lambda: held_polls(server.base) >= 1)
        server.edit_intent(DEVICE, intent(DEVICE, greeting="Moved"))
        moved = answer()
    assert moved.status_code == 200 and moved.headers["etag"] != etag
    assert moved.headers["preference-applied"] == "wait=10"
    assert moved.content.startswith(b"001e# service=git-upload-pack\n")


def test_a_stopping_server_answers_its_held_polls_at_once(tmp_path: Path) -> None:
    """SIGTERM: every held poll is answered 304 right away (never a 5xx), and the server
    exits without waiting for their time to run out."""
    with use_store("sqlite"):
        token = add_client(tmp_path / "data", "edge")
    with margo_server(tmp_path / "data") as process, httpx.Client(
            base_url=process.url, timeout=60,
            headers={"Authorization": f"Bearer {token}"}) as http:
        etag = poll_until("a manifest", lambda: _manifest(http)).headers["etag"]
        answers = [in_background(lambda: poll(http, "/api/v1/deployments", etag, "wait=60"))
                   for _ in range(3)]
        poll_until("three polls held", lambda: held_polls(process.url) == 3)
        process.process.send_signal(signal.SIGTERM)
        for answer in answers:
            response, seconds = answer()
            assert response.status_code == 304 and seconds < 30
        # (uvicorn stops gracefully, then raises the signal it caught again)
        assert process.process.wait(timeout=30) in (0, -signal.SIGTERM)
    log = process.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log


def test_a_replica_wakes_its_held_polls_for_a_device_registered_on_another(
        tmp_path: Path) -> None:
    """Client `edge` polls replica 0 and waits; its new device reports to replica 1 and an
    intent targets it: the compile's publication reaches replica 0 (PostgreSQL NOTIFY),
    which wakes the poll although it never saw the device (its owner is looked up)."""
    with two_replicas(tmp_path, ["edge"]) as replicas:
        first, second = (httpx.Client(base_url=base, timeout=60, headers={
            "Authorization": f"Bearer {replicas['tokens']['edge']}"})
            for base in replicas["bases"])
        with first, second:
            answer = poll_until("a manifest", lambda: _manifest(first))
            etag = answer.headers["etag"]
            held_poll = in_background(lambda: poll(first, "/api/v1/deployments", etag,
                                                   "wait=50"))
            poll_until("the poll held", lambda: held_polls(replicas["bases"][0]) == 1)
            # (the intent first: the registration's compile reads it)
            (replicas["source"] / "deployments" / "late-1.yaml").write_text(intent("late-1"))
            doc = capabilities("k8s-single-amd64", "late-1")
            assert second.put("/api/v1/capabilities/late-1", json=doc).status_code == 201
            response, seconds = held_poll()
    assert response.status_code == 200 and seconds < 45
    assert response.headers["preference-applied"] == "wait=50"
    assert response.json()["deployments"]


def _manifest(http: httpx.Client) -> httpx.Response | None:
    response = http.get("/api/v1/deployments", headers={"Accept": MANIFEST})
    return response if response.status_code == 200 else None
