"""Operators and roles on a running `margo serve` (docs/operations.md, "Operators and roles"
and "Audit trail"): viewers read, operators act, admins see the operators and the trail;
what changes is recorded, refusals of known callers too; `margo operators` beside a running
server takes effect within seconds (added, revoked, rotated), and no token is ever stored.
test_operators_replicas.py runs the same on two replicas on PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
from kits import serverkit
from kits.pgkit import database_for
from kits.serverkit import margo, running_server, store_args
from test_fleet_api import fleet_repository, git

from tools.polling import poll_until

ADMIN_TOKEN = "the-first-admin-token-0123456789"


def operators(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return margo("operators", *args, "--data", str(data), *store_args(data), check=False)


def add(data: Path, name: str, role: str) -> str:
    done = operators(data, "add", name, "--role", role, "--json")
    assert done.returncode == 0, done.stderr
    token: str = json.loads(done.stdout)["token"]
    return token


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def stored(data: Path) -> bytes:
    """Everything the store holds of operators and the trail, as bytes: the SQLite files
    whole, or PostgreSQL's rows of both tables."""
    if serverkit.STORE[0] == "replicas":
        with psycopg.connect(database_for(data)) as conn:
            rows = [*conn.execute("SELECT * FROM operators").fetchall(),
                    *conn.execute("SELECT * FROM audit_log").fetchall()]
        return repr(rows).encode()
    return b"".join(path.read_bytes() for path in sorted(data.glob("wfm.sqlite*")))


def trail(base: str, token: str, **params: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{base}/api/fleet/audit", params=params, headers=bearer(token),
                       timeout=10)
    assert answer.status_code == 200, answer.text
    found: list[dict[str, Any]] = answer.json()["entries"]
    return found


def push(url: str, work: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "push", "-q", url, "main"], cwd=work, capture_output=True,
                          text=True, check=False, env={"PATH": "/usr/bin:/bin",
                                                       "GIT_TERMINAL_PROMPT": "0",
                                                       "HOME": str(work)})


