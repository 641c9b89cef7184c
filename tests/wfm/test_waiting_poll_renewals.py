"""A waiting poll's renewal (issue 34; `wfm.admission.parking`): a device answered 304 after
its wait sends the very same poll again on the same connection, and the server holds it
again without taking it through the request stack. What must not change: the answer (the
same 304, headers and all), the request metrics, and every refusal and every new state a
request down the stack would get: a changed manifest or branch, another request on the
connection, a retired client, a replaced or expired token. The REST manifests (rc.3 and
rc.2 paths) and the Git ref advertisement, against the real `margo serve`; the renewals are
seen through `margo_waiting_polls_renewed_total`, so each test fails if the renewal is not
taken (or taken where it must not be).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kits.fleetserver import FleetServer, one_device_server
from kits.metricskit import figure, renewals
from kits.serverkit import access_token, add_client, margo, store_args

from tools.devices import intent
from tools.polling import poll_until

MANIFEST = "application/vnd.margo.manifest.v1+json"
DEVICE = "renewing-1"
RC3 = "/api/v1/deployments"
REFS = "/info/refs?service=git-upload-pack"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FleetServer]:
    with one_device_server(tmp_path, DEVICE) as running:
        yield running


def renewed(server: FleetServer) -> float:
    return renewals(server.base)


def waiting(http: httpx.Client, etag: str, path: str = RC3,
            prefer: str = "wait=1") -> httpx.Response:
    """A waiting manifest poll on `http`'s connection."""
    return http.get(path, headers={"Accept": MANIFEST, "If-None-Match": etag,
                                   "Prefer": prefer})


def held_304(response: httpx.Response, etag: str, wait: int = 1) -> dict[str, str]:
    """The answer's headers but its date, once checked to be a held poll's 304."""
    assert response.status_code == 304, response.text
    assert response.headers["preference-applied"] == f"wait={wait}"
    assert response.headers["etag"] == etag
    return {name: value for name, value in response.headers.items() if name != "date"}


def requests_answered(server: FleetServer, route: str, code: int) -> float:
    return figure(server.base, f'margo_http_requests_total{{code="{code}",method="GET",'
                               f'route="{route}"}}', default=0.0)


@pytest.mark.parametrize(("path", "route"), [
    (RC3, RC3), ("/api/v1/clients/edge/deployments", "/api/v1/clients/{clientId}/deployments")],
    ids=["rc.3", "rc.2"])
def test_renewals_are_held_again_and_answered_as_the_first(
        server: FleetServer, path: str, route: str) -> None:
    with server.client(timeout=30) as http:
        etag = http.get(path, headers={"Accept": MANIFEST}).headers["etag"]
        before, counted = renewed(server), requests_answered(server, route, 304)
        started = time.monotonic()
        answers = [waiting(http, etag, path) for _ in range(3)]
        seconds = time.monotonic() - started
    first, *again = (held_304(answer, etag) for answer in answers)
    assert again == [first, first]  # the same answer, byte for byte but its date
    assert seconds >= 2.85  # each held (its wait, brought forward by a twentieth at most)
    assert renewed(server) - before == 2  # the first went down the stack
    assert requests_answered(server, route, 304) - counted == 3


def test_the_same_poll_on_another_connection_goes_down_the_stack(server: FleetServer) -> None:
    with server.client(timeout=30) as one, server.client(timeout=30) as other:
        etag = one.get(RC3, headers={"Accept": MANIFEST}).headers["etag"]
        before = renewed(server)
        held_304(waiting(one, etag), etag)
        held_304(waiting(other, etag), etag)
        assert renewed(server) == before
        held_304(waiting(one, etag), etag)
        assert renewed(server) == before + 1


def test_another_request_on_the_connection_is_not_a_renewal(server: FleetServer) -> None:
    with server.client(timeout=30) as http:
        etag = http.get(RC3, headers={"Accept": MANIFEST}).headers["etag"]
        before = renewed(server)
        held_304(waiting(http, etag), etag)
        held_304(waiting(http, etag, prefer="wait=2"), etag, wait=2)  # not the same request
        assert renewed(server) == before
        held_304(waiting(http, etag, prefer="wait=2"), etag, wait=2)
        assert renewed(server) == before + 1


