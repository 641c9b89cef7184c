"""One reconcile cycle, and the loop that repeats it on the configured schedule.

A cycle: report capabilities if they changed, deliver queued status reports, fetch desired
state, adopt it durably once verified, plan against what the engine says is installed,
apply step by step (recording every transition in the durable journal before and after
each step, and reporting a step done only once its result, read back from the engine,
shows what was applied: `Driver.confirm`), then deliver the journal again.

With waiting polls (`reconciler.sources.waiting`), the fetch may be held by the server for
the rest of the interval, until the desired state changes: the loop then starts the next
cycle at once, so a change is applied within a second of its publication while the cycles
keep the interval's pace.

Why adopt before applying: the adopted documents are the device's durable copy of the
desired state. A crash (even SIGKILL) between adopting and applying loses nothing: the next
run plans the same documents against the engine's own records, which say what was really
installed, and continues. A crash in the middle of a step leaves a release the engine marks
failed or pending, which the planner re-applies. Statuses already journaled are delivered;
a transition not yet journaled is journaled again from the recomputed state, so the server
ends with the true state and never sees a duplicate entry for one transition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from margo.digests import digest_of
from margo.errors import DocumentError
from margo.models import DeploymentState as State
from reconciler.desired import DesiredDeployment, DesiredState, parse_deployment
from reconciler.drivers.base import Driver
from reconciler.errors import ApplyError, ErrorCode
from reconciler.planner import Action, DeploymentPlan, Step, plan
from reconciler.schedule import Schedule, now_utc
from reconciler.sources import IntegrityError, Source, SourceError
from reconciler.sources.waiting import WaitingPolls
from reconciler.state import ComponentRecord, DamagedDocumentsError, DeviceState
from reconciler.statuses import observed_now, status_body, status_path
from reconciler.telemetry import Injection, with_injection

__all__ = ["CycleObserver", "CycleResult", "Reconciler", "StatusTarget"]

log = logging.getLogger("margo.device")

# How long a component that failed with a retryable error waits before the next attempt
# (doubling from the first, capped): a registry outage must not turn into a report storm.
RETRY_FIRST_SECONDS = 10.0
RETRY_CAP_SECONDS = 600.0
#: The device state's key for when every deployment's state was last re-asserted.
_REASSERTED = "reports.reasserted-at"


def _about(deployment_id: str) -> dict[str, str]:
    """A log record's `extra` naming the deployment it is about (an attribute of the record
    the device's telemetry exports: `reconciler.telemetry.export`)."""
    return {"margo.deployment.id": deployment_id}


class CycleObserver(Protocol):
    """What watches finished cycles (the device's own telemetry)."""

    def observe(self, result: CycleResult, seconds: float, state: DeviceState) -> None: ...


@dataclass(frozen=True)
class StatusTarget:
    """Where and how status reports go (the API generation the server speaks)."""

    generation: str
    device_id: str
    client_id: str


