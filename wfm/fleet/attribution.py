"""Which bytes of a deployment a status report is about: one notion of "what this device
has adopted", for every kind of device.

A status report says a deployment is `installed` (or `failed`, ...), but of which of its
documents? The deployment's document changes with every update, reconfiguration or
rollout; an `installed` for the previous bytes says nothing about the current ones. So every
status is stored with the digest of the document it is about (`records.Applied`), and
freshness, rollouts, the dashboard and `margo status` compare only that with what the
device's branch holds now.

How the bytes are known, in this order:

1. The report names what the device had adopted:
   - rc.3: `adoptedManifestVersion` (a field of the spec);
   - rc.2: `x-margo-gitops-extensions.adoptedManifestVersion` (our client; the rc.2 body
     has no field for it);
   - a device that follows its Git branch: `x-margo-gitops-extensions.adoptedCommit`.
   A manifestVersion is looked up in what that version held for the client
   (`manifest_history`); a commit in the device's own branch (never another device's).
2. The report names nothing (another vendor's rc.2 or Oct-2024 device): it is attributed
   to what the server last handed out to the device: the commit its last Git fetch of the
   branch's tip delivered (`git_handouts`, from the Git hosting), else the client's newest
   manifestVersion (a manifest is handed out per client; an rc.2 client is one device).
   A report that left the device before a newer state reached it is then attributed to the
   newer state: devices that can say what they adopted should say it.

A claim that cannot be resolved (a version older than the history kept, a commit that is
not on the device's branch here) leaves the bytes unknown: the status does not count for
the current bytes until the device reports again (our client re-asserts its state every
`schedule.resync`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from wfm.store import records
from wfm.store.database import Database, DatabaseUnavailable
from wfm.store.records import UNKNOWN, Applied

__all__ = ["EXTENSION", "Attribution", "Claim", "claim_of"]

#: Our extension object in status reports (the device writes it: `reconciler.statuses`).
EXTENSION = "x-margo-gitops-extensions"
_COMMIT = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")
#: The largest manifestVersion a claim may name (versions stay below 2^63).
_MAX_VERSION = 2**63 - 1
#: (client, manifestVersion) contents `Attribution` remembers (newest used last).
_VERSIONS_KEPT = 20_000
log = logging.getLogger("margo.wfm.attribution")


@dataclass(frozen=True, slots=True)
class Claim:
    """What a report says the device had adopted (either, both or neither)."""

    manifest_version: int | None = None
    commit: str | None = None


def claim_of(document: dict[str, Any]) -> Claim:
    """The adopted state a (validated) status document names. A malformed extension value
    is no claim, never a refusal: extensions are information (the spec says servers must
    not fail on them)."""
    extension = document.get(EXTENSION)
    extension = extension if isinstance(extension, dict) else {}
    version = document.get("adoptedManifestVersion", extension.get("adoptedManifestVersion"))
    if isinstance(version, bool) or not isinstance(version, int) or \
            not 0 < version <= _MAX_VERSION:
        version = None
    commit = extension.get("adoptedCommit")
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        commit = None
    return Claim(version, commit)


class Handouts:
    """The commit each device was last handed over Git, kept in memory at once (so the
    next report is attributed correctly on this server) and written to the database in
    batches (other replicas, restarts): a fetch is a read, and a write per fetch would
    make the Git hosting cost a write per changed device."""

    def __init__(self, db: Database, *, sole_writer: bool = True,
                 flush_every: float = 2.0) -> None:
        """`sole_writer`: this server is the only one (replicas read the database, where
        another replica may have recorded a newer handout than this one remembers)."""
        self._db, self._flush_every, self._sole = db, flush_every, sole_writer
        self._lock = threading.Lock()
        self._known: dict[str, str] = {}
        self._pending: dict[str, tuple[str, float]] = {}
        self._flushed = time.monotonic()

    def delivered(self, device_id: str, commit: str) -> None:
        """The Git hosting handed `device_id` its branch at `commit` (`wfm.git.githttp`)."""
        with self._lock:
            self._known[device_id] = commit
            self._pending[device_id] = (commit, time.time())
            due = time.monotonic() - self._flushed >= self._flush_every
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, {}
            self._flushed = time.monotonic()
        if batch:
            self._db.submit(lambda conn: records.record_git_handouts(conn, batch)) \
                .add_done_callback(lambda done: self._kept(done.exception()
                                                           if not done.cancelled() else None,
                                                           batch))

    def _kept(self, error: BaseException | None, batch: dict[str, tuple[str, float]]) -> None:
        if error is None:
            return
        if not isinstance(error, DatabaseUnavailable):
            log.error("Git handouts of %d device(s) not stored", len(batch), exc_info=error)
            return
        with self._lock:
            for device_id, handout in batch.items():
                self._pending.setdefault(device_id, handout)

    def forget(self, device_id: str) -> None:
        with self._lock:
            self._known.pop(device_id, None)
            self._pending.pop(device_id, None)

    def when(self, device_id: str) -> tuple[str, float] | None:
        """The commit last handed to the device and when (Unix time): the adoption step of
        a change's trace (`wfm.fleet.leadtime`). Blocking: a database read when flushed."""
        with self._lock:
            pending = self._pending.get(device_id)
        if pending is not None:
            return pending
        return self._db.read(lambda conn: records.git_handout_at(conn, device_id))

    async def last(self, device_id: str) -> str | None:
        with self._lock:
            known = self._known.get(device_id) if self._sole else None
        if known is not None:
            return known
        return await self._db.aread(lambda conn: records.git_handout(conn, device_id))


