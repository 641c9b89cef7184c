"""Compiles triggered by the server: at start, on capability changes, on source changes.

Triggers are debounced (a burst of capability reports from a rebooting site is one
compile), except those that are one event by nature (a push to the hosted source, a
webhook's fetch, an operator's rollout action: `trigger(settle=False)`), whose compile
starts at once; compiles never overlap: one background thread runs them, with its own Git
store and compiler state, reading the capability snapshot from the database. After each
compile the REST view is told that the branches may have changed.

With replicas (`wfm.fleet.coordination`) a trigger is a request to whichever replica holds the
compile lease; that one compiles into its work repository and publishes the result, which
every replica then serves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from compiler.compilation import CompileReport, compile_fleet
from compiler.gcpause import freeze_survivors, release_frozen
from compiler.gitstore import DeviceStore
from compiler.secrets import FleetKey
from compiler.snapshot import Snapshot
from compiler.source import FleetSource, SourceError, load_source
from compiler.state import CompilerState, is_damage, is_sound, set_aside
from wfm.fleet.sourcecondition import SourceCondition
from wfm.telemetry.metrics import (
    COLLECTION_SECONDS,
    COMPILE_DEVICES,
    COMPILE_SECONDS,
    COMPILES,
    GIT_SECONDS,
    LAST_COLLECTION,
    LAST_COMPILE,
)

if TYPE_CHECKING:
    from wfm.fleet.coordination import Coordinator
    from wfm.fleet.leadtime import CompileOrigin, LeadTimes
    from wfm.fleet.rollouts import RolloutController

__all__ = ["CompileFailure", "CompileService", "SourceConfig"]

log = logging.getLogger("margo.wfm.compiles")
#: Seconds before the first retry of a failed compile; doubled per failure up to the cap.
RETRY_FIRST = 2.0
RETRY_CAP = 120.0
#: Failures in a row after which `/readyz` says the server cannot compile (one failure is
#: retried within seconds and may well be passing).
UNREADY_AFTER = 2


@dataclass(frozen=True, slots=True)
class CompileFailure:
    """Compiles have failed since `since` (wall clock), `attempts` in a row; `error` says
    what the last one raised."""

    since: float
    attempts: int
    error: str
    retry_in: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return (f"compiling has failed {self.attempts} time(s) in a row since {when}: "
                f"{self.error}; the previous desired state stays in force, next attempt in "
                f"{self.retry_in:.0f} s")


@dataclass(frozen=True, slots=True)
class SourceConfig:
    path: Path | None  # None: no fleet source yet, devices get empty desired state
    ref: str | None = None
    #: The fleet key's identity file (docs/secrets.md), read again for every compile so a
    #: rotated key takes effect without a restart; None: intents cannot give secrets.
    fleet_key: Path | None = None


#: Seconds after a compile before the collector walks what it froze (`compiler.gcpause`),
#: in the compile service's thread when no compile runs. Why not at once: a full collection
#: walks the whole heap, holding the interpreter (1.2 s at 100,000 devices, measured by
#: `bench/first_manifest.py`: the first manifest 3.9 s after the branches moved with it,
#: 2.7 s without), and it would stall the devices' first polls of the new state.
COLLECT_AFTER = 10.0
#: ... and while devices still take up its change (`quiet` says no), until this many
#: seconds after it: the collection holds the interpreter for its whole walk (1.3 s of a
#: 20 s push window at 10,000 waiting devices, a py-spy profile of `bench/fleet.py`),
#: and each request in flight waits that long.
COLLECT_LATEST = 120.0
#: How often a collection put off by a busy server asks again.
QUIET_RECHECK = 1.0


class CompileService:
    def __init__(self, repos: Path, source: SourceConfig,
                 fleet: Callable[[Mapping[str, str]], Snapshot],
                 on_compiled: Callable[[CompileReport | None], None], *,
                 debounce: float = 0.3, coordinator: Coordinator | None = None,
                 on_condition: Callable[[SourceCondition], object] = lambda condition: None,
                 rollouts: RolloutController | None = None,
                 lead_times: LeadTimes | None = None,
                 quiet: Callable[[], bool] = lambda: True):
        """`fleet(trusted)`: the snapshot of what the devices reported, a compile's input
        (`wfm.fleet.reported.ReportedFleet.snapshot`; `trusted`: the compiler state's
        digests of documents that validated before). `lead_times`: told what each compile
        answers and changed (`wfm.fleet.leadtime`). `quiet()`: whether devices have stopped
        taking up the last change for now (the collection after a compile waits for it,
        `COLLECT_LATEST`)."""
        self._repos, self._source, self._fleet = repos, source, fleet
        self._coordinator = coordinator
        if coordinator is not None:
            coordinator.on_compile_due = self.compile_soon
        self._on_compiled, self._debounce = on_compiled, debounce
        self._on_condition = on_condition
        self._quiet = quiet
        self._rollouts, self._lead = rollouts, lead_times
        self._wake = threading.Condition()
        self._pending = False
        #: Whether the compile now pending starts without the debounce (`trigger`).
        self._hurry = False
        #: When the compile now pending was first asked for (a lead time's clock, when no
        #: push or webhook started it).
        self._requested: float | None = None
        self._kind = "incremental"
        #: When the objects the last compile froze go back to the collector
        #: (time.monotonic(); None: no collection is due), and when at the latest.
        self._collect_at: float | None = None
        self._collect_by = 0.0
        self._stopping = False
        self._grace_timer: threading.Timer | None = None
        self._retry_timer: threading.Timer | None = None
        self.last_report: CompileReport | None = None
        self.last_error: str | None = None
        #: Set while this server's compiles fail (cleared by the next one that works).
        self.failing: CompileFailure | None = None
        self.compiles = 0
        self._thread = threading.Thread(target=self._loop, name="margo-compiles", daemon=True)
        self._thread.start()

    def trigger(self, *, settle: bool = True) -> None:
        """Something the desired state depends on changed: compile (here, or on the replica
        that holds the compile lease). `settle=False`: the change is one event, not the
        first of a burst (a push, a webhook, an operator's action), so the compile starts
        without waiting for more triggers (with replicas, when the lease holder hears the
        request as news or sees it counted among the urgent ones at its periodic look)."""
        if self._coordinator is not None:
            self._coordinator.request_compile(settle=settle)
            return
        self.compile_soon(settle=settle)

    def compile_soon(self, *, settle: bool = True) -> None:
        with self._wake:
            self._pending = True
            self._hurry = self._hurry or not settle
            if self._requested is None:
                self._requested = time.time()
            self._wake.notify()

    def wait_idle(self, timeout: float = 30) -> bool:
        """Block until no compile is pending or running (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while (self._pending or self._running) and time.monotonic() < deadline:
                self._wake.wait(0.05)
            return not (self._pending or self._running)

    _running = False

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            for timer in (self._grace_timer, self._retry_timer):
                if timer is not None:
                    timer.cancel()
            self._wake.notify()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._stopping and not self._collection_due():
                    self._wake.wait(self._until_collection())
                if self._stopping:
                    return
                collect = not self._pending
                self._running = not collect
                if collect:
                    self._collect_at = None
            if collect:
                self._collect()
                continue
            self._settle()
            with self._wake:
                if self._stopping:
                    self._running = False
                    return
                self._pending = self._hurry = False
                requested, self._requested = self._requested or time.time(), None
            try:
                self._compile(requested)
            except Exception as exc:  # a compile failure must never take the server down
                self._failed(exc)
            else:
                self.failing = None
            finally:
                with self._wake:
                    self._running = False
                    self._wake.notify_all()

    def _settle(self) -> None:
        """Let a burst of triggers settle for the debounce, cut short by one that should
        not wait (`trigger(settle=False)`) or by the server stopping."""
        deadline = time.monotonic() + self._debounce
        with self._wake:
            while not (self._hurry or self._stopping):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._wake.wait(left)

    @property
    def unready(self) -> str | None:
        """Why `/readyz` should say this server cannot compile (None: it can, as far as it
        knows)."""
        failing = self.failing
        if failing is None or failing.attempts < UNREADY_AFTER:
            return None
        return failing.describe()

    def _failed(self, exc: Exception) -> None:
        """A compile raised: say so where people look (the source condition every replica
        shows, `/readyz`), then try again later with a growing delay. A replica gives the
        compile lease up, so that another one compiles meanwhile instead of the whole fleet
        waiting on the broken one."""
        if self._coordinator is not None and self._coordinator.lost_lease(exc):
            log.warning("compile not published: %s", exc)
            return
        COMPILES.labels("failed").inc()
        before = self.failing
        attempts = 1 if before is None else before.attempts + 1
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
        retry_in = min(RETRY_CAP, RETRY_FIRST * 2 ** (attempts - 1))
        failure = CompileFailure(before.since if before else time.time(), attempts, error,
                                 retry_in)
        if before is None or before.error != error:
            log.exception("compile failed (attempt %d); retrying in %.0f s", attempts,
                          retry_in)
        else:
            log.error("compile failed again (attempt %d, same error); retrying in %.0f s",
                      attempts, retry_in)
        self.failing, self.last_error = failure, failure.describe()
        try:
            self._on_condition(SourceCondition.not_compiled("failing", failure.describe()))
        except Exception:
            log.exception("recording the failed compile in the source condition failed")
        if self._coordinator is not None:
            self._coordinator.give_up_lease(cooldown=retry_in)
            self.failing = None  # another replica takes over; this one is not the compiler
        self._schedule_retry(retry_in)

    def _schedule_retry(self, delay: float) -> None:
        with self._wake:
            if self._retry_timer is not None:
                self._retry_timer.cancel()
            if self._stopping:
                return
            self._retry_timer = threading.Timer(delay, self.trigger)
            self._retry_timer.daemon = True
            self._retry_timer.start()

    def _load_source(self) -> FleetSource | None:
        if self._source.path is None:
            return None
        if self._source.ref and not _has_ref(self._source.path, self._source.ref):
            # a hosted or mirrored repository nothing was pushed to yet: normal, not a fault
            waiting = f"nothing pushed or fetched to {self._source.ref} yet"
            log.info("fleet source: %s; waiting for the first push", waiting)
            self._on_condition(SourceCondition.not_compiled("waiting", waiting))
            return None
        try:
            return load_source(self._source.path, ref=self._source.ref)
        except SourceError as exc:
            self.last_error = str(exc)
            log.error("fleet source: %s; keeping the current desired state", exc)
            self._on_condition(SourceCondition.not_compiled(
                "unreadable", f"{exc}; the previous desired state stays in force"))
            return None

    def _collect(self) -> None:
        """The full collection after a compile, timed: it holds the interpreter, so every
        request in flight waits for it (`margo_compile_collection_duration_seconds`)."""
        started = time.monotonic()
        release_frozen()  # what the compile froze, back to the collector (gcpause),
        freeze_survivors()  # then what survives it is out of request-time collections
        seconds = time.monotonic() - started
        COLLECTION_SECONDS.observe(seconds)
        LAST_COLLECTION.set(time.time())
        log.info("collected what the last compile left in %.2f s", seconds)

    def _collection_due(self) -> bool:
        """Whether to collect now: `COLLECT_AFTER` seconds after the last compile, once
        the server is quiet (`quiet`), or `COLLECT_LATEST` seconds after it anyway."""
        if self._collect_at is None:
            return False
        now = time.monotonic()
        return now >= self._collect_at and (now >= self._collect_by or self._quiet())

    def _until_collection(self) -> float | None:
        """Seconds to wait before asking `_collection_due` again (None: no collection is
        due at all)."""
        if self._collect_at is None:
            return None
        now = time.monotonic()
        if now < self._collect_at:
            return self._collect_at - now
        return min(QUIET_RECHECK, max(0.0, self._collect_by - now))

    def _compile(self, requested: float) -> None:
        # With replicas, first bring the compile directory and the fleet source to what the
        # replicas published: a push another replica took must be read here.
        repos = self._repos if self._coordinator is None else self._coordinator.prepare()
        if repos is None:
            return  # another replica holds the compile lease
        if self._source.path is None:
            source = FleetSource(revision="none")  # no source: every device gets a branch
        else:
            loaded = self._load_source()
            if loaded is None:
                # An unreadable source must never look like an empty one: that would remove
                # every deployment. Keep the current state until it can be read (what it
                # waits for is logged where it was found: INFO for the first push, ERROR for
                # a source that cannot be read).
                return
            source = loaded
        log.info("compiling source %s", source.revision)
        tracker = self._lead
        lead = tracker.compile_begins(requested) if tracker is not None else None
        started = time.time()
        served = _Once(lambda report: self._serve(report, lead))
        try:
            report = self._compile_and_publish(source, repos, served)
        except BaseException as exc:
            if tracker is not None and lead is not None:
                tracker.compile_ends(lead, None, error=f"{type(exc).__name__}: {exc}"[:500])
            raise
        served(report)  # (one server: done when the branches moved, unless none moved)
        if tracker is not None and lead is not None:
            tracker.compile_ends(lead, report, kind=self._kind)
        self._count(report, time.time() - started)
        self.last_report, self.compiles = report, self.compiles + 1
        if report.errors:
            self.last_error = "; ".join(p.format() for _, p in report.errors[:5])
        else:
            self.last_error = None
        log.info("compiled: %d devices, %d commits, %d errors", report.devices, report.commits,
                 len(report.errors))
        due = [t for t in (report.next_grace_expiry,
                           self._rollouts.next_due if self._rollouts is not None else None)
               if t is not None]
        self._schedule_grace(min(due) if due else None)

    def _serve(self, report: CompileReport, lead: CompileOrigin | None) -> None:
        """What a compile changed is served: queue the marks of what changed
        (`wfm.fleet.leadtime`; one server: before the state is served, so before any report
        of it; replicas: once published), tell the rollouts what moved, record the source's
        condition, then serve (`on_compiled`)."""
        if lead is not None and self._lead is not None:
            self._lead.compiled(lead, report)
        if self._rollouts is not None:
            self._rollouts.after_compile(report)
        self._on_condition(SourceCondition.of_report(report))
        self._on_compiled(report)

    def _compile_and_publish(self, source: FleetSource, repos: Path,
                             served: Callable[[CompileReport], None]) -> CompileReport:
        """Compile; one server: `served` as soon as the branches move (the compiler's state
        is committed and the compile's objects freed after that: seconds at a million
        devices), replicas: publish from that moment too (`Coordinator.stage`), then, once
        the state is committed, mark it as the published generation's
        (`Coordinator.publish`)."""
        store = DeviceStore(repos)
        on_moved = served if self._coordinator is None else self._coordinator.stage
        try:
            report = self._compile_with_state(source, store, repos / "compiler-state.sqlite",
                                              on_moved)
            restored: int | None = report.restored_branches
        except Exception as exc:
            if not is_damage(exc) or is_sound(repos / "compiler-state.sqlite"):
                raise  # (damage elsewhere, e.g. in the server's own database)
            # Damage the opening check could not see (a page read only now): the state is a
            # cache, so set it aside and compile again in full; nothing moved that the full
            # compile would not move the same way.
            set_aside(repos / "compiler-state.sqlite", exc)
            report = self._compile_with_state(source, store, repos / "compiler-state.sqlite",
                                              on_moved)
            restored = None  # (what the first attempt wrote is published too: look)
        if self._coordinator is not None:
            with GIT_SECONDS.labels("publish").time():
                published = self._coordinator.publish(  # LeaseLost: logged by the loop
                    restored=restored)
            if published is not None:
                log.info("published generation %d (%d refs, %d bytes)", published.generation,
                         published.refs, published.pack_bytes)
        return report

    def _count(self, report: CompileReport, seconds: float) -> None:
        """The compile's figures for `GET /metrics` (`wfm.telemetry.metrics`)."""
        COMPILES.labels("succeeded").inc()
        COMPILE_SECONDS.labels(self._kind).observe(seconds)
        LAST_COMPILE.set(time.time())
        results = [r.status for r in report.results]
        committed, errors = results.count("committed"), results.count("error")
        COMPILE_DEVICES.labels("committed").inc(committed)
        COMPILE_DEVICES.labels("error").inc(errors)
        COMPILE_DEVICES.labels("unchanged").inc(max(0, report.devices - committed - errors))

    def _compile_with_state(self, source: FleetSource, store: DeviceStore, path: Path,
                            on_moved: Callable[[CompileReport], None] | None
                            ) -> CompileReport:
        state = CompilerState(path)  # a damaged file is set aside and rebuilt (CompilerState)
        try:
            state.bind(store.identity)
            # The compiler remembers no intent: every device is evaluated (a full compile).
            self._kind = "incremental" if state.intents() else "full"
            snapshot = self._fleet(state.trusted_digests())
            plans = self._rollouts.plans(source) if self._rollouts is not None else None
            key = FleetKey.load(self._source.fleet_key) if self._source.fleet_key else None
            return compile_fleet(source, snapshot, store, state, rollouts=plans, fleet_key=key,
                                 on_moved=on_moved)
        finally:
            state.close()
            with self._wake:  # the collector walks the whole heap then: `COLLECT_AFTER`
                done = time.monotonic()
                self._collect_at, self._collect_by = done + COLLECT_AFTER, done + COLLECT_LATEST

    def _schedule_grace(self, expiry: float | None) -> None:
        """Compile again when the first grace period runs out: nothing else would remove a
        deployment whose device stays ineligible without reporting anything new."""
        with self._wake:
            if self._grace_timer is not None:
                self._grace_timer.cancel()
                self._grace_timer = None
            if expiry is None or self._stopping:
                return
            delay = max(0.0, expiry - time.time()) + 0.2
            self._grace_timer = threading.Timer(delay, self.trigger)
            self._grace_timer.daemon = True
            self._grace_timer.start()


def _has_ref(repository: Path, ref: str) -> bool:
    import pygit2

    try:
        pygit2.Repository(str(repository)).revparse_single(ref)
    except (pygit2.GitError, KeyError, ValueError):
        return False
    return True


class _Once:
    """A compile's result served once: when its branches move, or (no branch moved, or
    replicas) when it is done; a second call (the compile done after the first) is none."""

    def __init__(self, serve: Callable[[CompileReport], None]) -> None:
        self._serve = serve
        self._done = False

    def __call__(self, report: CompileReport) -> None:
        if not self._done:
            self._done = True
            self._serve(report)
