"""Lead time: from when the server received a change to the report that says a device
installed it (`margo_lead_time_seconds`, and the spans of `wfm.telemetry.tracing`).

The clock starts when the server **received** the change: the push to the hosted source
or the verified webhook (the request's arrival), else when the compile that made the
change was asked for (a capability report, a rollout's timer). Not the commit's own time:
a commit's date is whatever its author's machine said, may be days before the push (a
branch merged later), and a source directory has none; what the fleet manager answers for
starts when it hears of the change. For an intent under a staged rollout, a device moved
in a later wave counts from when the rollout started (its waves and soaks are part of the
lead time, trigger `rollout`).

The clock stops at the status report that says `installed` for the deployment's current
bytes (`wfm.fleet.attribution`: whichever transport, whichever generation of the API), once per
change and deployment.

How it holds on replicas, where the push, the compile and the report may each reach a
different replica: every step is in the shared database.
* A received change is a row of `change_origins` (its time, its trigger, the push span's
  ids); the compiling replica reads them when it compiles and deletes them when done.
* A compile writes one `lead_marks` row per deployment it changed (device, the commit of
  the device's branch that holds the new bytes, when the change was received and
  compiled, the compile span's ids), after its new state is published, by the thread that
  checks reports: a compile that changed 100,000 devices has 543,773 marks to write (about
  4 s on SQLite, 14 s on PostgreSQL beside a replica's publication), which had held back
  every device's new state that long. On one server they are written before the thread
  checks any report that came after the publication. On replicas a report may reach any
  replica before the compiling one has written its mark: a report whose mark is not there
  (or is an older compile's) is looked at again after 1, 2, 4 ... 32 s (`RECHECK_AFTER`),
  at most `RECHECK_LIMIT` at a time; a compiling replica killed before it wrote its marks
  leaves that compile untimed.
* An `installed` report that changed the stored status is queued here (a few
  microseconds on the request path; nothing else is done there); a background thread
  checks the bytes it is about against the mark's commit and deletes the mark. Only the
  replica whose delete removed it observes the lead time, so each is counted once.
Memory is bounded: at most `QUEUE` reports wait and `RECHECK_LIMIT` wait again (beyond:
counted in `margo_lead_time_dropped_total`), marks live in the database (one per deployment
at most), and no span is held open for a device.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from compiler.compilation import CompileReport
from compiler.render import deployment_id
from wfm.fleet.attribution import Claim, claim_of
from wfm.fleet.desired import DesiredState
from wfm.store import lead_rows
from wfm.store.database import Connection, Database
from wfm.store.fleet_rows import load_rollouts
from wfm.store.records import Applied
from wfm.telemetry.metrics import LEAD_TIME, LEAD_TIME_DROPPED
from wfm.telemetry.tracing import OpenSpan, Tracing

__all__ = ["MARKS_PER_WRITE", "QUEUE", "RECHECK_AFTER", "RECHECK_LIMIT", "CompileOrigin",
           "LeadTimes"]

log = logging.getLogger("margo.wfm.leadtime")
#: Installed reports waiting to be checked, at most.
QUEUE = 10_000
#: How long the thread gathers the installed reports that follow the one that woke it,
#: in seconds (the lead time is taken at the report's arrival, so this only delays its
#: observation).
GATHER = 0.2
#: Marks written per transaction (after publication).
MARKS_PER_WRITE = 2_000
#: Replicas: when a report that found no mark of its bytes is looked at again, in seconds
#: after it was first checked (the compiling replica writes a compile's marks after
#: publishing it: 14 s for 100,000 devices on a busy machine).
RECHECK_AFTER = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
#: Replicas: reports waiting to be looked at again, at most (about 200 bytes each).
RECHECK_LIMIT = 100_000
_CHANGED = ("add", "update", "reconfigure")


@dataclass(frozen=True, slots=True)
class _Origin:
    trigger: str
    received_at: float
    trace: str | None


@dataclass(slots=True)
class CompileOrigin:
    """What a compile answers: the changes received since the last one (or its trigger
    time), and its span while it runs."""

    started: float
    origins: list[_Origin]
    last_id: int
    requested: float
    span: OpenSpan = field(default_factory=lambda: OpenSpan(None, 0.0))

    @property
    def received(self) -> tuple[float, str]:
        """When the first change it answers was received, and how."""
        if not self.origins:
            return min(self.requested, self.started), "other"
        first = min(self.origins, key=lambda o: o.received_at)
        return first.received_at, first.trigger


@dataclass(frozen=True, slots=True, eq=False)
class _Report:
    queued: float  # monotonic: when it is looked at again counts from here
    reported_at: float
    client_id: str
    device_id: str
    deployment_id: str
    digest: str
    claim: Claim


def _origins(conn: Connection) -> tuple[list[_Origin], int]:
    rows = lead_rows.pending_origins(conn)
    return [_Origin(r[1], r[2], r[3]) for r in rows], max((r[0] for r in rows), default=0)


class LeadTimes:
    """`handout(device_id)`: the commit the device was last handed over Git and when (see
    `wfm.fleet.attribution.Handouts.when`), for the adoption span; `catch_up()`: bring the served
    repository to the newest generation (replicas), for a mark of a commit not synced yet."""

    def __init__(self, db: Database, desired: DesiredState, tracing: Tracing, *,
                 handout: Callable[[str], tuple[str, float] | None] = lambda device: None,
                 catch_up: Callable[[], object] | None = None, queue: int = QUEUE,
                 recheck: bool = False) -> None:
        """`recheck`: this is one of several replicas, so a report may come before the
        mark it looks for (see the module's docstring)."""
        self._db, self._desired, self._tracing = db, desired, tracing
        self._handout, self._catch_up, self._limit = handout, catch_up, queue
        self._recheck = recheck
        #: Compiles published since the thread last wrote their marks, with when each was.
        self._pending_marks: collections.deque[
            tuple[CompileOrigin, CompileReport, float]] = collections.deque()
        self._queue: collections.deque[_Report] = collections.deque()
        #: Replicas: (when, order, report, checks so far) of reports to look at again.
        self._again: list[tuple[float, int, _Report, int]] = []
        self._order = itertools.count()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="margo-lead-times",
                                        daemon=True)
        self._thread.start()

    # --- changes received -------------------------------------------------------------

    def received(self, trigger: str, started: float | None = None) -> None:
        """A change arrived (`push`, `webhook`) at `started` (the request's arrival):
        remember it for the compile it asks for, on whichever replica compiles. Does not
        wait for the write (the compile it triggers is queued behind it)."""
        now = time.time()
        start = now if started is None else started
        trace = self._tracing.record(f"margo.source.{trigger}", start=start, end=now,
                                     attributes={"margo.trigger": trigger})
        self._db.submit(lambda conn: lead_rows.record_origin(conn, trigger, start, trace))

    # --- compiles (the compiling replica) ---------------------------------------------

    def compile_begins(self, requested: float) -> CompileOrigin:
        """A compile starts: the changes it answers, its span begun under the first."""
        try:
            origins, last_id = self._db.read(_origins)
        except Exception as exc:  # the compile itself decides whether the database is there
            log.warning("changes received not read for lead times: %s", exc)
            origins, last_id = [], 0
        compile = CompileOrigin(time.time(), origins, last_id, requested)
        first = min(origins, key=lambda o: o.received_at) if origins else None
        compile.span = self._tracing.begin(
            "margo.compile", start=compile.started, parent=first.trace if first else None,
            links=[o.trace for o in origins if o is not first and o.trace])
        return compile

    def compiled(self, compile: CompileOrigin, report: CompileReport) -> None:
        """The compile committed (one server: before its state is published, so before any
        report of it; replicas: once published): queue its marks. The thread that checks
        reports works them out (a compile that changed 100,000 devices has 543,773 of
        them: 1.4 s of Python) and writes them, and forgets the changes it answered."""
        self._pending_marks.append((compile, report, time.time()))
        self._wake.set()

    def _marks(self, compile: CompileOrigin, report: CompileReport,
               compiled_at: float) -> list[tuple[Any, ...]]:
        """One mark per deployment the compile changed (a file may be listed twice)."""
        received, trigger = compile.received
        try:
            rollouts_started = _started(self._db.read(load_rollouts).items()) \
                if report.rollout_moves else {}
        except Exception as exc:
            log.warning("rollouts not read for lead times: %s", exc)
            rollouts_started = {}
        marked: dict[str, tuple[Any, ...]] = {}
        for result in report.results:
            if result.status != "committed" or not result.commit:
                continue
            for change in result.changes:
                if change.action not in _CHANGED or not change.intent:
                    continue
                at, how = received, trigger
                started = rollouts_started.get(change.intent)
                if started is not None and started < at and \
                        result.device_id in report.rollout_moves.get(change.intent, {}):
                    at, how = started, "rollout"
                deployment = deployment_id(change.intent, result.device_id)
                marked[deployment] = (deployment, result.device_id, result.commit, at,
                                      compiled_at, how, compile.span.context)
        return list(marked.values())

    def _store_marks(self, rows: list[tuple[Any, ...]], last_id: int) -> bool:
        """Write a compile's marks; False (logged) when they could not be."""
        try:
            self._db.write_sync(lambda conn: lead_rows.store_marks(conn, rows, last_id))
        except Exception as exc:  # a lead time is never worth a compile
            log.warning("lead-time marks of %d deployment(s) not stored: %s", len(rows), exc)
            return False
        return True

    def _store_pending_marks(self) -> None:
        """The marks of every compile published so far, a transaction per
        `MARKS_PER_WRITE`: the store has one writer, and the devices' manifest versions and
        status reports of the new state queue behind these writes (543,773 marks in one
        transaction had held them for 4 s)."""
        while self._pending_marks:
            compile, report, compiled_at = self._pending_marks.popleft()
            rows, last_id = self._marks(compile, report, compiled_at), compile.last_id
            for start in range(0, len(rows), MARKS_PER_WRITE):
                self._store_marks(rows[start:start + MARKS_PER_WRITE], 0)
            if last_id:
                self._store_marks([], last_id)

    @staticmethod
    def compile_ends(compile: CompileOrigin, report: CompileReport | None, *,
                     kind: str | None = None, error: str | None = None) -> None:
        compile.span.end(time.time(), None if report is None else {
            "margo.source.revision": report.revision, "margo.compile.kind": kind,
            "margo.compile.devices": report.devices, "margo.compile.commits": report.commits,
            "margo.compile.errors": len(report.errors)}, error=error)

    # --- reports (any replica) --------------------------------------------------------

    def reported(self, client_id: str, device_id: str, deployment_id: str, state: str,
                 document: dict[str, Any], applied: Applied, changed: bool) -> None:
        """A status report was stored (`changed`: it said something new). On the request
        path: only an `installed` about known bytes is queued; nothing waits."""
        if state != "installed" or not changed or applied.digest is None:
            return
        if len(self._queue) >= self._limit:
            LEAD_TIME_DROPPED.inc()
            return
        self._queue.append(_Report(time.monotonic(), time.time(), client_id, device_id,
                                   deployment_id, applied.digest, claim_of(document)))
        if len(self._queue) == 1:  # the first since the thread took the queue wakes it
            self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(min(1.0, max(0.05, self._again[0][0] - time.monotonic()))
                            if self._again else 1.0)
            self._wake.clear()
            self._store_pending_marks()
            if self._queue:
                # Reports come in bursts (a change reaching the fleet): the ones that come
                # within `GATHER` are checked together, a read and a write for hundreds,
                # where a wake per report cost the request path a thread switch each.
                # (Cleared first: the report that woke us may have set it again; a
                # compile's marks are written before the batch is checked anyway.)
                self._wake.clear()
                if not self._stopping:
                    self._wake.wait(GATHER)
            while self._queue and not self._stopping:
                batch = [self._queue.popleft() for _ in range(min(500, len(self._queue)))]
                # After taking the batch: a report in it came after any compile whose marks
                # were queued before it, and those marks are written before it is checked.
                self._store_pending_marks()
                self._check([(report, 0) for report in batch])
            self._check_again()
        self._store_pending_marks()  # stopping: what a restart's reports will look for

    def _check(self, batch: list[tuple[_Report, int]]) -> None:
        """Settle the reports (each with how often it was checked before); on replicas,
        look at those without their mark again later."""
        try:
            unmatched = self._settle([report for report, _ in batch])
        except Exception as exc:  # a report's lead time is not worth a thread
            log.warning("lead times of %d report(s) not observed: %s", len(batch), exc)
            return
        if not self._recheck:
            return
        checks = {id(report): count for report, count in batch}
        for report in unmatched:
            count = checks[id(report)]
            if count >= len(RECHECK_AFTER):
                continue  # no mark came: nothing this fleet manager changed
            if len(self._again) >= RECHECK_LIMIT:
                LEAD_TIME_DROPPED.inc()
                continue
            due = report.queued + RECHECK_AFTER[count]
            heapq.heappush(self._again, (due, next(self._order), report, count + 1))

    def _check_again(self) -> None:
        """The reports due to be looked at again, 500 at a time."""
        now = time.monotonic()
        while self._again and self._again[0][0] <= now and not self._stopping:
            due: list[tuple[_Report, int]] = []
            while self._again and self._again[0][0] <= now and len(due) < 500:
                _, _, report, count = heapq.heappop(self._again)
                due.append((report, count))
            self._check(due)

    def _settle(self, batch: list[_Report]) -> list[_Report]:
        """Observe the lead time of every report that installed its mark's bytes; the
        reports whose mark is not there, or names other bytes."""
        wanted = sorted({r.deployment_id for r in batch})
        marks = self._db.read(lambda conn: lead_rows.marks_of(conn, wanted))
        matched: list[tuple[_Report, tuple[Any, ...]]] = []
        unmatched: list[_Report] = []
        caught_up = False
        for report in batch:
            mark = marks.get(report.deployment_id)
            if mark is None or mark[0] != report.device_id:
                unmatched.append(report)
                continue
            held = self._desired.deployments_at(report.device_id, mark[1])
            if held is None and self._catch_up is not None and not caught_up:
                self._catch_up()  # a compile another replica published: sync, then look
                caught_up = True
                held = self._desired.deployments_at(report.device_id, mark[1])
            if held is not None and held.get(report.deployment_id) == report.digest:
                matched.append((report, mark))
            else:
                unmatched.append(report)
        if not matched:
            return unmatched

        taken = [(report.deployment_id, mark[1]) for report, mark in matched]
        consumed = self._db.write_sync(lambda conn: lead_rows.consume_marks(conn, taken))
        for (report, mark), mine in zip(matched, consumed, strict=True):
            if mine:  # another replica may have taken the same mark: counted once
                LEAD_TIME.labels(mark[4]).observe(max(0.0, report.reported_at - mark[2]))
                if self._tracing.enabled:
                    self._device_spans(report, mark)
        return unmatched

    def _device_spans(self, report: _Report, mark: tuple[Any, ...]) -> None:
        """adopt (compiled -> handed out), then install (handed out -> reported), under
        the compile's span."""
        compiled_at, trace = float(mark[3]), mark[5]
        attributes = {"margo.device.id": report.device_id,
                      "margo.deployment.id": report.deployment_id,
                      "margo.client.id": report.client_id, "margo.commit": mark[1]}
        handout = self._adoption(report)
        start, parent = compiled_at, trace
        if handout is not None and compiled_at <= handout[1] <= report.reported_at:
            parent = self._tracing.record(
                "margo.device.adopt", start=compiled_at, end=handout[1], parent=trace,
                attributes={**attributes, "margo.handout": handout[0]})
            start = handout[1]
        self._tracing.record(
            "margo.device.install", start=start, end=report.reported_at, parent=parent,
            attributes={**attributes, "margo.lead_time_seconds":
                        report.reported_at - float(mark[2]), "margo.trigger": mark[4]})

    def _adoption(self, report: _Report) -> tuple[str, float] | None:
        """How and when the device was handed the state it reported on: the manifest
        version it names (when that version was first served), or its Git fetch."""
        claim = report.claim
        if claim.manifest_version is not None:
            version = claim.manifest_version
            served = self._db.read(lambda conn: lead_rows.manifest_served_at(
                conn, report.client_id, version))
            return None if served is None else ("manifest", served)
        handed = self._handout(report.device_id)
        if handed is None or (claim.commit is not None and handed[0] != claim.commit):
            return None
        return "git", handed[1]


def _started(states: Iterable[tuple[str, dict[str, Any]]]) -> dict[str, float]:
    """When each moving rollout started (`wfm.fleet.rollouts` state), by intent."""
    return {name: float(state["startedAt"]) for name, state in states
            if state.get("status") != "complete" and state.get("startedAt") is not None}
