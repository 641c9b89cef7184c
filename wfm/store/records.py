"""The server's rows, read and written: what devices report (capabilities and deployment
status, current and history), which client owns a device, and each client's
manifestVersion. Functions here run inside the database's writer or reader threads; the
API holds no SQL of its own."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from compiler.snapshot import ReportedDocuments
from margo.digests import data_digest, sorted_json
from wfm.store.database import Connection
from wfm.store.fleet_rows import id_lists, value_rows

__all__ = ["CAPABILITY_HISTORY", "DEVICE_TIME", "HISTORY_VERSIONS", "STATUS_HISTORY",
           "STATUS_HISTORY_BYTES", "UNKNOWN", "Applied", "CapabilityWrite", "DeviceLimitReached",
           "DeviceRow", "StatusReport", "StatusWrite", "advance_manifest_version",
           "client_devices", "client_polls", "clients_devices", "device_digests",
           "device_documents", "device_owner", "device_row", "device_rows", "device_texts",
           "device_time", "forget_device", "git_handout", "git_handout_at", "manifest_contents",
           "manifest_contents_of", "manifest_version", "raise_manifest_generation",
           "record_git_handouts", "record_polls", "report_meaning", "rollout_progressing",
           "status_device", "status_history", "statuses_by_deployment", "store_capabilities",
           "store_status", "store_statuses", "trim_capability_history", "trim_status_history"]


@dataclass(frozen=True, slots=True)
class DeviceRow:
    device_id: str
    client_id: str
    document: dict[str, Any]
    digest: str
    shape: str
    reported_at: float


@dataclass(frozen=True, slots=True)
class CapabilityWrite:
    created: bool
    changed: bool


def device_row(conn: Connection, device_id: str) -> DeviceRow | None:
    row = conn.execute("SELECT device_id, client_id, document, digest, shape, reported_at "
                       "FROM devices WHERE device_id = ?", (device_id,)).fetchone()
    if row is None:
        return None
    return DeviceRow(row[0], row[1], json.loads(row[2]), row[3], row[4], row[5])


def device_rows(conn: Connection) -> list[DeviceRow]:
    """Every device's row, by device id: one query for a fleet-wide view."""
    return [DeviceRow(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5]) for r in conn.execute(
        "SELECT device_id, client_id, document, digest, shape, reported_at FROM devices "
        "ORDER BY device_id")]


def device_owner(conn: Connection, device_id: str) -> str | None:
    """The client a device belongs to, or None for a device never reported."""
    row = conn.execute("SELECT client_id FROM devices WHERE device_id = ?",
                       (device_id,)).fetchone()
    return None if row is None else str(row[0])


def manifest_version(conn: Connection, client_id: str) -> tuple[int, str] | None:
    """A client's current manifestVersion and the digest of the state it was given for."""
    row = conn.execute("SELECT manifest_version, manifest_state FROM clients "
                       "WHERE client_id = ?", (client_id,)).fetchone()
    return None if row is None else (int(row[0]), str(row[1] or ""))


#: Manifest versions remembered per client (older statuses than that are not matched).
HISTORY_VERSIONS = 50
#: The older ones are deleted on every this-many-th version (a statement saved per poll).
_HISTORY_TRIM_EVERY = 10


