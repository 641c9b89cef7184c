"""Failover of fleet server replicas on one PostgreSQL database (docs/operations.md): the
replica that compiles is killed with SIGKILL in the middle of a compile, and PostgreSQL is
restarted under load. Real processes, a real PostgreSQL server, real Git pushes."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
from kits.pgkit import fresh_database
from kits.serverkit import ROOT, margo
from test_fleet_api import fleet_repository, git

import tools.replicas as replicas_kit
from margo.digests import data_digest
from tools.polling import poll_until
from tools.postgres import running_postgres
from wfm.store import records
from wfm.store.pgdb import PostgresDatabase

CAPS = ROOT / "examples" / "capabilities"
INTENT = Path("deployments") / "hello-everywhere.yaml"


class Replica(replicas_kit.Replica):
    """One `margo serve` process on the shared database (`tools.replicas`), logging at
    info level."""

    @property
    def name(self) -> str:
        """The name it holds the compile lease under (`wfm.fleet.coordination`)."""
        assert self.process is not None
        return f"{socket.gethostname()}:{self.process.pid}"

    def logged(self, text: str) -> int:
        """How many lines of the replica's log contain `text`."""
        return sum(text in line for line in self.log.read_text(errors="replace").splitlines())


@contextlib.contextmanager
def replicas(root: Path, database: str, count: int, *extra: str) -> Iterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for i in range(count):
            started.append(Replica(root / f"replica-{i}", ("--database", database, *extra),
                                   log_level="info").start())
        yield started
    finally:
        for replica in started:
            replica.stop()


def lease(database: str) -> dict[str, Any]:
    """The compile lease and generations, as the database has them."""
    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute("SELECT lease_holder, lease_epoch, generation FROM fleet_state "
                           "WHERE id = 1").fetchone()
    assert row is not None
    return {"holder": row[0], "epoch": int(row[1]), "generation": int(row[2])}


def box(index: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CAPS / "compose-box-amd64.json").read_text())
    doc["properties"]["id"] = f"box-{index}"
    return doc


def report_all(base: str, token: str, devices: range) -> None:
    """Each device reports its capabilities (eight at a time)."""
    def one(index: int) -> None:
        with httpx.Client(base_url=base, timeout=30,
                          headers={"Authorization": f"Bearer {token}"}) as http:
            response = http.put(f"/api/v1/capabilities/box-{index}", json=box(index))
            assert response.status_code in (200, 201), response.text

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, devices))


def store_directly(database: str, client_id: str, devices: range) -> None:
    """Store many devices' capability reports at once, with the server's own record
    function (reporting them one by one over REST is what test_api covers; here it would
    only make the fleet slow to build)."""
    db = PostgresDatabase(database)
    try:
        db.write_sync(lambda conn: [records.store_capabilities(
            conn, client_id=client_id, device_id=f"box-{i}", document=box(i),
            digest=data_digest(box(i)), shape="rc.3") for i in devices])
    finally:
        db.close()


class StatusReporter(threading.Thread):
    """Reports a new status as fast as the replicas answer, alternating between them and
    going round the client's deployments (so that no deployment gets more reports than its
    bounded history keeps: every report acknowledged can be looked for); remembers which
    reports a replica acknowledged."""

    def __init__(self, bases: list[str], token: str, deployments: list[dict[str, Any]],
                 version: int) -> None:
        super().__init__(daemon=True)
        self.bases, self.token, self.version = bases, token, version
        self.deployments = deployments
        self.acknowledged: list[str] = []
        self.answers: dict[str, int] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        clients = [httpx.Client(base_url=b, timeout=5,
                                headers={"Authorization": f"Bearer {self.token}"})
                   for b in self.bases]
        n = 0
        while not self.halt.is_set():
            n += 1
            marker = f"report-{n}"
            deployment_id = self.deployments[n % len(self.deployments)]["deploymentId"]
            path = f"/api/v1/deployments/{deployment_id}/status"
            report = {"deploymentId": deployment_id,
                      "adoptedManifestVersion": self.version,
                      "status": {"state": "installing"},
                      "components": [{"name": marker, "state": "installing"}]}
            try:
                response = clients[n % len(clients)].post(path, json=report)
            except httpx.TransportError:
                self.answers["unreachable"] = self.answers.get("unreachable", 0) + 1
                continue
            key = str(response.status_code)
            self.answers[key] = self.answers.get(key, 0) + 1
            if response.status_code == 200:
                self.acknowledged.append(marker)
            time.sleep(0.01)
        for client in clients:
            client.close()


