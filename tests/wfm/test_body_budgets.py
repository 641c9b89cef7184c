"""Request bodies in flight are bounded per route class and per client address
(`wfm.admission.budgets`), against a real `margo serve` on loopback over raw sockets, and
what can be authenticated is authenticated before a body is read.

Each test starts its own server with small budgets (`--budget-webhook 4 --budget-anonymous 2
--budget-per-address 2`, MiB), so what one test holds open never reaches another. Clients
come from distinct loopback addresses (127.0.x.y) where the per-address budget must not be
what refuses them. The memory these budgets save is measured by `bench/bodies.py`, not here.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.pkikit import make_self_signed
from kits.rawhttp import Answer, answers_within, closed_by_server, connect, head, read_response
from kits.serverkit import ROOT, add_client, margo, running_server

from margo.rfc9421 import key_id
from reconciler.signing import DeviceKey, onboarding_body, sign_request
from tools.polling import poll_until

MIB = 1024 * 1024
BUDGETS = ("--budget-webhook", "4", "--budget-anonymous", "2", "--budget-per-address", "2")
#: Long enough that no held body times out while a test looks at it.
BODY_TIMEOUT = 30
FORGED = {"X-GitHub-Event": "push", "X-Hub-Signature-256": "sha256=" + "0" * 64,
          "Content-Type": "application/json"}
JSON = {"Content-Type": "application/json"}
CAPS = ROOT / "examples" / "capabilities"


@contextmanager
def budgeted_server(root: Path) -> Iterator[dict[str, Any]]:
    """A server whose fleet source is a Git repository it mirrors (so the push hook is
    served) holding the example fleet (so a device gets a deployment to report on)."""
    source = root / "fleet"
    shutil.copytree(ROOT / "examples" / "fleet", source)
    for command in (["init", "-q", "-b", "main"], ["add", "-A"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "fleet"]):
        subprocess.run(["git", *command], cwd=source, check=True)
    (root / "secret").write_text("s3cret\n")
    data = root / "data"
    token = add_client(data, "site-a")
    with running_server(data, *BUDGETS, "--body-timeout", str(BODY_TIMEOUT),
                        "--webhook-secret-file", str(root / "secret"),
                        "--source-url", str(source)) as base:
        host, port = base.removeprefix("http://").split(":")
        yield {"addr": (host, int(port)), "base": base, "token": token}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A server of the test's own: what it holds open reaches no other test."""
    with budgeted_server(tmp_path) as server:
        yield server


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server for the tests whose requests are refused before anything is held."""
    with budgeted_server(tmp_path_factory.mktemp("budgets")) as server:
        yield server


def sent_partly(server: dict[str, Any], path: str, headers: dict[str, str], declared: int,
                source: str, sent: int = 64 * 1024) -> socket.socket:
    """A request declaring `declared` body bytes of which `sent` are sent; held there."""
    sock = connect(server["addr"], source=source)
    sock.sendall(head("POST", path, {**headers, "Content-Length": str(declared)}))
    sock.sendall(b" " * sent)
    return sock


def refused(answer: Answer, status: int) -> dict[str, Any]:
    """`answer` is a `status` problem that closes the connection (its body is unread)."""
    assert answer.status == status, answer
    assert answer.headers["connection"] == "close"
    if status in (429, 503):
        assert int(answer.headers["retry-after"]) > 0
    return answer.problem()


def device(server: dict[str, Any]) -> httpx.Client:
    return httpx.Client(base_url=server["base"], timeout=30,
                        headers={"Authorization": f"Bearer {server['token']}"})


def report_status(server: dict[str, Any]) -> int:
    """An authenticated device reports its capabilities, waits for a deployment and reports
    its status; the status report's HTTP status."""
    with device(server) as http:
        caps = json.loads((CAPS / "k8s-cluster-gpu.json").read_text())
        assert http.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps).status_code in (
            200, 201)
        manifest: dict[str, Any] = {}

        def assigned() -> bool:
            manifest.update(http.get("/api/v1/deployments").json())
            return bool(manifest["deployments"])

        poll_until("a deployment for the device", assigned, timeout=90, interval=0.2)
        ref = manifest["deployments"][0]
        report = {"deploymentId": ref["deploymentId"],
                  "adoptedManifestVersion": manifest["manifestVersion"],
                  "status": {"state": "installing"},
                  "components": [{"name": "any", "state": "installing"}]}
        return http.post(f"/api/v1/deployments/{ref['deploymentId']}/status",
                         json=report).status_code