def advance_manifest_version(conn: Connection, client_id: str, state_digest: str,
                             generation: int = 0,
                             deployments: dict[str, str] | None = None) -> int | None:
    """The manifestVersion for `state_digest`: +1 when the served state changed (or for the
    first one), else the current one. Only ever grows. None when the client was last given a
    state of a newer fleet `generation` than the one `state_digest` was computed at (a
    replica that has not synced yet must not hand out an older state under a newer
    version); a single server always passes generation 0. `deployments` (id -> digest) is
    recorded as what a new version holds (`manifest_history`, for `wfm.fleet.freshness`)."""
    returned = conn.execute(
        "UPDATE clients SET manifest_version = manifest_version + 1, "
        "manifest_state = ?, manifest_generation = ? WHERE client_id = ? AND "
        "(manifest_state != ? OR manifest_version = 0) AND manifest_generation <= ? "
        "RETURNING manifest_version, manifest_state",
        (state_digest, generation, client_id, state_digest, generation)).fetchall()
    # (fetchall: SQLite finishes a RETURNING statement only once its rows are all read)
    moved = bool(returned)
    row = returned[0] if returned else None
    if not moved:
        row = conn.execute("SELECT manifest_version, manifest_state FROM clients "
                           "WHERE client_id = ?", (client_id,)).fetchone()
    if row is None or row[1] != state_digest:
        return None
    version = int(row[0])
    if moved and deployments is not None:
        conn.execute("INSERT INTO manifest_history (client_id, version, deployments, "
                     "created_at) VALUES (?, ?, ?, ?) ON CONFLICT (client_id, version) DO "
                     "NOTHING", (client_id, version, json.dumps(deployments, sort_keys=True),
                                 time.time()))
        if version % _HISTORY_TRIM_EVERY == 0:  # between HISTORY_VERSIONS and +10 are kept
            conn.execute("DELETE FROM manifest_history WHERE client_id = ? AND version <= ?",
                         (client_id, version - HISTORY_VERSIONS))
    return version


def manifest_contents(conn: Connection, client_id: str,
                      versions: set[int]) -> dict[int, dict[str, str]]:
    """What each of these manifestVersions held (deployment id -> digest), as far as
    remembered."""
    if not versions:
        return {}
    marks = ", ".join("?" for _ in versions)
    rows = conn.execute(f"SELECT version, deployments FROM manifest_history WHERE "
                        f"client_id = ? AND version IN ({marks})",
                        (client_id, *sorted(versions))).fetchall()
    return {int(v): json.loads(d) for v, d in rows}


def manifest_contents_of(conn: Connection, wanted: Iterable[tuple[str, int]],
                         ) -> dict[str, dict[int, dict[str, str]]]:
    """`manifest_contents` for many (client, version) pairs at once, by client: a
    fleet-wide view asks for every device's adopted version, and one query per device made
    the read API's device list cost a round trip per device."""
    pairs = sorted(set(wanted))
    found: dict[str, dict[int, dict[str, str]]] = {}
    for start in range(0, len(pairs), 500):
        chunk = pairs[start:start + 500]
        marks = ", ".join("(?, ?)" for _ in chunk)
        rows = conn.execute(f"SELECT client_id, version, deployments FROM manifest_history "
                            f"WHERE (client_id, version) IN (VALUES {marks})",
                            tuple(v for pair in chunk for v in pair)).fetchall()
        for client_id, version, deployments in rows:
            found.setdefault(client_id, {})[int(version)] = json.loads(deployments)
    return found


def client_polls(conn: Connection) -> dict[str, tuple[float | None, float | None]]:
    """Every client's last poll time and observed polling interval."""
    return {r[0]: (r[1], r[2]) for r in conn.execute(
        "SELECT client_id, last_poll, poll_interval FROM clients")}


def record_polls(conn: Connection, polls: dict[str, tuple[float, float | None]]) -> None:
    """Store a batch of polls (`wfm.fleet.lastseen`); an unknown interval keeps the stored one.
    One statement for the batch (`executemany`): 10,000 waiting devices renew every minute,
    and a statement each was most of what the writer spent on a quiet fleet."""
    conn.executemany("UPDATE clients SET last_poll = ?, poll_interval = COALESCE(?, "
                     "poll_interval) WHERE client_id = ?",
                     [(when, interval, client_id)
                      for client_id, (when, interval) in polls.items()])