def stored_reports(database: str, deployment_ids: list[str]) -> set[str]:
    """The component markers of every status report the database keeps for deployments."""
    with psycopg.connect(database, autocommit=True) as conn:
        rows = conn.execute("SELECT document FROM status_reports WHERE deployment_id = "
                            "ANY(%s)", (deployment_ids,)).fetchall()
    return {c["name"] for (doc,) in rows for c in json.loads(doc).get("components", [])}


def test_killing_the_compiling_replica_mid_compile_hands_the_lease_over(
        tmp_path: Path) -> None:
    """A push every device's deployment depends on; the replica compiling it is killed
    (SIGKILL) before it can publish; the other takes the lease, compiles, and serves the new
    state; the status reports either replica acknowledged meanwhile are all stored."""
    devices = 2000  # enough that a compile of every device takes longer than noticing it
    database = fresh_database()
    data = tmp_path / "replica-0"
    token = json.loads(margo("clients", "add", "edge", "--data", str(data), "--json",
                             "--database", database).stdout)["token"]
    fleet_token = json.loads(margo("clients", "add", "fleet", "--data", str(data), "--json",
                                   "--database", database).stdout)["token"]
    admin = tmp_path / "admin"
    admin.write_text("operator-token")
    work = fleet_repository(tmp_path / "work")
    with replicas(tmp_path, database, 2, "--host-source",
                  "--admin-token-file", str(admin)) as (one, two):
        holder_name = poll_until("a lease holder", lambda: lease(database)["holder"],
                                 timeout=30)
        holder, other = (one, two) if holder_name == one.name else (two, one)
        assert holder.name == holder_name
        push_url = other.base.replace("http://", "http://operator:operator-token@")
        report_all(other.base, token, range(1))  # box-0 reports over REST, as a device does
        store_directly(database, "fleet", range(1, devices))
        git("push", "-q", f"{push_url}/git/source.git", "main", cwd=work)
        http = httpx.Client(base_url=other.base, timeout=30,
                            headers={"Authorization": f"Bearer {token}"})
        first = poll_until("every device placed", lambda: (
            m if len((m := http.get("/api/v1/deployments").json())["deployments"]) == 1
            else None), timeout=120)
        poll_until("the fleet to settle", lambda: _settled(database), timeout=120)
        fleet = httpx.get(f"{other.base}/api/v1/deployments", timeout=30,
                          headers={"Authorization": f"Bearer {fleet_token}"}).json()
        reported = fleet["deployments"]
        assert len(reported) == devices - 1
        reporter = StatusReporter([holder.base, other.base], fleet_token, reported,
                                  fleet["manifestVersion"])
        reporter.start()

        before = lease(database)
        compiles_seen = holder.logged("compiling source")
        intent = work / INTENT
        intent.write_text(intent.read_text().replace("Hello from", "Hallo from"))
        git("commit", "-q", "-am", "a greeting every device shows", cwd=work)
        git("push", "-q", f"{push_url}/git/source.git", "main", cwd=work)
        poll_until("the holder to start compiling the push", lambda: holder.logged(
            "compiling source") > compiles_seen, timeout=30, interval=0.005)
        holder.kill()
        killed_at = lease(database)
        assert killed_at["generation"] == before["generation"], \
            "the compile finished before the kill: the test needs a bigger fleet"

        taken = poll_until("the other replica to take the lease", lambda: (
            state if (state := lease(database))["holder"] == other.name else None),
            timeout=30)
        assert taken["epoch"] > before["epoch"]
        moved = poll_until("the new state on the surviving replica", lambda: (
            m if (m := http.get("/api/v1/deployments").json())["manifestVersion"]
            > first["manifestVersion"] else None), timeout=120)
        assert b"Hallo from" in http.get(moved["deployments"][0]["url"]).content
        poll_until("the fleet to settle again", lambda: _settled(database), timeout=120)
        assert lease(database)["generation"] > before["generation"]
        time.sleep(0.5)
        reporter.halt.set()
        reporter.join(timeout=30)
        http.close()
    assert reporter.acknowledged, reporter.answers
    assert reporter.answers.get("unreachable"), "no report went to the killed replica"
    missing = set(reporter.acknowledged) - stored_reports(
        database, [d["deploymentId"] for d in reported])
    assert not missing, f"acknowledged but not stored: {sorted(missing)[:10]}"
    assert not {k for k in reporter.answers if k.startswith("5")}, reporter.answers


