"""A server that cannot compile says so and tries again; a replica that cannot compile lets
another one compile (issue 29, item 1). Real `margo serve` processes (one on SQLite, two
replicas on PostgreSQL), real Git.

The fault: a `packed-refs.lock` in the repository the compiler writes, held open by a live
process (a `git` an operator runs by hand would hold it so): no compile may take it, and
every compile fails until the holder is gone. Then the lock is left behind as a killed
writer leaves it, aged as the seconds passing would, and the server recovers it by itself:
no push, no restart, nobody removing files by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from kits.fleetkit import Fleet, app, device, intent
from kits.pgkit import fresh_database
from kits.serverkit import add_client, margo, running_server
from test_replica_failover import Replica, lease, replicas

from compiler.gitstore import REPOSITORY_NAME
from compiler.stalelocks import GRACE
from tools.polling import poll_until


@contextmanager
def lock_held_open(repository: Path) -> Iterator[Path]:
    """`<repository>/packed-refs.lock`, created and held open by a live process, as a Git
    writer holds it; left behind (closed, aged past the recovery grace) afterwards, as a
    writer that was killed leaves it."""
    lock = repository / "packed-refs.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import time\n"
                               f"f = open({str(lock)!r}, 'w'); print('held', flush=True)\n"
                               "time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield lock
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
        past = time.time() - GRACE - 1
        if lock.exists():
            os.utime(lock, (past, past))


def small_fleet(root: Path) -> Fleet:
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web", profile={"type": "compose"},
                                  parameters={"greeting": "hello"},
                                  targets={"devices": ["box"]})
    fleet.devices["box"] = device("box", types=("compose",))
    fleet.write()
    return fleet


def greeting_served(http: httpx.Client) -> bytes:
    manifest = http.get("/api/v1/deployments").json()
    return b"".join(http.get(d["url"]).content for d in manifest["deployments"])


def test_a_server_that_cannot_compile_says_so_and_recovers_by_itself(tmp_path: Path) -> None:
    fleet = small_fleet(tmp_path / "fleet")
    data = tmp_path / "data"
    token = add_client(data, "plant")
    with running_server(data, "--source", str(fleet.source), "--watch-source") as base, \
            httpx.Client(base_url=base, timeout=10,
                         headers={"Authorization": f"Bearer {token}"}) as http:
        assert http.put("/api/v1/capabilities/box",
                        json=fleet.devices["box"]).status_code == 201
        poll_until("the first deployment", lambda: b"hello" in greeting_served(http),
                   timeout=30)
        repository = data / "repos" / REPOSITORY_NAME
        with lock_held_open(repository) as lock:
            fleet.intents["web"]["spec"]["parameters"] = {"greeting": "bonjour"}
            fleet.write()
            unready = poll_until("/readyz to say compiles fail", lambda: (
                r if (r := httpx.get(f"{base}/readyz")).status_code == 503 else None),
                timeout=60)
            assert "compiling has failed" in unready.json()["detail"]
            assert "packed-refs.lock" in unready.json()["detail"]
            source = http.get("/api/fleet/source").json()
            assert source["state"] == "failing", source
            status = margo("status", "--url", base).stdout
            assert "failing" in status and "compiling has failed" in status
            assert b"hello" in greeting_served(http)  # the previous state stays in force
        assert lock.exists()  # left behind, as a killed writer leaves it
        poll_until("the retry to compile the change", lambda: b"bonjour" in
                   greeting_served(http), timeout=90)
        assert not lock.exists()
        assert httpx.get(f"{base}/readyz").status_code == 200
        assert http.get("/api/fleet/source").json()["state"] == "ready"


def test_a_replica_that_cannot_compile_gives_the_lease_up(tmp_path: Path) -> None:
    """The replica holding the compile lease cannot write its repository: it gives the
    lease up, the other replica compiles, and the change reaches the devices."""
    fleet = small_fleet(tmp_path / "fleet")
    database = fresh_database()
    token = json.loads(margo("clients", "add", "plant", "--data", str(tmp_path / "replica-0"),
                             "--json", "--database", database).stdout)["token"]
    with replicas(tmp_path, database, 2, "--source", str(fleet.source)) as (one, two):
        holder_name = poll_until("a lease holder", lambda: lease(database)["holder"],
                                 timeout=30)
        holder, other = (one, two) if holder_name == one.name else (two, one)
        http = httpx.Client(base_url=other.base, timeout=10,
                            headers={"Authorization": f"Bearer {token}"})
        try:
            assert http.put("/api/v1/capabilities/box",
                            json=fleet.devices["box"]).status_code == 201
            poll_until("the first deployment", lambda: b"hello" in greeting_served(http),
                       timeout=60)
            broken = holder.data / "compile" / REPOSITORY_NAME
            with lock_held_open(broken):
                fleet.intents["web"]["spec"]["parameters"] = {"greeting": "bonjour"}
                fleet.write()
                _ask_for_a_compile(other, token)
                poll_until("the other replica to compile the change", lambda: b"bonjour" in
                           greeting_served(http), timeout=90)
                assert lease(database)["holder"] == other.name
                assert holder.logged("gives up the compile lease") >= 1
        finally:
            http.close()


def _ask_for_a_compile(replica: Replica, token: str) -> None:
    """A capability change asks the lease holder to compile (as any device's would)."""
    doc = device("box", types=("compose",))
    doc["labels"] = {**doc.get("labels", {}), "example.com/nudge": str(time.time_ns())}
    response = httpx.put(f"{replica.base}/api/v1/capabilities/box", json=doc, timeout=10,
                         headers={"Authorization": f"Bearer {token}"})
    assert response.status_code in (200, 201), response.text