@dataclass
class CycleResult:
    """What one cycle did; `converged` is True when every desired component is installed
    and nothing undesired remains."""

    contacted: bool = True
    fetched: str = "unchanged"  # "unchanged" | "adopted" | "error" | "rejected" | "skipped"
    version: str | None = None
    # (action, deployment id, component, outcome) of every step attempted
    steps: list[tuple[str, str, str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    converged: bool = False
    delivered: int = 0
    pending_reports: int = 0


@dataclass
class _Retry:
    key: str  # what was being applied (spec + values fingerprints): a change resets the wait
    attempts: int
    not_before: float
    retryable: bool


class Reconciler:
    """Owns a device's state store, source, driver and reporters for its lifetime."""

    def __init__(self, *, state: DeviceState, source: Source, driver: Driver,
                 target: StatusTarget, deliver: Callable[[], tuple[int, int]],
                 report_capabilities: Callable[[], str | None] | None = None,
                 schedule: Schedule | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 server_answered: Callable[[], None] | None = None,
                 injection: Injection | None = None,
                 observer: CycleObserver | None = None,
                 waiting: WaitingPolls | None = None) -> None:
        """`waiting`: the source's waiting polls, which the loop (`run`) turns on and paces
        (module docstring). `injection`: the telemetry variables the drivers put into every
        container; the planner sees them in each component's values digest
        (`telemetry.with_injection`), so a change of them reconfigures what runs.
        `observer` hears of every finished cycle and how long it took.

        `server_answered` is called whenever the source got an answer from the server
        that status reports go to (a poll, unchanged or not): queued reports waiting out a
        backoff from an outage are then due at once (`Reporter.resume`), so they arrive in
        this cycle instead of after a backoff that grew while the server was away."""
        self.state = state
        self.source = source
        self.driver = driver
        self.target = target
        self._deliver = deliver
        self._report_capabilities = report_capabilities
        self._server_answered = server_answered
        self.schedule = schedule or Schedule()
        self.injection = injection
        self._observer = observer
        self._clock = clock
        self._parsed: dict[str, DesiredDeployment] = {}
        #: Deployment id -> the digest of its adopted document, this cycle: what each
        #: status report is about (`DeviceState.record(about=)`).
        self._digests: dict[str, str] = {}
        self._retries: dict[tuple[str, str], _Retry] = {}
        self.stopping = threading.Event()
        self._waiting = waiting
        if waiting is not None:
            waiting.stopping = self.stopping

    # --- desired state ------------------------------------------------------------------

    def _desired(self) -> list[DesiredDeployment]:
        """The adopted documents, parsed once per digest (an unchanged cycle re-parses
        nothing). Raises `DamagedDocumentsError` when a stored copy no longer matches its
        digest (the state store checks every read)."""
        deployments: list[DesiredDeployment] = []
        fresh: dict[str, DesiredDeployment] = {}
        for data in self.state.desired_documents():
            digest = digest_of(data)
            parsed = self._parsed.get(digest) or parse_deployment(data, file=f"adopted:{digest}")
            fresh[digest] = parsed
            deployments.append(parsed)
        self._parsed = fresh
        return with_injection(deployments, self.injection)

    def _fetch(self, result: CycleResult, now: datetime) -> None:
        adopted = self.state.adopted()
        if adopted.damaged:
            log.warning("the stored copies of deployments %s no longer match their digests; "
                        "not applying them, fetching them again", ", ".join(adopted.damaged))
        try:
            fetched: DesiredState | None = self.source.fetch(adopted)
        except IntegrityError as exc:
            self._answered()  # refused, but the server did answer
            result.fetched = "rejected"
            result.failures.append(f"desired state rejected: {exc.message}")
            log.warning("SECURITY: desired state rejected, previous state kept: %s", exc)
            return
        except SourceError as exc:
            result.fetched = "error"
            if self.schedule.in_downtime(now):
                return  # communication errors are ignored during downtime
            result.failures.append(f"fetching desired state failed: {exc.message}")
            log.warning("fetching desired state failed (%s); keeping the previous state", exc)
            return
        self._answered()
        if fetched is None:
            return
        self.state.adopt(fetched)
        result.fetched = "adopted"
        result.version = fetched.version
        if fetched.history_rewrite_accepted is not None:
            log.warning("SECURITY: adopted %s although it does not descend from the previously "
                        "adopted commit %s, because source.acceptHistoryRewrite allows it; the "
                        "override is now spent: remove it from the configuration",
                        fetched.version, adopted.version)
        if adopted.damaged and fetched.version == adopted.version:
            log.warning("fetched desired state %s again: its damaged local copies are replaced",
                        fetched.version)
        log.info("adopted desired state %s (%d deployments)", fetched.version,
                 len(fetched.deployments))

    def _answered(self) -> None:
        if self._server_answered is not None:
            self._server_answered()

    # --- status ---------------------------------------------------------------------------

    def _report(self, deployment_id: str, name: str,
                changes: Mapping[str, tuple[str, dict[str, str] | None]], *,
                force: bool = False, extensions: Mapping[str, Any] | None = None) -> None:
        """Record component transitions and journal the deployment's full status, naming
        what the device had adopted (manifestVersion, or the commit of its Git branch) and
        about which bytes of the deployment it is (`DeviceState.record(about=)`)."""
        source, version, manifest_version = self.state.adopted_marker()
        commit = version if source == "git" else None
        target = self.target

        def body(components: list[tuple[str, str, dict[str, str] | None]]
                 ) -> tuple[str, dict[str, Any]]:
            return (status_path(target.generation, deployment_id=deployment_id,
                                device_id=target.device_id, client_id=target.client_id),
                    status_body(target.generation, deployment_id=deployment_id,
                                device_id=target.device_id, adopted_version=manifest_version,
                                adopted_commit=commit, components=components,
                                deployment_name=name, observed_at=observed_now(),
                                extensions=extensions))

        self.state.record(deployment_id, changes, body, about=self._digests.get(deployment_id),
                          force=force)

    def _settle(self, dplan: DeploymentPlan) -> None:
        """After a desired deployment's steps: if its adopted bytes are not the ones its last
        report was about (new bytes that needed no step: a changed capacity requirement, a
        rollout moving it back to bytes it runs), report its state for them."""
        deployment = dplan.deployment
        if deployment is not None and self.state.component_states(dplan.deployment_id):
            self._report(dplan.deployment_id, deployment.name, {})

    def _reassert(self, desired: list[DesiredDeployment]) -> None:
        """Every `schedule.resync` seconds, and only with an empty journal (queued reports
        say it already), journal the true state of every desired deployment again: the
        server keeps no history for a report that says nothing new, but a report that was
        lost, or a state somebody forged, does not stand past the next re-assertion."""
        every = self.schedule.resync
        if every <= 0 or self.state.journal_size():
            return
        now = time.time()
        last = self.state.get(_REASSERTED)
        if last is None or not 0 <= now - float(last) < every:
            if last is not None:
                for deployment in desired:
                    self._report(deployment.deployment_id, deployment.name, {}, force=True)
            self.state.set(_REASSERTED, repr(now))

    # --- apply ----------------------------------------------------------------------------

    def _retry_key(self, step: Step) -> str:
        """What a failure is remembered against: a change resets the back-off, and lets a
        step that is not retryable be tried again. The sealed values' exact text counts
        too: one this device could not open is tried again once the server seals it anew."""
        desired = step.desired
        return f"{step.action}:{desired.spec_digest}:{desired.values_digest}:" \
            f"{desired.sealed_digest}" if desired else f"{step.action}"

    def _may_try(self, step: Step) -> bool:
        retry = self._retries.get((step.deployment_id, step.component))
        if retry is None or retry.key != self._retry_key(step):
            return True
        return retry.retryable and self._clock() >= retry.not_before

    def _failed(self, step: Step, error: ApplyError) -> None:
        key = (step.deployment_id, step.component)
        previous = self._retries.get(key)
        attempts = previous.attempts + 1 if previous and previous.key == self._retry_key(step) \
            else 1
        wait = min(RETRY_CAP_SECONDS, RETRY_FIRST_SECONDS * 2 ** (attempts - 1))
        self._retries[key] = _Retry(self._retry_key(step), attempts, self._clock() + wait,
                                    error.retryable)

    def _apply_deployment(self, dplan: DeploymentPlan, result: CycleResult) -> None:
        """Run one deployment's steps in the planner's order: announce the deployment, then
        each step; a failed step stops a desired deployment (later components wait for it,
        in listed order), and a deployment removed whole is forgotten once all went well."""
        deployment = dplan.deployment
        name = deployment.name if deployment else dplan.deployment_id
        recorded = self.state.component_states(dplan.deployment_id) if dplan.deployment_id \
            else {}
        if deployment is not None and not self._announce(dplan, deployment, recorded, result):
            return
        for step in dplan.steps:
            if step.action is Action.UNCHANGED:
                self._confirm_unchanged(step, name, recorded.get(step.component), result)
            elif not self._may_try(step):
                result.failures.append(f"{step.deployment_id}/{step.component}: waiting to "
                                       "retry after a failure")
                if deployment is not None:
                    return
            elif step.action is Action.SKIP:  # the name is taken by what is not ours
                self._step_failed(step, name, ApplyError(
                    ErrorCode.INSTALL_FAILED, step.reason, retryable=False), result)
                return
            elif not self._change(step, deployment, name, result) and deployment is not None:
                return
        if deployment is None and dplan.deployment_id:
            self.state.forget(dplan.deployment_id)

    def _announce(self, dplan: DeploymentPlan, deployment: DesiredDeployment,
                  recorded: Mapping[str, ComponentRecord], result: CycleResult) -> bool:
        """Before a desired deployment's steps: refuse a profile type this driver does not
        run (every component `failed`, nothing applied: False), else keep its component
        order for a later removal and report its new components `pending`."""
        if deployment.profile_type not in self.driver.profile_types:
            error = {"code": ErrorCode.UNSUPPORTED_TYPE, "message": f"this device's driver "
                     f"({self.driver.name}) does not run {deployment.profile_type} "
                     "deployments"}
            self._report(dplan.deployment_id, deployment.name,
                         {c.name: (State.FAILED, error) for c in deployment.components})
            result.failures.append(f"{dplan.deployment_id}: {error['message']}")
            return False
        self.state.set_component_order(dplan.deployment_id,
                                       [c.name for c in deployment.components])
        fresh = {c.name: (State.PENDING, None) for c in deployment.components
                 if c.name not in recorded}
        if fresh:
            self._report(dplan.deployment_id, deployment.name, fresh)
        return True

    def _confirm_unchanged(self, step: Step, name: str, current: ComponentRecord | None,
                           result: CycleResult) -> None:
        """A component the planner leaves alone: `installed`, unless the driver saw drift it
        is not to repair (policy `warn`): the workload is not what was deployed, so it is
        reported `failed` with code `DRIFTED` (once per distinct drift) instead."""
        drift = step.installed.drift if step.installed is not None else ""
        if not drift:
            if current is None or current.state != State.INSTALLED:
                self._report(step.deployment_id, name, {step.component: (State.INSTALLED, None)})
            return
        error = {"code": ErrorCode.DRIFTED, "message": drift}
        if current is None or current.state != State.FAILED or current.error != error:
            log.warning("%s/%s drifted, not repaired (driftDetection: warn): %s",
                        step.deployment_id, step.component, drift,
                        extra=_about(step.deployment_id))
            self._report(step.deployment_id, name, {step.component: (State.FAILED, error)})
        result.failures.append(f"{step.deployment_id}/{step.component}: DRIFTED: {drift}")

    def _change(self, step: Step, deployment: DesiredDeployment | None, name: str,
                result: CycleResult) -> bool:
        """Carry out one changing step: journal `installing` (or `removing`), apply it,
        read its result back from the engine (`Driver.confirm`), then report the outcome:
        `installed` only for what the engine was read to hold. False when it failed."""
        removing = step.action is Action.REMOVE
        drift = step.installed.drift if step.action is Action.REPAIR and step.installed \
            else ""
        if drift:
            log.warning("%s/%s drifted, repairing: %s", step.deployment_id, step.component,
                        drift, extra=_about(step.deployment_id))
        self._report(step.deployment_id, name,
                     {step.component: (State.REMOVING if removing else State.INSTALLING, None)})
        try:
            self.driver.apply(step, deployment)
            self.driver.confirm(step, deployment)
        except ApplyError as exc:
            log.warning("%s of %s/%s failed: %s: %s", step.action, step.deployment_id,
                        step.component, exc.code, exc.message, extra=_about(step.deployment_id))
            self._step_failed(step, name, exc, result)
            return False
        self._step_done(step, deployment, name, drift, result)
        return True

    def _step_failed(self, step: Step, name: str, error: ApplyError,
                     result: CycleResult) -> None:
        """A step that failed (or was refused): counted for the retry back-off, reported
        `failed` with the error's code and message, and listed in the cycle's result."""
        self._failed(step, error)
        self._report(step.deployment_id, name, {step.component: (
            State.FAILED, {"code": error.code, "message": error.message})})
        result.steps.append((str(step.action), step.deployment_id, step.component,
                             f"failed: {error.code}"))
        result.failures.append(f"{step.deployment_id}/{step.component}: {error.code}: "
                               f"{error.message}")

    def _step_done(self, step: Step, deployment: DesiredDeployment | None, name: str,
                   drift: str, result: CycleResult) -> None:
        """A step that succeeded: its back-off forgotten and the component reported
        `installed` (or `removed`; `installing` when it was removed only to be installed
        again, a Helm namespace move), with what was repaired when it was a repair."""
        self._retries.pop((step.deployment_id, step.component), None)
        removing = step.action is Action.REMOVE
        done = State.REMOVED if removing else State.INSTALLED
        if removing and deployment is not None and step.component in {
                c.name for c in deployment.components}:
            done = State.INSTALLING
        repaired = {"repaired": {step.component: drift}} if drift else None
        self._report(step.deployment_id, name, {step.component: (done, None)},
                     extensions=repaired)
        if drift:
            log.warning("%s/%s repaired: %s", step.deployment_id, step.component, drift,
                        extra=_about(step.deployment_id))
        log.info("%s of %s/%s: ok", step.action, step.deployment_id, step.component,
                 extra=_about(step.deployment_id))
        result.steps.append((str(step.action), step.deployment_id, step.component, "ok"))

    def _finish_vanished(self, desired_ids: set[str], installed_ids: set[str]) -> None:
        """Deployments the device reported on but that are neither desired nor installed
        (e.g. removed before their install ever succeeded): report them removed, forget."""
        for deployment_id in self.state.known_deployments():
            if deployment_id in desired_ids or deployment_id in installed_ids:
                continue
            states = self.state.component_states(deployment_id)
            pending = {name: (State.REMOVED, None) for name, record in states.items()
                       if record.state != State.REMOVED}
            if pending:
                self._report(deployment_id, deployment_id, pending)
            self.state.forget(deployment_id)

    # --- the cycle ------------------------------------------------------------------------

    def cycle(self, now: datetime | None = None) -> CycleResult:
        started = time.monotonic()
        result = self._cycle(now)
        if self._observer is not None:
            self._observer.observe(result, time.monotonic() - started, self.state)
        return result

    def _cycle(self, now: datetime | None) -> CycleResult:
        now = now or now_utc()
        result = CycleResult()
        if not self.schedule.may_contact(now):
            result.contacted, result.fetched = False, "skipped"
            return result
        if self._report_capabilities is not None:
            problem = self._report_capabilities()
            if problem and not self.schedule.in_downtime(now):
                result.failures.append(f"reporting capabilities failed: {problem}")
        self._deliver()
        self._allow_wait(now)
        self._fetch(result, now)
        try:
            desired = self._desired()
        except DamagedDocumentsError as exc:  # and fetching them again failed: apply nothing
            result.failures.append(f"adopted desired state damaged: {exc}")
            self._finish_delivery(result)
            return result
        except (DocumentError, ValueError) as exc:  # only if the store itself was tampered with
            result.failures.append(f"adopted desired state unreadable: {exc}")
            self._finish_delivery(result)
            return result
        try:
            installed = self.driver.installed()
        except ApplyError as exc:
            result.failures.append(f"{exc.code}: {exc.message}")
            self._finish_delivery(result)
            return result
        the_plan = plan(desired, installed, component_order=self.state.component_orders())
        self._digests = {d.deployment_id: d.digest for d in desired}
        remaining = list(the_plan.deployments)
        while remaining and not self.stopping.is_set():
            dplan = remaining.pop(0)
            self._apply_deployment(dplan, result)
            self._settle(dplan)
        self._finish_vanished({d.deployment_id for d in desired},
                              {r.deployment_id for r in installed})
        # A stop (SIGTERM) lets the current step finish: the cycle converged unless it left
        # changes undone, however late in it the signal came.
        result.converged = not result.failures and not any(d.changes for d in remaining)
        if not self.stopping.is_set():
            self._reassert(desired)
        self._finish_delivery(result)
        return result

    def _allow_wait(self, started: datetime) -> None:
        """How long this cycle's poll may be held: until the next cycle is due, and while
        contact is allowed (a held poll must not run into downtime)."""
        if self._waiting is None:
            return
        current = now_utc()
        left = (self.schedule.next_check(started) - current).total_seconds()
        self._waiting.allow(self.schedule.open_for(current, max(0.0, left)))

    def _finish_delivery(self, result: CycleResult) -> None:
        delivered, pending = self._deliver()
        result.delivered, result.pending_reports = delivered, pending

    def run(self, on_cycle: Callable[[CycleResult], None] | None = None) -> None:
        """Cycle on the schedule until `stopping` is set (SIGTERM/SIGINT set it; the current
        step finishes first; a held poll is abandoned)."""
        if self._waiting is not None:
            self._waiting.active = True
        try:
            while not self.stopping.is_set():
                started = now_utc()
                result = self.cycle(started)
                if on_cycle is not None:
                    on_cycle(result)
                self.stopping.wait(self._pause(started, result))
        finally:
            if self._waiting is not None:
                self._waiting.active = False

    def _pause(self, started: datetime, result: CycleResult) -> float:
        """Seconds until the next cycle: the schedule's, or the waiting polls' say."""
        ended = now_utc()
        wait = max(0.0, (self.schedule.next_check(started) - ended).total_seconds())
        if self._waiting is None:
            return wait
        return self._waiting.next_delay(wait, self.schedule.interval,
                                        adopted=result.fetched == "adopted",
                                        elapsed=(ended - started).total_seconds())
