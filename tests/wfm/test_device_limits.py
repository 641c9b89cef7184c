"""What a client's devices may hold of the server (issue 29, item 3): a deleted device's
capability history goes with it (a deleted device never changes again, so retention would
never trim it: register, fill and delete ids kept memory and disk for good, and the previous
owner's documents after the id was re-used), and one client holds at most
`--max-devices-per-client` devices. The running-server tests run again on two replicas
(test_device_limits_replicas.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.pgkit import database_for
from kits.serverkit import ROOT, STORE, add_client, running_server

from wfm.identity.clients import ClientRegistry
from wfm.store import records
from wfm.store.database import Database
from wfm.store.opening import open_database

CAPS = ROOT / "examples" / "capabilities"
LIMIT = 2


def box(device_id: str, serial: int = 0) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CAPS / "compose-box-amd64.json").read_text())
    doc["properties"]["id"] = device_id
    doc["properties"]["serialNumber"] = str(serial)
    return doc


def test_forgetting_a_device_deletes_its_capability_history(store: Database) -> None:
    ClientRegistry(store).add("acme")

    def put(device_id: str, index: int) -> None:
        document = box(device_id, index)
        store.write_sync(lambda c: records.store_capabilities(
            c, client_id="acme", device_id=device_id, document=document,
            digest=f"sha256:{device_id}:{index}", shape="rc3"))

    for index in range(12):
        put("gone", index)
        put("gone/child", index)
    for index in range(3):
        put("kept", index)
    assert store.write_sync(lambda c: records.forget_device(c, "acme", "gone"))
    counts = store.read(lambda c: dict(c.execute(
        "SELECT device_id, COUNT(*) FROM capability_reports GROUP BY device_id").fetchall()))
    assert counts == {"kept": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data = tmp_path_factory.mktemp("limits") / "data"
    tokens = {name: add_client(data, name) for name in ("alice", "bob", "carol")}
    with running_server(data, "--max-devices-per-client", str(LIMIT)) as base:
        yield {"base": base, "tokens": tokens, "data": data}


def client(server: dict[str, Any], name: str) -> httpx.Client:
    return httpx.Client(base_url=server["base"], timeout=10,
                        headers={"Authorization": f"Bearer {server['tokens'][name]}"})


def database(server: dict[str, Any]) -> Database:
    data: Path = server["data"]
    return open_database(data / "wfm.sqlite" if STORE[0] == "sqlite" else database_for(data))


def test_a_client_holds_at_most_its_device_limit(server: dict[str, Any]) -> None:
    with client(server, "alice") as alice:
        for device_id in ("a-1", "a-2"):
            assert alice.put(f"/api/v1/capabilities/{device_id}",
                             json=box(device_id)).status_code == 201
        refused = alice.put("/api/v1/capabilities/a-3", json=box("a-3"))
        assert refused.status_code == 403, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        assert "--max-devices-per-client" in refused.json()["detail"]
        # A device it holds may still report; another client is not limited by alice's.
        assert alice.put("/api/v1/capabilities/a-1", json=box("a-1", 7)).status_code == 200
        with client(server, "bob") as bob:
            assert bob.put("/api/v1/capabilities/b-1", json=box("b-1")).status_code == 201
        assert alice.delete("/api/v1/capabilities/a-2").status_code == 204
        assert alice.put("/api/v1/capabilities/a-3", json=box("a-3")).status_code == 201


def test_a_deleted_device_leaves_no_capability_history(server: dict[str, Any]) -> None:
    with client(server, "bob") as bob:
        for serial in range(10):
            assert bob.put("/api/v1/capabilities/b-filled",
                           json=box("b-filled", serial)).status_code in (200, 201)
        assert bob.delete("/api/v1/capabilities/b-filled").status_code == 204
    db = database(server)
    try:
        left = db.read(lambda c: c.execute("SELECT COUNT(*) FROM capability_reports WHERE "
                                           "device_id = ?", ("b-filled",)).fetchone()[0])
    finally:
        db.close()
    assert left == 0
    # The id re-used by another client: a new start. (carol holds no device in any other
    # test, so this test does not depend on which worker ran alice's.)
    with client(server, "carol") as carol:
        assert carol.put("/api/v1/capabilities/b-filled",
                         json=box("b-filled", 99)).status_code == 201
    db = database(server)
    try:
        kept = db.read(lambda c: [json.loads(r[0])["properties"]["serialNumber"] for r in
                                  c.execute("SELECT document FROM capability_reports WHERE "
                                            "device_id = ?", ("b-filled",)).fetchall()])
    finally:
        db.close()
    assert kept == ["99"]