def record_git_handouts(conn: Connection, handouts: dict[str, tuple[str, float]]) -> None:
    """Store which commit each device was last handed over Git (device -> (commit, when)),
    a batch at a time (`wfm.fleet.attribution.Handouts`)."""
    conn.executemany("INSERT INTO git_handouts (device_id, commit_id, handed_at) "
                     "VALUES (?, ?, ?) ON CONFLICT (device_id) DO UPDATE SET "
                     "commit_id = excluded.commit_id, handed_at = excluded.handed_at",
                     [(device_id, commit, when)
                      for device_id, (commit, when) in handouts.items()])


def git_handout(conn: Connection, device_id: str) -> str | None:
    """The commit the device was last handed over Git, if it ever fetched one."""
    row = conn.execute("SELECT commit_id FROM git_handouts WHERE device_id = ?",
                       (device_id,)).fetchone()
    return None if row is None else str(row[0])


def git_handout_at(conn: Connection, device_id: str) -> tuple[str, float] | None:
    """The commit the device was last handed over Git and when (Unix time)."""
    row = conn.execute("SELECT commit_id, handed_at FROM git_handouts WHERE device_id = ?",
                       (device_id,)).fetchone()
    return None if row is None else (str(row[0]), float(row[1]))


def status_device(conn: Connection, deployment_id: str,
                  client_id: str) -> str | None:
    """The device a deployment's stored status was reported for ("" when the report named
    none), or None when there is no status."""
    row = conn.execute("SELECT device_id FROM statuses WHERE deployment_id = ? AND "
                       "client_id = ?", (deployment_id, client_id)).fetchone()
    return None if row is None else (row[0] or "")


def client_devices(conn: Connection, client_id: str) -> tuple[str, ...]:
    rows = conn.execute("SELECT device_id FROM devices WHERE client_id = ? ORDER BY device_id",
                        (client_id,))
    return tuple(r[0] for r in rows)


def clients_devices(conn: Connection, client_ids: Sequence[str]
                    ) -> dict[str, tuple[str, ...]]:
    """`client_devices` of many clients in one statement (a client without devices is not
    in the answer)."""
    found: dict[str, list[str]] = {}
    for chunk, marks in id_lists(list(client_ids)):
        for client_id, device_id in conn.execute(
                f"SELECT client_id, device_id FROM devices WHERE client_id IN ({marks}) "
                "ORDER BY client_id, device_id", tuple(chunk)):
            found.setdefault(client_id, []).append(device_id)
    return {client_id: tuple(devices) for client_id, devices in found.items()}


def device_documents(conn: Connection) -> ReportedDocuments:
    """Every device's current capability document, with the generation its client spoke
    (the compiler's snapshot: `compiler.snapshot.ReportedDocuments`)."""
    rows = conn.execute("SELECT device_id, document, shape FROM devices").fetchall()
    return ReportedDocuments({r[0]: json.loads(r[1]) for r in rows}, {r[0]: r[2] for r in rows})


def device_digests(conn: Connection) -> dict[str, str]:
    """Device id -> ``<digest> <shape>`` of its current capability document: what tells a
    compile which documents changed since it last read them (`wfm.fleet.reported`) without
    reading the documents (one string per device, so that 100,000 compare in C)."""
    return dict(conn.execute("SELECT device_id, digest || ' ' || shape FROM devices"))


def device_texts(conn: Connection, device_ids: list[str]) -> list[tuple[str, str, str, str]]:
    """(device id, document as stored: compact sorted-key JSON, its digest, shape) of these
    devices; a device no longer stored is left out."""
    found: list[tuple[str, str, str, str]] = []
    for chunk, marks in id_lists(device_ids):
        found += [(r[0], r[1], r[2], r[3]) for r in conn.execute(
            "SELECT device_id, document, digest, shape FROM devices "
            f"WHERE device_id IN ({marks})", chunk)]
    return found


