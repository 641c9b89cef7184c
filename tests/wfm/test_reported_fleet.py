"""`wfm.fleet.reported.ReportedFleet`: the snapshot a server's compile starts from reads,
decodes and checks only the documents reported since the last one, and is always the
snapshot built from every stored document (`snapshot_from_documents`): same devices,
digests, generations, models and problems, whatever changed in between. On the real
SQLite store."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.capskit import cluster_manifest
from kits.fleetkit import device

from compiler.snapshot import Snapshot, snapshot_from_documents
from margo.digests import data_digest
from wfm.fleet.reported import ReportedFleet
from wfm.store import records
from wfm.store.sqlitedb import SqliteDatabase


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SqliteDatabase]:
    store = SqliteDatabase(tmp_path / "wfm.sqlite")
    yield store
    store.close()


def report(db: SqliteDatabase, device_id: str, document: dict[str, Any],
           shape: str = "rc.3") -> None:
    db.write_sync(lambda c: records.store_capabilities(
        c, client_id="acme", device_id=device_id, document=document,
        digest=data_digest(document), shape=shape))


def forget(db: SqliteDatabase, device_id: str) -> None:
    db.write_sync(lambda c: c.execute("DELETE FROM devices WHERE device_id = ?", (device_id,)))


def facts(snapshot: Snapshot) -> dict[str, Any]:
    """Everything a compile reads of a snapshot."""
    return {"devices": {d.id: (d.digest, d.generation, d.file, d.capabilities, dict(d.labels))
                        for d in snapshot.devices.values()},
            "order": list(snapshot.devices),
            "problems": [p.format() for p in snapshot.problems],
            "broken": sorted(snapshot.broken), "digest": snapshot.digest}


def from_scratch(db: SqliteDatabase) -> Snapshot:
    return snapshot_from_documents(db.read(records.device_documents))


def test_each_snapshot_is_the_one_built_from_every_document(db: SqliteDatabase) -> None:
    for index in range(6):
        report(db, f"edge-{index}", device(f"edge-{index}", labels={"zone": f"z{index % 2}"}))
    report(db, "rc2-box", device("rc2-box"), shape="rc.2")
    report(db, "cluster-1", cluster_manifest("cluster-1"))
    broken = device("broken")
    broken["properties"]["cpus"] = "many"
    report(db, "broken", broken)
    report(db, "liar", device("someone-else"))
    fleet = ReportedFleet(db.read)

    def same() -> int:
        assert facts(fleet.snapshot({})) == facts(from_scratch(db))
        return fleet.last_read

    assert same() == 10  # everything, the first time
    # Unchanged: only what is never remembered (a cluster manifest, whose document the
    # compiler makes; and documents with problems, reported at every compile).
    assert same() == 3
    changed = device("edge-2", cores=16, labels={"zone": "z9"})
    report(db, "edge-2", changed)
    assert same() == 4
    report(db, "edge-2", changed)  # reported again, same content: nothing to read
    assert same() == 3
    report(db, "edge-3", device("edge-3", labels={"zone": "z1"}), shape="rc.2")  # generation
    assert same() == 4
    forget(db, "edge-4")
    report(db, "edge-9", device("edge-9"))
    assert same() == 4
    report(db, "broken", device("broken"))  # repaired: remembered from now on
    assert same() == 3
    assert same() == 2


def test_a_snapshot_is_built_afresh_each_time(db: SqliteDatabase) -> None:
    """No model built for one compile is handed to the next (each holds fresh devices)."""
    report(db, "edge-0", device("edge-0"))
    fleet = ReportedFleet(db.read)
    first = fleet.snapshot({})
    assert first.devices["edge-0"].capabilities is not None
    second = fleet.snapshot({})
    assert second.devices["edge-0"] is not first.devices["edge-0"]
    assert second.devices["edge-0"] == first.devices["edge-0"]


def test_a_document_changed_behind_an_unchanged_digest_is_not_read(
        db: SqliteDatabase) -> None:
    """The store's digest is what says a document changed: the server writes both in one
    statement (`records.store_capabilities`), so they never disagree but by hand."""
    original = device("edge-0", cores=4)
    report(db, "edge-0", original)
    fleet = ReportedFleet(db.read)
    fleet.snapshot({})
    edited = copy.deepcopy(original)
    edited["properties"]["cpus"][0]["cores"] = 64
    db.write_sync(lambda c: c.execute("UPDATE devices SET document = ? WHERE device_id = ?",
                                      (json.dumps(edited), "edge-0")))
    assert fleet.snapshot({}).devices["edge-0"].capabilities == \
        from_scratch_of(original).devices["edge-0"].capabilities
    assert fleet.last_read == 0


def from_scratch_of(document: dict[str, Any]) -> Snapshot:
    return snapshot_from_documents({document["properties"]["id"]: document})


def test_a_device_read_afresh_may_drop_its_model_and_build_the_same_again(
        db: SqliteDatabase) -> None:
    """What a compile does once a device's result is accounted (`Device.release`): the
    first snapshot's devices, decoded from the store, can drop their models too (not only
    the remembered ones of later snapshots), and build the same ones from the stored text."""
    report(db, "edge-1", device("edge-1", labels={"zone": "z1"}))
    report(db, "rc2-box", device("rc2-box"), shape="rc.2")
    report(db, "cluster-1", cluster_manifest("cluster-1"))  # not its own document: kept
    snapshot = ReportedFleet(db.read).snapshot({})
    before = facts(snapshot)
    for found in snapshot.devices.values():
        found.release()
    released = {d.id: d._capabilities is None for d in snapshot.devices.values()}
    assert released == {"edge-1": True, "rc2-box": True, "cluster-1": False}
    assert facts(snapshot) == before == facts(from_scratch(db))
