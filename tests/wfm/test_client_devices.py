"""`wfm.fleet.clientdevices`: remembered per client while this process is the only writer, read
every time otherwise, and never remembering an answer a concurrent change made stale."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from wfm.fleet.clientdevices import ClientDevices
from wfm.store import records
from wfm.store.sqlitedb import SqliteDatabase


def register(db: SqliteDatabase, client_id: str, device_id: str) -> None:
    doc = {"properties": {"id": device_id}}
    db.write_sync(lambda c: records.store_capabilities(
        c, client_id=client_id, device_id=device_id, document=doc, digest=device_id,
        shape="rc3"))


def test_the_sole_writer_remembers_until_told_of_a_change(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "wfm.sqlite")
    try:
        devices = ClientDevices(db, sole_writer=True)
        register(db, "acme", "b")
        assert asyncio.run(devices.of("acme")) == ("b",)
        register(db, "acme", "a")
        assert asyncio.run(devices.of("acme")) == ("b",)  # remembered: no read
        devices.changed("acme")
        assert asyncio.run(devices.of("acme")) == ("a", "b")
        db.write_sync(lambda c: records.forget_device(c, "acme", "b"))
        devices.changed("acme")
        assert asyncio.run(devices.of("acme")) == ("a",)
        assert asyncio.run(devices.of("other")) == ()
    finally:
        db.close()


def test_with_other_writers_every_lookup_reads(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "wfm.sqlite")
    try:
        devices = ClientDevices(db, sole_writer=False)
        assert asyncio.run(devices.of("acme")) == ()
        register(db, "acme", "a")  # as another replica would: nobody tells this one
        assert asyncio.run(devices.of("acme")) == ("a",)
    finally:
        db.close()


class _HeldReads(SqliteDatabase):
    """Reads on a worker thread (as `remote_reads` stores do), held until released: the
    one way to have a change land while a read is in flight, on demand."""

    remote_reads = True

    def __init__(self, path: Path):
        super().__init__(path)
        self.started, self.release = threading.Event(), threading.Event()

    def read(self, fn: Any) -> Any:
        value = super().read(fn)
        self.started.set()
        self.release.wait(10)
        return value


def test_an_answer_read_before_a_change_is_not_remembered(tmp_path: Path) -> None:
    db = _HeldReads(tmp_path / "wfm.sqlite")
    try:
        devices = ClientDevices(db, sole_writer=True)

        async def scenario() -> tuple[str, ...]:
            lookup = asyncio.ensure_future(devices.of("acme"))
            await asyncio.to_thread(db.started.wait, 10)
            register(db, "acme", "a")  # committed after the read saw nothing
            devices.changed("acme")
            db.release.set()
            assert await lookup == ()  # what the read saw, but not remembered:
            return await devices.of("acme")

        assert asyncio.run(scenario()) == ("a",)
    finally:
        db.close()