class DeviceLimitReached(Exception):
    """A client holding `limit` devices reported a new one (`store_capabilities`)."""

    def __init__(self, client_id: str, limit: int) -> None:
        super().__init__(client_id, limit)
        self.client_id, self.limit = client_id, limit


def store_capabilities(conn: Connection, *, client_id: str, device_id: str,
                       document: dict[str, Any], digest: str, shape: str,
                       max_devices: int | None = None) -> CapabilityWrite:
    """Upsert the current document; append to history only when its content changed.
    `max_devices`: the most devices one client may hold; a new device beyond it raises
    `DeviceLimitReached` (every device costs its history and a branch, so one client's
    credentials must not be able to fill the server)."""
    now = time.time()
    existing = conn.execute("SELECT client_id, digest, shape FROM devices WHERE device_id = ?",
                            (device_id,)).fetchone()
    if existing is not None and existing[0] != client_id:
        raise PermissionError(device_id)
    if existing is None and max_devices is not None and conn.execute(
            "SELECT COUNT(*) FROM devices WHERE client_id = ?",
            (client_id,)).fetchone()[0] >= max_devices:
        raise DeviceLimitReached(client_id, max_devices)
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    conn.execute(
        "INSERT INTO devices (device_id, client_id, document, digest, shape, reported_at, "
        "created_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (device_id) DO UPDATE SET "
        "document = excluded.document, digest = excluded.digest, shape = excluded.shape, "
        "reported_at = excluded.reported_at",
        (device_id, client_id, text, digest, shape, now, now))
    # A device whose client moved to another API generation changed too: its documents'
    # shape follows (the history then holds the same document twice).
    changed = existing is None or existing[1] != digest or existing[2] != shape
    if changed:
        conn.execute("INSERT INTO capability_reports (device_id, client_id, digest, document, "
                     "reported_at) VALUES (?, ?, ?, ?, ?)",
                     (device_id, client_id, digest, text, now))
        if existing is not None:
            trim_capability_history(conn, device_id)
    return CapabilityWrite(created=existing is None, changed=changed)


#: Capability documents kept per device in `capability_reports` (its history): the newest
#: this many changes. A device sends a new document only when what it has changes, so a
#: trim (one indexed range delete) comes with a change, never with an unchanged report.
CAPABILITY_HISTORY = 50


def trim_capability_history(conn: Connection, device_id: str,
                            keep: int = CAPABILITY_HISTORY) -> int:
    """Delete all but the newest `keep` capability reports of a device; the number deleted.
    Without it a device that flips its document (or a client that reports for it over and
    over, each time different) grew the table without bound."""
    row = conn.execute("SELECT id FROM capability_reports WHERE device_id = ? "
                       "ORDER BY id DESC LIMIT 1 OFFSET ?",
                       (device_id, max(keep, 1) - 1)).fetchone()
    if row is None:
        return 0
    return max(conn.execute("DELETE FROM capability_reports WHERE device_id = ? AND id < ?",
                            (device_id, row[0])).rowcount, 0)


def forget_device(conn: Connection, client_id: str, device_id: str) -> bool:
    """Remove a device (and its children, ``<id>/...``, matched exactly: in LIKE, an
    id's ``_`` matches any character) of this client, with everything it reported: its
    statuses, current and history, its capability history and its lead-time marks
    (`wfm.fleet.leadtime`). A device id belongs to one
    client, and whoever registers it next must neither see nor be credited with the
    previous owner's reports; and a deleted device never changes again, so history kept
    for it would never be trimmed (register, fill and delete ids: memory held for good)."""
    family = [(client_id, str(r[0])) for r in conn.execute(
        "SELECT device_id FROM devices WHERE client_id = ? AND (device_id = ? OR "
        "substr(device_id, 1, ?) = ?)",
        (client_id, device_id, len(device_id) + 1, device_id + "/")).fetchall()]
    deployments = [(client_id, str(r[0])) for pair in family for r in conn.execute(
        "SELECT deployment_id FROM statuses WHERE client_id = ? AND device_id = ?",
        pair).fetchall()]
    for pair in deployments:
        conn.execute("DELETE FROM status_reports WHERE client_id = ? AND deployment_id = ?",
                     pair)
        conn.execute("DELETE FROM statuses WHERE client_id = ? AND deployment_id = ?", pair)
    for pair in family:
        conn.execute("DELETE FROM devices WHERE client_id = ? AND device_id = ?", pair)
        conn.execute("DELETE FROM capability_reports WHERE client_id = ? AND device_id = ?",
                     pair)
        conn.execute("DELETE FROM git_handouts WHERE device_id = ?", (pair[1],))
        conn.execute("DELETE FROM lead_marks WHERE device_id = ?", (pair[1],))
    return bool(family)