def test_a_renewal_after_the_state_changed_gets_the_new_manifest(server: FleetServer) -> None:
    with server.client(timeout=30) as http:
        etag = http.get(RC3, headers={"Accept": MANIFEST}).headers["etag"]
        held_304(waiting(http, etag), etag)
        before = renewed(server)
        server.edit_intent(DEVICE, intent(DEVICE, greeting="Changed between two polls"))
        changed = server.wait_for_change(etag)
        answer = waiting(http, etag)
    assert answer.status_code == 200 and answer.headers["etag"] != etag
    assert "preference-applied" not in answer.headers  # answered at once, not held
    assert answer.json() == changed
    assert renewed(server) == before


def refused_again(http: httpx.Client, etag: str, status: int) -> None:
    """The connection's next renewal is refused as any request with its credentials."""
    answer = waiting(http, etag)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")


def test_a_retired_client_is_refused_its_renewal(server: FleetServer) -> None:
    with server.client(timeout=30) as http:
        etag = http.get(RC3, headers={"Accept": MANIFEST}).headers["etag"]
        held_304(waiting(http, etag), etag)
        before = renewed(server)
        margo("clients", "retire", server.client_id, "--data", str(server.data_dir),
              *store_args(server.data_dir))
        poll_until("the retired client refused", lambda: httpx.get(
            f"{server.base}{RC3}", timeout=10,
            headers={"Authorization": f"Bearer {server.token}"}).status_code == 403)
        refused_again(http, etag, 403)
    assert renewed(server) == before


def test_a_replaced_token_is_refused_its_renewal(server: FleetServer) -> None:
    with server.client(timeout=30) as http:
        etag = http.get(RC3, headers={"Accept": MANIFEST}).headers["etag"]
        held_304(waiting(http, etag), etag)
        add_client(server.data_dir, server.client_id)  # a new token; the one held is void
        poll_until("the old token refused", lambda: httpx.get(
            f"{server.base}{RC3}", timeout=10,
            headers={"Authorization": f"Bearer {server.token}"}).status_code == 401)
        refused_again(http, etag, 401)


def test_an_expired_access_token_is_refused_its_renewal(server: FleetServer) -> None:
    lifetime = 3.0
    token = access_token(server.data_dir, server.client_id, lifetime)
    with server.client(token=token, timeout=30) as http:
        etag = http.get(RC3, headers={"Accept": MANIFEST}).headers["etag"]
        held_304(waiting(http, etag), etag)
        held_304(waiting(http, etag), etag)  # renewed while the token is good
        time.sleep(lifetime)
        refused_again(http, etag, 401)


def test_git_advertisements_are_renewed_until_the_branch_moves(server: FleetServer) -> None:
    with httpx.Client(base_url=server.git_url(DEVICE), timeout=30,
                      auth=(server.client_id, server.token)) as git:
        etag = git.get(REFS).headers["etag"]
        before = renewed(server)
        sent = {"If-None-Match": etag, "Prefer": "wait=1"}
        answers = [git.get(REFS, headers=sent) for _ in range(3)]
        assert [a.status_code for a in answers] == [304, 304, 304]
        assert {a.headers["preference-applied"] for a in answers} == {"wait=1"}
        assert renewed(server) - before == 2
        server.edit_intent(DEVICE, intent(DEVICE, greeting="The branch moved"))
        poll_until("the branch moved", lambda: git.get(REFS).headers["etag"] != etag)
        moved = git.get(REFS, headers=sent)  # the renewal kept from before declines
    assert moved.status_code == 200 and moved.headers["etag"] != etag
    assert b"refs/heads/" in moved.content
    assert renewed(server) - before == 2


def test_a_retired_git_client_is_refused_its_renewal(server: FleetServer) -> None:
    with httpx.Client(base_url=server.git_url(DEVICE), timeout=30,
                      auth=(server.client_id, server.token)) as git:
        etag = git.get(REFS).headers["etag"]
        sent = {"If-None-Match": etag, "Prefer": "wait=1"}
        assert git.get(REFS, headers=sent).status_code == 304
        before = renewed(server)
        margo("clients", "retire", server.client_id, "--data", str(server.data_dir),
              *store_args(server.data_dir))
        poll_until("the retired client refused", lambda: httpx.get(
            f"{server.base}{RC3}", timeout=10,
            headers={"Authorization": f"Bearer {server.token}"}).status_code == 403)
        refused = git.get(REFS, headers=sent)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Basic")
    assert renewed(server) == before