@contextmanager
def held(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize(("path", "headers", "budget"), [
    ("/hooks/git", FORGED, 4), ("/api/v1/onboarding", JSON, 2)], ids=["webhook", "onboarding"])
def test_slow_uploads_past_their_budget_get_503_while_a_device_reports(
        server: dict[str, Any], path: str, headers: dict[str, str], budget: int) -> None:
    """`budget` MiB of 1 MiB bodies, from as many addresses, are held; the next ones are
    refused at once, unread; an authenticated device's reports go through meanwhile; the
    held ones, once complete, are answered by their handler, and the budget is free again."""
    count = budget + 4
    with held([sent_partly(server, path, headers, MIB, f"127.0.1.{i + 1}")
               for i in range(count)]) as socks:
        answers = answers_within(socks, 20, wanted=count - budget)
        assert len(answers) == count - budget, answers
        for answer in answers.values():
            assert "retry later" in refused(answer, 503)["detail"]
        waiting = [sock for sock in socks if sock not in answers]
        assert not answers_within(waiting, 0.5, wanted=1)  # still held
        assert report_status(server) == 200
        for sock in waiting:
            sock.sendall(b" " * (MIB - 64 * 1024))
            assert read_response(sock).status in (400, 401)  # not JSON / forged signature
    with held([sent_partly(server, path, headers, MIB, f"127.0.2.{i + 1}", sent=MIB)
               for i in range(budget)]) as socks:
        assert [read_response(sock).status in (400, 401) for sock in socks] == [True] * budget


def test_one_client_address_is_held_to_its_own_budget(server: dict[str, Any]) -> None:
    """One body alone from an address is admitted even past the per-address budget (2 MiB);
    a further one from that address is 429; another address is served."""
    with held([sent_partly(server, "/hooks/git", FORGED, 3 * MIB // 2, "127.0.3.1")]) as first:
        assert not answers_within(first, 1, wanted=1)  # admitted: waits for its body
        with held([sent_partly(server, "/hooks/git", FORGED, MIB, "127.0.3.1")]) as again:
            problem = refused(answers_within(again, 20, wanted=1)[again[0]], 429)
            assert "this client address" in problem["detail"]
        with held([sent_partly(server, "/hooks/git", FORGED, MIB, "127.0.3.2")]) as other:
            assert not answers_within(other, 1, wanted=1)
            other[0].sendall(b" " * (MIB - 64 * 1024))
            assert read_response(other[0]).status == 401


def test_a_chunked_body_is_charged_as_it_arrives(server: dict[str, Any]) -> None:
    """With 3 of the webhook budget's 4 MiB held, a chunked hook is refused once it passes
    the fourth MiB, not after its whole body."""
    with held([sent_partly(server, "/hooks/git", FORGED, MIB, f"127.0.4.{i + 1}")
               for i in range(3)]), connect(server["addr"], source="127.0.4.9") as sock:
        sock.sendall(head("POST", "/hooks/git", {**FORGED, "Transfer-Encoding": "chunked"}))
        piece, sent = b" " * (64 * 1024), 0
        answer = {}
        while not answer and sent < 8 * MIB:
            try:
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
            answer = answers_within([sock], 0.05, wanted=1)
        answer = answer or answers_within([sock], 20, wanted=1)
        assert sock in answer, f"no answer after {sent} bytes"
        refused(answer[sock], 503)
        assert sent < 3 * MIB


def test_a_body_larger_than_its_whole_budget_is_413_at_once(shared: dict[str, Any]) -> None:
    with held([sent_partly(shared, "/hooks/git", FORGED, 5 * MIB, "127.0.5.1", sent=0)]) as s:
        problem = refused(answers_within(s, 20, wanted=1)[s[0]], 413)
        assert "at most 4194304 bytes of webhook request bodies" in problem["detail"]


@pytest.mark.parametrize(("headers", "status", "says"), [
    ({"X-GitHub-Event": "push"}, 401, "missing X-Hub-Signature-256"),
    ({"X-GitHub-Event": "push", "X-Hub-Signature": "sha1=" + "0" * 40}, 401, "SHA-1"),
    ({"X-GitHub-Event": "push", "X-Hub-Signature-256": "md5=00"}, 401, "sha256=<64 hex"),
    ({"X-Gitea-Event": "push"}, 401, "missing X-Gitea-Signature"),
    ({"X-Gitea-Event": "push", "X-Gitea-Signature": "zz"}, 401, "not a hex HMAC"),
    ({"X-Gitlab-Event": "Push Hook", "X-Gitlab-Token": "wrong"}, 401, "does not match"),
    ({}, 400, "unknown webhook provider"),
], ids=["github-unsigned", "github-sha1", "github-malformed", "gitea-unsigned",
        "gitea-malformed", "gitlab-wrong-token", "no-provider"])
def test_a_push_hook_is_refused_from_its_headers_before_its_body(
        shared: dict[str, Any], headers: dict[str, str], status: int, says: str) -> None:
    """Nothing of the 20 MiB body is sent: the answer comes from the headers alone."""
    with held([sent_partly(shared, "/hooks/git", {**JSON, **headers}, 20 * MIB, "127.0.6.1",
                           sent=0)]) as socks:
        answer = answers_within(socks, 20, wanted=1)[socks[0]]
        assert says in refused(answer, status)["detail"]
        assert closed_by_server(socks[0], 5)


# --- rc.2 signatures: verified from the headers, before the body -----------------------------


def onboarded(server: dict[str, Any]) -> DeviceKey:
    private, certificate = make_self_signed("ec-p256")
    with httpx.Client(base_url=server["base"], timeout=30) as http:
        answer = http.post("/api/v1/onboarding", json=onboarding_body(certificate))
        assert answer.status_code == 201, answer.text
        server["rc2"] = answer.json()["clientId"]
    return DeviceKey(private, "ecdsa-p256-sha256", key_id(private.public_key()))


def signed_head(server: dict[str, Any], key: DeviceKey, body: bytes) -> bytes:
    """The head of a signed rc.2 capability report carrying `body` (sent separately)."""
    host = f"{server['addr'][0]}:{server['addr'][1]}"
    request = httpx.Request("POST", f"http://{host}/api/v1/clients/{server['rc2']}/capabilities",
                            content=body, headers=JSON)
    sign_request(request, key, created=int(time.time()))
    wanted = ("content-type", "content-length", "content-digest", "signature-input",
              "signature")
    return head("POST", request.url.raw_path.decode(), {
        name: value for name, value in request.headers.items() if name in wanted}, host=host)


def test_a_forged_rc2_signature_is_refused_before_the_body(shared: dict[str, Any]) -> None:
    key = onboarded(shared)
    body = json.dumps({"properties": {"id": "x"}}).encode() + b" " * (MIB // 2)
    forged = signed_head(shared, key, body).replace(b"sig1=:", b"sig1=:AAAA")
    with connect(shared["addr"], source="127.0.7.1") as sock:
        sock.sendall(forged)  # not a byte of the body
        answer = answers_within([sock], 20, wanted=1)[sock]
        assert answer.status == 401, answer
        assert answer.headers["connection"] == "close"


def test_a_validly_signed_half_sent_body_gets_408(tmp_path: Path) -> None:
    """A good signature lets the body be read, under the body deadline like any other."""
    data = tmp_path / "data"
    with running_server(data, "--body-timeout", "2") as base:
        host, port = base.removeprefix("http://").split(":")
        server = {"addr": (host, int(port)), "base": base}
        key = onboarded(server)
        body = json.dumps(json.loads((CAPS / "k8s-single-amd64.json").read_text())).encode()
        with connect(server["addr"]) as sock:
            sock.sendall(signed_head(server, key, body) + body[: len(body) // 2])
            answer = read_response(sock)
            assert answer.status == 408, answer
            assert answer.headers["connection"] == "close"


def test_signed_devices_report_while_onboarding_floods(server: dict[str, Any]) -> None:
    """An rc.2 device whose signature is good counts as authenticated: the anonymous
    budget, spent by onboarding bodies held open, does not stop its capability report."""
    key = onboarded(server)
    with ExitStack() as stack:
        socks = stack.enter_context(held([sent_partly(server, "/api/v1/onboarding", JSON, MIB,
                                                      f"127.0.8.{i + 1}") for i in range(4)]))
        assert len(answers_within(socks, 20, wanted=2)) == 2  # the budget (2 MiB) is spent
        caps = json.loads((CAPS / "k8s-single-amd64.json").read_text())
        caps["properties"]["id"] = "rc2-device"
        body = json.dumps(caps).encode()
        with connect(server["addr"], source="127.0.8.9") as sock:
            sock.sendall(signed_head(server, key, body) + body)
            assert read_response(sock).status == 201


def test_budget_options_are_checked(tmp_path: Path) -> None:
    result = margo("serve", "--data", str(tmp_path / "data"), "--budget-webhook", "0",
                   check=False)
    assert result.returncode != 0
    assert "webhook body budget must be at least one byte" in result.stderr