@dataclass(frozen=True, slots=True)
class StatusWrite:
    created: bool
    changed: bool


#: Status reports kept per deployment in `status_reports` (its history): the newest this
#: many, and at most `_STATUS_TRIM_EVERY` more between two trims. A report that changes
#: nothing is not history (see `store_status`), so this is this many changes of state.
STATUS_HISTORY = 100
#: A deployment's history is trimmed back to `STATUS_HISTORY` once it holds this many more:
#: one indexed DELETE per this-many changed reports, never one per report (status writes
#: are what the server's writer spends its time on).
_STATUS_TRIM_EVERY = 20
#: The most a history row stores of a report's document (UTF-8 bytes). A larger report
#: (the API takes up to 1 MiB) is kept whole as the current status, but its history row
#: holds a summary: the states, the component names, and how large the report was.
STATUS_HISTORY_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class Applied:
    """Which bytes of its deployment a status report is about (`wfm.fleet.attribution`): the
    digest of the document the device had adopted (None: not known, or the adopted state
    did not hold the deployment), and how that was known, for people."""

    digest: str | None
    via: str


#: A status whose adopted state is not known at all.
UNKNOWN = Applied(None, "unknown")


def report_meaning(document: dict[str, Any], applied: Applied) -> str:
    """What a report says: its states and errors and the bytes they are about, without
    when the device observed them or which manifestVersion named those bytes. Two reports
    that mean the same are one entry of history (a device re-asserting its state)."""
    return data_digest({"status": document.get("status"),
                        "components": document.get("components"),
                        "deviceId": document.get("deviceId"), "applied": applied.digest})


@dataclass(frozen=True, slots=True)
class StatusReport:
    """One status report as stored (`store_status`, `store_statuses`)."""

    client_id: str
    deployment_id: str
    device_id: str | None
    state: str
    document: dict[str, Any]
    digest: str
    adopted: int | None
    applied: Applied = UNKNOWN
    #: `document`'s `sorted_json`, when the caller made it for `digest` (else made here).
    text: str | None = None


def store_status(conn: Connection, *, client_id: str, deployment_id: str,
                 device_id: str | None, state: str, document: dict[str, Any], digest: str,
                 adopted: int | None, applied: Applied = UNKNOWN,
                 history: int = STATUS_HISTORY) -> StatusWrite:
    """Idempotent: the same report twice changes nothing and adds no history, and a report
    that says what the stored one says (`report_meaning`: the same states about the same
    bytes; a device re-asserting its state) only refreshes the stored one. A changed
    report is appended to the deployment's history, which keeps the last `history` of them
    (trimmed every `_STATUS_TRIM_EVERY` reports, by the count kept on the status row)."""
    report = StatusReport(client_id, deployment_id, device_id, state, document, digest,
                          adopted, applied)
    return store_statuses(conn, [report], history)[0]