def test_each_role_may_what_it_should_and_the_trail_records_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN_TOKEN + "\n")
    viewer = add(data, "vera", "viewer")
    work = fleet_repository(tmp_path / "work")
    with running_server(data, "--host-source", "--admin-token-file", str(admin_file)) as base:
        def get(path: str, token: str | None) -> httpx.Response:
            return httpx.get(base + path, headers=bearer(token), timeout=10)

        def act(token: str | None, action: str = "pause") -> httpx.Response:
            return httpx.post(f"{base}/api/fleet/rollouts/web/{action}",
                              headers=bearer(token), timeout=10)

        # added while the server runs: it knows within a second or so
        operator = add(data, "otto", "operator")
        admin = add(data, "ada", "admin")
        # (each token twice in a row: behind the replicas' balancer, once on each)
        poll_until("the new operators known", lambda: all(
            get("/api/fleet/devices", token).status_code == 200
            for token in (operator, operator, admin, admin)), timeout=10)
        for token in (viewer, operator, admin, ADMIN_TOKEN):
            assert get("/api/fleet/devices", token).status_code == 200
            assert get("/metrics", token).status_code == 200
        anonymous = get("/api/fleet/devices", None)
        assert anonymous.status_code == 401
        assert anonymous.headers["WWW-Authenticate"].startswith("Bearer")
        assert get("/api/fleet/devices", "not-a-token").status_code == 401

        refused = act(viewer)
        assert refused.status_code == 403
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert refused.json()["detail"] == "vera is a viewer; this needs the operator role"
        assert act(operator).status_code == 404  # allowed; the fleet has no rollout yet
        assert act(None).status_code == 401

        pushed_by = {name: base.replace("http://", f"http://{name}:{token}@")
                     + "/git/source.git" for name, token in (("vera", viewer),
                                                             ("otto", operator))}
        viewer_push = push(pushed_by["vera"], work)
        assert viewer_push.returncode != 0 and "403" in viewer_push.stderr
        assert push(pushed_by["otto"], work).returncode == 0
        (work / "deployments" / "hello-everywhere.yaml").write_text("spec: [unclosed\n")
        git("commit", "-q", "-am", "broken", cwd=work)
        assert push(pushed_by["otto"], work).returncode != 0  # the server's check refuses it
        clone = subprocess.run(["git", "clone", "-q", pushed_by["vera"], str(tmp_path / "c")],
                               capture_output=True, text=True, check=False)
        assert clone.returncode == 0, clone.stderr  # a viewer may fetch

        for token in (viewer, operator):
            assert get("/api/fleet/operators", token).status_code == 403
            assert get("/api/fleet/audit", token).status_code == 403
        listed = get("/api/fleet/operators", admin).json()["operators"]
        assert [(o["name"], o["role"], o["revoked"]) for o in listed] == [
            ("ada", "admin", False), ("otto", "operator", False), ("vera", "viewer", False)]
        assert all("token" not in json.dumps(o).lower() for o in listed)

        entries = trail(base, admin)
        seen = [(e["actor"], e["role"], e["action"], e["target"], e["outcome"])
                for e in entries]
        assert seen == [
            (f"local:{_user()}", "admin", "operator.add", "vera", "ok"),
            (f"local:{_user()}", "admin", "operator.add", "otto", "ok"),
            (f"local:{_user()}", "admin", "operator.add", "ada", "ok"),
            ("vera", "viewer", "rollout.pause", "web", "refused"),
            ("otto", "operator", "rollout.pause", "web", "failed"),
            ("vera", "viewer", "source.push", "source.git", "refused"),
            ("otto", "operator", "source.push", "source.git", "ok"),
            ("otto", "operator", "source.push", "source.git", "refused"),
        ], seen
        assert entries[-2]["detail"] == "refs/heads/main updated"
        assert entries[-1]["detail"].startswith("refs/heads/main refused: ")
        assert entries[3]["address"] == "127.0.0.1" and entries[3]["via"] == "token"
        assert [e["action"] for e in trail(base, ADMIN_TOKEN, actor="otto")] == [
            "rollout.pause", "source.push", "source.push"]
        assert trail(base, admin, since=str(time.time() + 60)) == []
        assert len(trail(base, admin, limit="2")) == 2
        exported = margo("audit", "--url", base, "--token-file", str(admin_file), "--jsonl",
                         "--actor", "otto", "--since", "1h")
        assert [json.loads(line)["outcome"] for line in exported.stdout.splitlines()] == [
            "failed", "ok", "refused"]
        viewer_file = tmp_path / "viewer-token"
        viewer_file.write_text(viewer)
        denied = margo("audit", "--url", base, "--token-file", str(viewer_file), check=False)
        assert denied.returncode == 2 and "403" in denied.stderr
    text = stored(data)
    for token in (viewer, operator, admin, ADMIN_TOKEN):
        assert token.encode() not in text
    logs = b"".join(p.read_bytes() for p in tmp_path.rglob("*.log"))
    assert not any(t.encode() in logs for t in (viewer, operator, admin, ADMIN_TOKEN))


def _user() -> str:
    import getpass

    return getpass.getuser()


def test_revoked_and_rotated_tokens_stop_working_within_seconds(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = add(data, "otto", "operator")
    with running_server(data) as base:
        def status(token: str) -> int:
            return httpx.get(f"{base}/api/fleet/devices", headers=bearer(token),
                             timeout=10).status_code

        def everywhere(token: str, code: int) -> bool:
            """`code` from each server (the balancer sends each request to the next)."""
            return all(status(token) == code for _ in range(serverkit.REPLICAS))

        assert everywhere(first, 200)
        rotated = operators(data, "rotate", "otto", "--json")
        assert rotated.returncode == 0, rotated.stderr
        second = json.loads(rotated.stdout)["token"]
        started = time.monotonic()
        poll_until("the old token refused", lambda: everywhere(first, 401), timeout=5,
                   interval=0.05)
        assert everywhere(second, 200)
        assert operators(data, "revoke", "otto").returncode == 0
        poll_until("the revoked operator refused", lambda: everywhere(second, 401),
                   timeout=5, interval=0.05)
        assert time.monotonic() - started < 5
        # revoking the last operator does not open the server
        assert httpx.get(f"{base}/api/fleet/devices", timeout=10).status_code == 401


def test_a_server_without_credentials_stays_open_and_says_who_acted(tmp_path: Path) -> None:
    with running_server(tmp_path / "data") as base:
        assert httpx.get(f"{base}/api/fleet/devices", timeout=10).status_code == 200
        assert httpx.post(f"{base}/api/fleet/rollouts/web/abort", timeout=10
                          ).status_code == 404
        entries = httpx.get(f"{base}/api/fleet/audit", timeout=10).json()["entries"]
        assert [(e["actor"], e["via"], e["action"], e["outcome"]) for e in entries] == [
            ("anonymous", "open", "rollout.abort", "failed")]