class Attribution:
    """Resolves a report's claim (or, without one, what the device was handed out) to the
    bytes it is about. `deployments_at(device, commit)`: what a commit of the device's
    branch held (`wfm.fleet.desired.DesiredState.deployments_at`; None: not on its branch)."""

    def __init__(self, db: Database,
                 deployments_at: Callable[[str, str], dict[str, str] | None], *,
                 sole_writer: bool = True) -> None:
        self._db, self._deployments_at = db, deployments_at
        self.handouts = Handouts(db, sole_writer=sole_writer)
        #: (client, manifestVersion) -> what it held: a version's contents never change
        #: once written, and every report of a fleet taking up a change names the same few
        #: (a read per report was a tenth of what one process spent on 10,000 devices'
        #: reports, measured with bench/fleet.py).
        self._versions: OrderedDict[tuple[str, int], dict[str, str]] = OrderedDict()

    async def applied(self, *, client_id: str, device_id: str, deployment_id: str,
                      claim: Claim) -> Applied:
        if claim.commit is not None:
            return await self._at_commit(device_id, deployment_id, claim.commit, "")
        if claim.manifest_version is not None:
            return await self._at_version(client_id, deployment_id, claim.manifest_version, "")
        handed = await self.handouts.last(device_id)
        if handed is not None:
            return await self._at_commit(device_id, deployment_id, handed, "handed out: ")
        current = await self._db.aread(lambda conn: records.manifest_version(conn, client_id))
        if current is not None and current[0] > 0:
            return await self._at_version(client_id, deployment_id, current[0], "handed out: ")
        return UNKNOWN

    async def _at_commit(self, device_id: str, deployment_id: str, commit: str,
                         how: str) -> Applied:
        held = await run_in_threadpool(self._deployments_at, device_id, commit)
        if held is None:
            return Applied(None, f"{how}commit {commit[:12]} (not on the device's branch here)")
        return Applied(held.get(deployment_id), f"{how}commit {commit[:12]}")

    async def _at_version(self, client_id: str, deployment_id: str, version: int,
                          how: str) -> Applied:
        held = await self._version(client_id, version)
        if held is None:
            return Applied(None, f"{how}manifestVersion {version} (not remembered)")
        return Applied(held.get(deployment_id), f"{how}manifestVersion {version}")

    def remember(self, client_id: str, version: int, held: dict[str, str]) -> None:
        """What the client's manifestVersion holds, known where it was handed out
        (`wfm.http.manifests`): the reports about it then need no read."""
        self._versions[(client_id, version)] = held
        self._versions.move_to_end((client_id, version))
        while len(self._versions) > _VERSIONS_KEPT:
            self._versions.popitem(last=False)

    async def _version(self, client_id: str, version: int) -> dict[str, str] | None:
        """What the client's manifestVersion held (None: not remembered, or not written yet:
        asked again next time)."""
        key = (client_id, version)
        held = self._versions.get(key)
        if held is not None:
            return held
        contents = await self._db.aread(
            lambda conn: records.manifest_contents(conn, client_id, {version}))
        held = contents.get(version)
        if held is not None:
            self.remember(client_id, version, held)
        return held