def store_statuses(conn: Connection, reports: Sequence[StatusReport],
                   history: int = STATUS_HISTORY) -> list[StatusWrite]:
    """`store_status` of each report, in order, in a few statements for the whole batch
    (`_StatusRows`): the statuses they update read in one, their rows written a few
    hundred to a statement (`wfm.http.statuses` writes the reports that arrive together
    so). A deployment reported twice is written up to there and read again for its later
    reports."""
    stored = _stored_statuses(conn, sorted({(r.deployment_id, r.client_id) for r in reports}))
    rows = _StatusRows(conn, history)
    written: list[StatusWrite] = []
    for report in reports:
        key = (report.deployment_id, report.client_id)
        if report.deployment_id in rows.touched:
            rows.flush()
            existing = _stored_status(conn, *key)
        else:
            existing = stored.get(key)
        written.append(rows.add(report, existing))
    rows.flush()
    return written


def _stored_status(conn: Connection, deployment_id: str, client_id: str) -> Any:
    return conn.execute("SELECT digest, history_count, meaning FROM statuses WHERE "
                        "deployment_id = ? AND client_id = ?",
                        (deployment_id, client_id)).fetchone()


def _stored_statuses(conn: Connection, keys: Sequence[tuple[str, str]]
                     ) -> dict[tuple[str, str], Any]:
    """`_stored_status` of each (deployment, client): the rows of those deployments, read
    through the primary key's first column (a deployment id names one device's deployment,
    so a row or two each), keeping the asked clients' rows."""
    wanted = set(keys)
    deployments = sorted({deployment_id for deployment_id, _ in keys})
    found: dict[tuple[str, str], Any] = {}
    for chunk, marks in id_lists(deployments):
        rows = conn.execute(
            "SELECT deployment_id, client_id, digest, history_count, meaning FROM statuses "
            f"WHERE deployment_id IN ({marks})", tuple(chunk)).fetchall()
        found.update({(row[0], row[1]): tuple(row[2:]) for row in rows
                      if (row[0], row[1]) in wanted})
    return found


#: Rows per statement when a batch's statuses and history rows are written (12 and 7
#: parameters a row: far below either engine's limit).
_ROWS_PER_STATEMENT = 200
_REFRESH_STATUS = ("UPDATE statuses SET document = ?, digest = ?, adopted_manifest_version = ?, "
                   "applied_via = ?, reported_at = ? WHERE deployment_id = ? AND client_id = ?")
_UPSERT_STATUSES = (
    "INSERT INTO statuses (deployment_id, client_id, device_id, state, document, digest, "
    "adopted_manifest_version, applied_digest, applied_via, meaning, reported_at, "
    "history_count) VALUES {rows} "
    "ON CONFLICT (deployment_id) DO UPDATE SET device_id = excluded.device_id, "
    "state = excluded.state, document = excluded.document, digest = excluded.digest, "
    "adopted_manifest_version = excluded.adopted_manifest_version, "
    "applied_digest = excluded.applied_digest, applied_via = excluded.applied_via, "
    "meaning = excluded.meaning, "
    "reported_at = excluded.reported_at, history_count = statuses.history_count + 1")
_INSERT_HISTORY = ("INSERT INTO status_reports (deployment_id, client_id, device_id, state, "
                   "document, reported_at, device_time) VALUES {rows}")


