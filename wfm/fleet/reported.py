"""The fleet's capability documents as the server's compiles read them: from the store,
decoded and checked again only where a report changed them since the last compile.

Why: every compile of the fleet server starts from a `compiler.snapshot.Snapshot` of what
the devices reported. Built from scratch it decodes every stored document and checks it
(JSON, digest, model), which at 100,000 devices took 4 s of a recompile that changes
nothing (`bench/compile.py --devices 100000 --server`), five times the compile itself.
The store keeps each document's digest beside it, so one read of (device, digest, shape)
tells which documents changed; only those are read, decoded and checked
(`snapshot_from_documents`). Every other device is rebuilt from the document's stored text
(compact sorted-key JSON, what `json.loads` gave the first time), decoded only if the
compile needs it, as a keyed capability file the state trusts is
(`compiler.snapshot.Device`'s span). A device whose document had problems is not
remembered: it is read and its problems reported at every compile, as before.

What is held between compiles: each remembered device's text, digests and generation
(about the size of its JSON: 150 MB at 100,000 devices of the benchmark's documents). A
fresh `Device` is made for every compile, so no compile's decoded models stay behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from compiler.gcpause import collection_paused
from compiler.snapshot import (
    Device,
    ReportedDocuments,
    Snapshot,
    snapshot_from_documents,
    used_as_reported,
)
from margo.kinds import GENERATIONS
from wfm.store import records

__all__ = ["ReportedFleet"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Known:
    """A device's document as the last read found it: its text and what the compiler made
    of it (the digest it gives the device, the generation it was told)."""

    span: tuple[str, int, int]
    device_digest: str
    generation: str | None


class ReportedFleet:
    """One server's reader of the reported fleet, remembering between compiles."""

    def __init__(self, read: Callable[[Callable[[Any], T]], T]) -> None:
        """`read(fn)`: run `fn(connection)` as a read of the server's store."""
        self._read: Callable[[Callable[[Any], Any]], Any] = read
        #: device id -> "<stored digest> <shape>" of each remembered document (`_known`).
        self._keys: dict[str, str] = {}
        self._known: dict[str, _Known] = {}
        #: How many documents the last `snapshot` read, decoded and checked.
        self.last_read = 0

    def snapshot(self, trusted: Mapping[str, str]) -> Snapshot:
        """The snapshot a compile starts from; `trusted`: the compiler state's digests of
        documents that validated before (`CompilerState.trusted_digests`)."""
        with collection_paused():  # 100,000 new objects, none of them in a cycle
            current: dict[str, str] = self._read(records.device_digests)
            stale = sorted(device_id for device_id, _ in current.items() - self._keys.items())
            for device_id in self._keys.keys() - current.keys():  # no longer reported
                del self._keys[device_id], self._known[device_id]
            texts: list[tuple[str, str, str, str]] = (
                self._read(lambda conn: records.device_texts(conn, stale)) if stale else [])
            documents = {device_id: json.loads(text) for device_id, text, _, _ in texts}
            fresh = snapshot_from_documents(ReportedDocuments(
                documents, {device_id: shape for device_id, _, _, shape in texts}),
                trusted=trusted)
            self._remember(fresh, texts, documents)
            self.last_read = len(texts)
            return _merged(fresh, self._known, sorted(current))

    def _remember(self, fresh: Snapshot, texts: list[tuple[str, str, str, str]],
                  documents: Mapping[str, Any]) -> None:
        """Remember each re-read device that came out usable with its document as stored:
        not a cluster manifest (the compiler makes another document of one) and claiming
        its own id. Any other is forgotten, so it is read again next time."""
        for device_id, text, digest, shape in texts:
            device = fresh.devices.get(device_id)
            self._keys.pop(device_id, None)
            self._known.pop(device_id, None)
            if device is None or not used_as_reported(device_id, documents[device_id]):
                continue
            self._keys[device_id] = f"{digest} {shape}"
            self._known[device_id] = known = _Known((text, 0, len(text)), device.digest,
                                                    shape if shape in GENERATIONS else None)
            # Its model may then be dropped once its result is accounted (`Device.release`)
            # and built again from the text if asked: without it, a first compile of a
            # million reported devices held every model to its end (16 GB in one process,
            # more than this 24 GiB machine with its two workers; a keyed file: 7 GB).
            device.keep_span(known.span)


def _merged(fresh: Snapshot, known: Mapping[str, _Known], device_ids: list[str]) -> Snapshot:
    """`fresh` (the re-read devices, their problems) with every remembered one added, each
    a new `Device` decoding its text when first needed, in device order as
    `snapshot_from_documents` gives them."""
    devices: dict[str, Device] = {}
    fresh_devices, broken = fresh.devices, fresh.broken
    for device_id in device_ids:
        device = fresh_devices.get(device_id)
        if device is not None:
            devices[device_id] = device
        elif device_id not in broken and (entry := known.get(device_id)) is not None:
            devices[device_id] = Device(device_id, None, entry.device_digest, None,
                                        span=entry.span, generation=entry.generation)
    return Snapshot(devices=devices, problems=fresh.problems, broken=fresh.broken)
