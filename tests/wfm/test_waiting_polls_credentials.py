"""A held waiting poll stops being served once its credentials are withdrawn, as an immediate
poll does (issue 34; docs/server.md, "Waiting polls"): retiring a client or replacing its
token refuses the polls it has held within seconds — not at the end of their wait, and never
with a new state published after the withdrawal. The REST manifest (bearer token) and the
Git ref advertisement (HTTP basic), against the real `margo serve`; the withdrawal is
written by `margo clients` beside it (another process), which the server learns of only
through the credentials epoch in the database (`wfm.identity.credentialcache`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.fleetserver import FleetServer, one_device_server
from kits.metricskit import figure, held_polls
from kits.serverkit import access_token, add_client, margo, store_args

from tools.devices import intent
from tools.polling import poll_until

MANIFEST = "application/vnd.margo.manifest.v1+json"
REFS = "/info/refs?service=git-upload-pack"
DEVICE = "withdrawn-1"
#: What each poll asks to be held for: far longer than a refusal may take.
WAIT = 50
#: Seconds from the withdrawal to the refusal, at most (one epoch check is 1 s).
PROMPTLY = 10.0


@pytest.fixture(params=["sqlite", "replicas"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FleetServer]:
    """One server, or two replicas behind the round-robin balancer (the withdrawal reaches
    each through PostgreSQL; the held request may be on either)."""
    with one_device_server(tmp_path, DEVICE, store=request.param) as running:
        yield running


def retire(server: FleetServer) -> None:
    """`margo clients retire` beside the running server(s), on their store."""
    data = server.data_dir
    margo("clients", "retire", server.client_id, "--data", str(data), *store_args(data))


def in_background(call: Callable[[], httpx.Response]) -> Callable[[], tuple[httpx.Response,
                                                                             float]]:
    """Send the request in a thread now; the returned function waits for its answer and
    when it came (time.monotonic())."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append((call(), time.monotonic())),
                              daemon=True)
    thread.start()

    def join() -> tuple[httpx.Response, float]:
        thread.join(timeout=WAIT + 30)
        assert result, "the held request did not finish"
        return result[0]

    return join


@contextlib.contextmanager
def held_manifest_poll(server: FleetServer, token: str | None = None
                       ) -> Iterator[Callable[[], tuple[httpx.Response, float]]]:
    """A waiting manifest poll (with `token`, else the client's own), held by the server
    when the block starts."""
    _, etag = server.manifest()
    with server.client(token=token, timeout=WAIT + 20) as http:
        answer = in_background(lambda: http.get("/api/v1/deployments", headers={
            "Accept": MANIFEST, "If-None-Match": etag, "Prefer": f"wait={WAIT}"}))
        poll_until("the poll held", lambda: held_polls(server.base) >= 1)
        yield answer


def assert_refused_promptly(answer: tuple[httpx.Response, float], withdrawn_at: float,
                            status: int) -> None:
    response, at = answer
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert "preference-applied" not in response.headers
    assert at - withdrawn_at < PROMPTLY, f"refused {at - withdrawn_at:.1f} s after"


def test_retiring_a_client_refuses_the_poll_it_holds(server: FleetServer) -> None:
    with held_manifest_poll(server) as answer:
        retire(server)
        withdrawn_at = time.monotonic()
        assert_refused_promptly(answer(), withdrawn_at, 403)
    # Counted as a hold that failed (on one of the replicas: the one holding it).
    poll_until("the refusal counted", lambda: figure(
        server.base, 'margo_waiting_polls_total{outcome="failed"}') >= 1)


def test_a_replaced_token_refuses_the_poll_it_holds_before_a_newer_state(
        server: FleetServer) -> None:
    """The token is replaced; once the server refuses it to a new request, the client's
    state changes: the held poll, woken for that change if not refused before, is refused,
    never answered with the new manifest. (Within the second it takes the server to learn
    of a withdrawal, a held poll is answered as a new request would be then.)"""
    with held_manifest_poll(server) as answer:
        add_client(server.data_dir, server.client_id)  # a new token; the held one is void
        withdrawn_at = time.monotonic()
        # Four refusals in a row: behind the balancer, by both replicas.
        poll_until("the old token refused", lambda: all(httpx.get(
            f"{server.base}/api/v1/deployments", timeout=10,
            headers={"Authorization": f"Bearer {server.token}"}).status_code == 401
            for _ in range(4)))
        server.edit_intent(DEVICE, intent(DEVICE, greeting="After the withdrawal"))
        assert_refused_promptly(answer(), withdrawn_at, 401)


def test_an_access_token_that_expires_while_held_is_never_handed_a_newer_state(
        server: FleetServer) -> None:
    """An access token (`/oauth/token`'s kind) expires while the poll it sent is held; the
    client's state then changes: the poll wakes, and is refused (401) as a request sent
    with that token now would be, not answered with the new manifest."""
    lifetime = 3.0
    token = access_token(server.data_dir, server.client_id, lifetime)
    with held_manifest_poll(server, token=token) as answer:
        time.sleep(lifetime + 0.5)
        expired_at = time.monotonic()
        server.edit_intent(DEVICE, intent(DEVICE, greeting="After the expiry"))
        assert_refused_promptly(answer(), expired_at, 401)


def test_retiring_a_git_client_refuses_its_held_ref_advertisement(
        server: FleetServer) -> None:
    with httpx.Client(base_url=server.git_url(DEVICE), timeout=WAIT + 20,
                      auth=(server.client_id, server.token)) as git:
        etag = git.get(REFS).headers["etag"]
        answer = in_background(lambda: git.get(REFS, headers={
            "If-None-Match": etag, "Prefer": f"wait={WAIT}"}))
        poll_until("the advertisement held", lambda: held_polls(server.base) >= 1)
        retire(server)
        withdrawn_at = time.monotonic()
        response, at = answer()
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"].startswith("Basic")
    assert at - withdrawn_at < PROMPTLY, f"refused {at - withdrawn_at:.1f} s after"