class _StatusRows:
    """What a batch of reports writes, gathered and sent together (`flush`): two statements
    per report were the writer's Python in a push to 10,000 devices, run under the GIL the
    event loop needs (a batch of 300 is 5 statements, not 601). A deployment is pending at
    most once (a second report of it flushes first), so no statement touches a row twice
    (which PostgreSQL refuses in one upsert)."""

    def __init__(self, conn: Connection, history: int) -> None:
        self.conn, self.history = conn, history
        self.touched: set[str] = set()  # deployments written (or pending) in this batch
        self.refreshed: list[tuple[Any, ...]] = []
        self.upserts: list[tuple[Any, ...]] = []
        self.appended: list[tuple[Any, ...]] = []
        self.trims: list[str] = []

    def add(self, report: StatusReport, existing: Any) -> StatusWrite:
        """`report` over `existing` (the stored status's digest, history count and
        meaning; None: none stored for this client)."""
        digest, applied, document = report.digest, report.applied, report.document
        deployment_id, client_id = report.deployment_id, report.client_id
        if existing is not None and existing[0] == digest:
            return StatusWrite(created=False, changed=False)
        self.touched.add(deployment_id)
        now = time.time()
        meaning = report_meaning(document, applied)
        text = report.text if report.text is not None else sorted_json(document)
        if existing is not None and existing[2] == meaning:
            self.refreshed.append((text, digest, report.adopted, applied.via, now,
                                   deployment_id, client_id))
            return StatusWrite(created=False, changed=False)
        self.upserts.append((deployment_id, client_id, report.device_id, report.state, text,
                             digest, report.adopted, applied.digest, applied.via, meaning,
                             now, 1))
        self.appended.append((deployment_id, client_id, report.device_id, report.state,
                              _history_document(document, text, report.state), now,
                              device_time(document)))
        # The count as read, plus this report: no statement of its own (a concurrent
        # writer on another replica may make it one short, which only delays a trim).
        if existing is not None and int(existing[1] or 0) + 1 >= \
                self.history + _STATUS_TRIM_EVERY:
            self.trims.append(deployment_id)
        return StatusWrite(created=existing is None, changed=True)

    def flush(self) -> None:
        """Write what is pending: refreshed statuses, changed ones, their history rows,
        then the trims (which count what was appended)."""
        if self.refreshed:
            self.conn.executemany(_REFRESH_STATUS, self.refreshed)
        for statement, rows in ((_UPSERT_STATUSES, self.upserts),
                                (_INSERT_HISTORY, self.appended)):
            for values, parameters in value_rows(rows, _ROWS_PER_STATEMENT):
                self.conn.execute(statement.format(rows=values), parameters)
        for deployment_id in self.trims:
            trim_status_history(self.conn, deployment_id, self.history)
        self.refreshed, self.upserts, self.appended, self.trims = [], [], [], []


def trim_status_history(conn: Connection, deployment_id: str,
                        keep: int = STATUS_HISTORY) -> int:
    """Delete all but the newest `keep` history rows of a deployment and set its count to
    what is left; the number deleted. Index range scans (`status_reports_by_deployment_id`)
    however long the history had grown (a database from before the retention)."""
    keep = max(keep, 1)
    row = conn.execute("SELECT id FROM status_reports WHERE deployment_id = ? "
                       "ORDER BY id DESC LIMIT 1 OFFSET ?", (deployment_id, keep - 1)).fetchone()
    deleted = 0
    if row is not None:
        deleted = conn.execute("DELETE FROM status_reports WHERE deployment_id = ? AND id < ?",
                               (deployment_id, row[0])).rowcount
    conn.execute("UPDATE statuses SET history_count = (SELECT COUNT(*) FROM status_reports "
                 "WHERE deployment_id = ?) WHERE deployment_id = ?",
                 (deployment_id, deployment_id))
    return max(deleted, 0)


