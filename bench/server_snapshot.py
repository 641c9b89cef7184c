"""Benchmark part: the fleet server's compile input at fleet scale (`bench/compile.py
--server`).

A server compiles from what its devices reported, kept in its store, not from a file: it
builds the compiler's snapshot from the stored documents (`wfm.fleet.reported`). This
stores the benchmark's capability documents in a real SQLite store of the server (one
client, untimed) and times building that snapshot: the first time (every document read,
decoded and checked), again with nothing changed, and after one device reported a new
document; and, for comparison, building it from every stored document as the server did
before (`records.device_documents` and `snapshot_from_documents`).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from compiler.snapshot import snapshot_from_documents
from margo.digests import data_digest
from wfm.fleet.reported import ReportedFleet
from wfm.store import records
from wfm.store.database import Connection, Database
from wfm.store.sqlitedb import SqliteDatabase

__all__ = ["measure_server_snapshot", "store_reports"]


def store_reports(db: Database, caps: Path, client_of: Callable[[str], str]) -> None:
    """Every device's document of the capability file as the server stores a report (one
    transaction), reported by client `client_of(device_id)`."""
    documents = json.loads(caps.read_text())

    def write(conn: Connection) -> None:
        for device_id, document in documents.items():
            records.store_capabilities(conn, client_id=client_of(device_id),
                                       device_id=device_id, document=document,
                                       digest=data_digest(document), shape="rc.3")

    db.write_sync(write)


def measure_server_snapshot(caps: Path) -> dict[str, float]:
    """The figures (seconds), printed at the end. The first read trusts nothing (a first
    compile); the others trust what it found, as the compiler state would after a compile."""
    with tempfile.TemporaryDirectory(prefix="margo-bench-server-") as tmp:
        db = SqliteDatabase(Path(tmp) / "wfm.sqlite")
        try:
            store_reports(db, caps, lambda device_id: "bench")
            fleet = ReportedFleet(db.read)
            start = time.perf_counter()
            snapshot = fleet.snapshot({})
            figures = {"server snapshot, first s": time.perf_counter() - start}
            trusted = {device_id: device.digest for device_id, device in snapshot.devices.items()}
            start = time.perf_counter()
            fleet.snapshot(trusted)
            figures["server snapshot, unchanged s"] = time.perf_counter() - start
            first_id = next(iter(snapshot.devices))
            document = json.loads(db.read(lambda c: records.device_texts(c, [first_id]))[0][1])
            document.setdefault("labels", {})["bench"] = "changed"
            db.write_sync(lambda c: records.store_capabilities(
                c, client_id="bench", device_id=first_id, document=document,
                digest=data_digest(document), shape="rc.3"))
            start = time.perf_counter()
            fleet.snapshot(trusted)
            figures["server snapshot, one report s"] = time.perf_counter() - start
            start = time.perf_counter()
            snapshot_from_documents(db.read(records.device_documents), trusted=trusted)
            figures["server snapshot, every document s"] = time.perf_counter() - start
        finally:
            db.close()
    print(f"server's compile input ({len(snapshot.devices):,} devices in its store): "
          f"first {figures['server snapshot, first s']:.2f} s, "
          f"unchanged {figures['server snapshot, unchanged s']:.2f} s, "
          f"after one report {figures['server snapshot, one report s']:.2f} s; "
          f"from every stored document (as before) "
          f"{figures['server snapshot, every document s']:.2f} s", flush=True)
    return figures