def _settled(database: str) -> bool:
    """No compile asked for that the holder has not answered, and nothing published for a
    moment (a compile that commits nothing publishes nothing)."""
    first = lease(database)
    time.sleep(1.0)
    return lease(database)["generation"] == first["generation"]


def test_postgresql_restarted_under_load_answers_503_then_recovers(tmp_path: Path) -> None:
    """While the database is gone, the replicas answer 503 with Retry-After (never a 2xx
    for what they could not store, never a crash) and `GET /metrics` still answers; once it
    is back they serve again, and every acknowledged capability report is stored."""
    with running_postgres() as postgres:
        database = postgres.create_database("restart")
        data = tmp_path / "replica-0"
        token = json.loads(margo("clients", "add", "edge", "--data", str(data), "--json",
                                 "--database", database).stdout)["token"]
        with replicas(tmp_path, database, 2) as started:
            answers: dict[str, int] = {}
            retry_after: set[str] = set()
            media: set[str] = set()
            acknowledged: list[str] = []
            halt = threading.Event()

            def load(replica: Replica, worker: int) -> None:
                with httpx.Client(base_url=replica.base, timeout=10, headers={
                        "Authorization": f"Bearer {token}"}) as http:
                    n = 0
                    while not halt.is_set():
                        n += 1
                        doc = box(worker)
                        doc["labels"] = {**doc.get("labels", {}),
                                         "example.com/report": f"{worker}-{n}"}
                        try:
                            response = http.put(f"/api/v1/capabilities/box-{worker}",
                                                json=doc)
                        except httpx.TransportError:
                            answers["unreachable"] = answers.get("unreachable", 0) + 1
                            time.sleep(0.05)
                            continue
                        key = str(response.status_code)
                        answers[key] = answers.get(key, 0) + 1
                        if response.status_code == 503:
                            retry_after.add(response.headers.get("retry-after", ""))
                            media.add(response.headers.get("content-type", ""))
                        if response.status_code in (200, 201):
                            acknowledged.append(f"{worker}-{n}")
                        time.sleep(0.02)

            threads = [threading.Thread(target=load, args=(started[w % 2], w), daemon=True)
                       for w in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(1.5)
            before = len(acknowledged)
            postgres.stop(mode="immediate")  # as a crash would: no clean shutdown
            poll_until("503 answers", lambda: answers.get("503", 0) >= 8, timeout=30)
            acknowledged_while_down = len(acknowledged)
            # A scrape still answers, with the process's own figures: the alerts about an
            # unreachable database need them (wfm/fleet/fleetmetrics.py).
            scraped = httpx.get(f"{started[0].base}/metrics", timeout=30)
            assert scraped.status_code == 200, scraped.text
            assert "margo_http_requests_total{" in scraped.text
            time.sleep(1.0)
            assert len(acknowledged) == acknowledged_while_down, "acknowledged without a store"
            postgres.start()
            poll_until("acknowledged reports again", lambda: len(acknowledged)
                       > acknowledged_while_down + 8, timeout=60)
            halt.set()
            for thread in threads:
                thread.join(timeout=30)
            for replica in started:
                assert replica.process is not None and replica.process.poll() is None
            assert before > 0
            assert media == {"application/problem+json"}, media
            assert retry_after and all(v.isdigit() and int(v) > 0 for v in retry_after)
            assert not {k for k in answers if k.startswith("5") and k != "503"}, answers
            with psycopg.connect(database, autocommit=True) as conn:
                rows = conn.execute("SELECT document FROM capability_reports").fetchall()
            stored = {json.loads(doc).get("labels", {}).get("example.com/report")
                      for (doc,) in rows}
            # Each device keeps its newest `records.CAPABILITY_HISTORY` changes: none of the
            # acknowledged reports since the oldest one kept may be missing, nor the newest.
            missing = []
            for worker in range(4):
                kept = [int(r.split("-")[1]) for r in stored if r and r.startswith(f"{worker}-")]
                mine = [int(a.split("-")[1]) for a in acknowledged
                        if a.startswith(f"{worker}-")]
                assert kept and mine and max(mine) in kept, (worker, mine[-3:], sorted(kept)[-3:])
                missing += [f"{worker}-{n}" for n in mine if n >= min(kept) and n not in kept]
            assert not missing, f"acknowledged but not stored: {sorted(missing)[:10]}"



def test_a_device_polling_both_replicas_never_sees_its_version_go_back(tmp_path: Path) -> None:
    """Capabilities change (each change gives the device a new greeting) while the device
    polls its manifest alternately on both replicas with its last ETag: versions never go
    backwards, every ETag names one body, every version one body, and a 304 only answers
    the ETag of the newest state that replica has."""
    database = fresh_database()
    data = tmp_path / "replica-0"
    token = json.loads(margo("clients", "add", "edge", "--data", str(data), "--json",
                             "--database", database).stdout)["token"]
    fleet = tmp_path / "fleet"
    shutil.copytree(ROOT / "examples" / "fleet", fleet)
    headers = {"Authorization": f"Bearer {token}"}
    with replicas(tmp_path, database, 2, "--source", str(fleet)) as started:
        clients = [httpx.Client(base_url=r.base, headers=headers, timeout=10) for r in started]
        seen: list[tuple[int, str, bytes]] = []
        halt = threading.Event()

        def poll() -> None:
            etag, n = None, 0
            while not halt.is_set():
                n += 1
                response = clients[n % 2].get("/api/v1/deployments", headers={
                    "If-None-Match": etag} if etag else {})
                if response.status_code == 304:
                    assert response.headers["etag"] == etag
                    continue
                assert response.status_code == 200, response.text
                etag = response.headers["etag"]
                seen.append((response.json()["manifestVersion"], etag, response.content))

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        for site in range(8):
            doc = json.loads((CAPS / "compose-box-amd64.json").read_text())
            doc["labels"]["example.com/site"] = f"plant-{site}"
            assert clients[site % 2].put("/api/v1/capabilities/compose-box-amd64",
                                         json=doc).status_code in (200, 201)
            time.sleep(0.7)

        def last_change_served() -> bool:
            deployments = json.loads(seen[-1][2])["deployments"] if seen else []
            return bool(deployments) and b"plant-7" in clients[0].get(
                deployments[0]["url"]).content

        poll_until("the last change to be served", last_change_served, timeout=30)
        halt.set()
        poller.join(timeout=30)
        for client in clients:
            client.close()
    versions = [version for version, _, _ in seen]
    assert versions == sorted(versions), versions
    assert len(set(versions)) >= 5, versions  # the changes were seen, not only the last
    by_etag: dict[str, set[tuple[int, bytes]]] = {}
    by_version: dict[int, set[bytes]] = {}
    for version, etag, body in seen:
        by_etag.setdefault(etag, set()).add((version, body))
        by_version.setdefault(version, set()).add(body)
    assert all(len(v) == 1 for v in by_etag.values())
    assert all(len(v) == 1 for v in by_version.values())
    states = [json.dumps(json.loads(body)["deployments"], sort_keys=True)
              for _, _, body in seen]
    runs = [state for i, state in enumerate(states) if i == 0 or states[i - 1] != state]
    assert len(runs) == len(set(runs)), "an older desired state came back"