def _history_document(document: dict[str, Any], text: str, state: str) -> str:
    """What a history row keeps of a report: the report itself, or for one over
    `STATUS_HISTORY_BYTES` a summary (deployment, states, component names and states, the
    device's time, and the report's size), so a device that sends large reports cannot
    make the history hundreds of times the size of the fleet's current statuses."""
    if len(text) * 4 <= STATUS_HISTORY_BYTES:  # (UTF-8 takes at most 4 bytes a character)
        return text
    size = len(text.encode("utf-8"))
    if size <= STATUS_HISTORY_BYTES:
        return text
    summary: dict[str, Any] = {
        "deploymentId": _short(document.get("deploymentId")),
        "status": {"state": state},
        "x-margo-gitops-history": {"summarized": True, "bytes": size}}
    if device_time(document) is not None:
        summary[DEVICE_TIME[0]] = {DEVICE_TIME[1]: document[DEVICE_TIME[0]][DEVICE_TIME[1]]}
    components = document.get("components")
    if isinstance(components, list):
        summary["components"] = [{"name": _short(c.get("name")), "state": _short(c.get("state"))}
                                 for c in components if isinstance(c, dict)]
    out = json.dumps(summary, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if len(out.encode("utf-8")) > STATUS_HISTORY_BYTES:  # thousands of components
        summary.pop("components", None)
        out = json.dumps(summary, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return out


def _short(value: Any) -> Any:
    """A value of a summary: a string cut to 256 characters, a scalar as it is, anything
    else left out (None)."""
    if isinstance(value, str):
        return value[:256]
    return value if value is None or isinstance(value, bool | int | float) else None


#: Where a status report carries the device's own time of the state it reports: the spec
#: has no such field and refuses unknown ones, so it travels in our extension object.
DEVICE_TIME = ("x-margo-gitops-extensions", "observedAt")


def device_time(document: dict[str, Any]) -> float | None:
    """The device's time of a status report (`DEVICE_TIME`, RFC 3339 with an offset) in
    seconds since the epoch, or None when it is missing or cannot be read: the device's
    clock is information next to the server's receive time, never a reason to refuse or
    lose a report. A time without an offset is ambiguous, so it is not read either."""
    extension = document.get(DEVICE_TIME[0])
    text = extension.get(DEVICE_TIME[1]) if isinstance(extension, dict) else None
    if not isinstance(text, str) or len(text) > 64:
        return None
    try:
        when = dt.datetime.fromisoformat(text)
        return None if when.tzinfo is None else when.timestamp()
    except (ValueError, OverflowError, OSError):
        return None


def status_history(conn: Connection, deployment_ids: Iterable[str],
                   limit: int = 10) -> dict[str, list[dict[str, Any]]]:
    """The last `limit` status reports of each deployment, newest first: state, when the
    server received it (`reportedAt`) and the device's own time of it (`deviceTime`, None
    when the report carried none). The two differ by the device's clock skew and by how
    long a report waited in its journal (an offline device reports late)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for deployment_id in sorted(set(deployment_ids)):
        rows = conn.execute("SELECT state, reported_at, device_time FROM status_reports "
                            "WHERE deployment_id = ? ORDER BY id DESC LIMIT ?",
                            (deployment_id, limit)).fetchall()
        found[deployment_id] = [{"state": r[0], "reportedAt": r[1], "deviceTime": r[2]}
                                for r in rows]
    return found


def statuses_by_deployment(conn: Connection) -> dict[str, dict[str, Any]]:
    """The last status of every deployment, by deployment id, as the read API shows it."""
    rows = conn.execute("SELECT deployment_id, device_id, state, document, reported_at, "
                        "adopted_manifest_version, client_id, applied_digest, applied_via "
                        "FROM statuses")
    return {r[0]: {"deviceId": r[1], "state": r[2], "document": json.loads(r[3]),
                   "reportedAt": r[4], "adopted": r[5], "clientId": r[6], "applied": r[7],
                   "appliedVia": r[8]} for r in rows}


def rollout_progressing(conn: Connection) -> bool:
    """Whether any staged rollout is progressing (`wfm.fleet.rollouts` stores their state)."""
    return bool(conn.execute("SELECT COUNT(*) FROM rollouts WHERE state LIKE ?",
                             ('%"status": "progressing"%',)).fetchone()[0])


def raise_manifest_generation(conn: Connection, client_id: str, generation: int) -> None:
    """No manifest for the client from a generation older than `generation` (a deletion of
    an id it registers again was published there: `wfm.fleet.coordination`)."""
    conn.execute("UPDATE clients SET manifest_generation = ? WHERE client_id = ? AND "
                 "manifest_generation < ?", (generation, client_id, generation))
