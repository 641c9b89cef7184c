"""The fleet's gauges for `GET /metrics`, computed from the shared database when scraped.

Why from the database and not from counters kept in memory: replicas each see a share of
the reports, and a gauge such as "devices current" must read the same on every replica (a
dashboard that sums or picks any replica must not double or halve the fleet). So each
scrape reads the devices, statuses, polls, rollouts and the source's condition, and the
deployments each device's branch holds (the served repository, brought to the newest
published generation first), and derives the same states the read API shows
(`wfm.fleet.freshness`, `wfm.fleet.rollouts`). That costs a read of the fleet (about 30 ms of
CPU per 1,000 devices, measured), so the result is kept `CACHE_SECONDS`: scrapes by several
Prometheus servers cost one computation. When the database cannot be read, a scrape still
answers with this process's own figures (and the last fleet gauges, if any): the alerts
about an unreachable database need them.

Also here, per replica: whether it holds the compile lease and how many generations it is
behind what was published (a single SQLite server holds the lease and is never behind).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily

from margo.kinds import Shape
from margo.models import DeploymentState
from wfm.fleet.desired import DesiredState
from wfm.fleet.freshness import STALE_POLLS, device_freshness
from wfm.fleet.lastseen import PollClock
from wfm.fleet.sourcecondition import load_condition
from wfm.store import fleet_rows, records
from wfm.store.database import Connection, Database

if TYPE_CHECKING:
    from wfm.fleet.coordination import Coordinator

__all__ = ["CACHE_SECONDS", "FleetCollector"]

log = logging.getLogger("margo.wfm.metrics")
#: How long one computation of the fleet's gauges answers scrapes.
CACHE_SECONDS = 5.0
FRESHNESS = ("current", "pending", "failed-on-current", "stale")
SPECS = tuple(str(shape) for shape in Shape)
DEPLOYMENT_STATES = tuple(str(state) for state in DeploymentState)
ROLLOUT_STATES = ("progressing", "paused", "rolled back", "complete")
WAVE_STATES = ("waiting", "open", "settled")
SOURCE_STATES = ("ready", "invalid", "unreadable", "failing", "waiting")


def _label(value: str) -> str:
    """Label values in Prometheus' usual snake case (`rolled back` -> `rolled_back`)."""
    return value.replace(" ", "_").replace("-", "_")


def _fleet_rows(conn: Connection) -> dict[str, Any]:
    """Everything the gauges need, in one read (lean columns: no documents)."""
    return {
        "devices": fleet_rows.gauge_devices(conn),
        "statuses": fleet_rows.gauge_statuses(conn),
        "polls": records.client_polls(conn),
        "rollouts": fleet_rows.load_rollouts(conn),
        "condition": load_condition(conn),
        "generation": fleet_rows.fleet_generation(conn),
        "in_flight": fleet_rows.lead_marks_in_flight(conn),
    }


class FleetCollector:
    """The fleet's gauges (a callable yielding metric families), cached `CACHE_SECONDS`."""

    def __init__(self, db: Database, desired: DesiredState, *,
                 stale_polls: float = STALE_POLLS, coordinator: Coordinator | None = None,
                 cache_seconds: float = CACHE_SECONDS, polls: PollClock | None = None) -> None:
        self._db, self._desired, self._stale_polls = db, desired, stale_polls
        self._polls = polls  # this process's polls not written yet (`PollClock.up_to_date`)
        self._coordinator, self._cache_seconds = coordinator, cache_seconds
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Any]] | None = None

    def __call__(self) -> Iterator[Any]:
        """Called from a worker thread by `wfm.telemetry.metrics.MetricsEndpoint.render`."""
        with self._lock:
            cached = self._cached
            if cached is None or time.monotonic() - cached[0] > self._cache_seconds:
                try:
                    cached = self._cached = (time.monotonic(), self._compute())
                except Exception as exc:  # the database away: this process's own figures
                    log.warning("fleet metrics not computed: %s", exc)  # must still come
                    cached = (0.0, cached[1] if cached is not None else [])
        yield from cached[1]
        try:
            yield from self._replica()
        except Exception as exc:
            log.warning("replica metrics not computed: %s", exc)

    def _compute(self) -> list[Any]:
        if self._coordinator is not None:
            self._coordinator.sync()  # the branches as published, as every replica sees them
        rows = self._db.read(_fleet_rows)
        if self._polls is not None:
            rows["polls"] = self._polls.up_to_date(rows["polls"])
        now = time.time()
        devices: Counter[tuple[str, str]] = Counter()
        deployments: Counter[str] = Counter()
        statuses = rows["statuses"]
        for device_id, client_id, shape, reported_at in rows["devices"]:
            held = {d.deployment_id: d.digest
                    for d in self._desired.device_deployments(device_id)}
            mine = {i: {"state": statuses[i][0], "applied": statuses[i][1]}
                    for i in held if i in statuses}
            for deployment_id in held:
                deployments[statuses[deployment_id][0] if deployment_id in statuses
                            else "pending"] += 1
            last_poll, interval = rows["polls"].get(client_id, (None, None))
            heard = [t for t in (reported_at, last_poll,
                                 *(statuses[i][2] for i in mine)) if t is not None]
            freshness = device_freshness(deployments=held, statuses=mine,
                                         last_seen=max(heard) if heard else None,
                                         poll_interval=interval, now=now,
                                         stale_polls=self._stale_polls)
            devices[(freshness.state, shape if shape in SPECS else "other")] += 1
        return [self._devices(devices), self._deployments(deployments),
                *self._rollouts(rows["rollouts"]), self._source(rows["condition"]),
                GaugeMetricFamily("margo_fleet_generation", "The newest published "
                                  "generation of the fleet's desired state (replicas; 0 "
                                  "on one SQLite server).", value=rows["generation"]),
                GaugeMetricFamily("margo_lead_time_pending_deployments", "Deployments "
                                  "whose current bytes no report has said installed yet "
                                  "(their lead time is still running).",
                                  value=rows["in_flight"])]

    @staticmethod
    def _devices(counts: Counter[tuple[str, str]]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "margo_devices", "Devices by freshness (current, pending, failed_on_current, "
            "stale: as the read API's freshness) and by the Margo spec generation they "
            "report in (rc.3, rc.2, oct-2024).", labels=["freshness", "spec"])
        specs = sorted({*SPECS, *(spec for _, spec in counts)})
        for state in FRESHNESS:
            for spec in specs:
                family.add_metric([_label(state), spec], counts.get((state, spec), 0))
        return family

    @staticmethod
    def _deployments(counts: Counter[str]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "margo_deployments", "Deployments the devices' branches hold, by the state "
            "last reported (pending: none yet).", labels=["state"])
        for state in sorted({*DEPLOYMENT_STATES, *counts}):
            family.add_metric([_label(state)], counts.get(state, 0))
        return family

    @staticmethod
    def _rollouts(states: dict[str, dict[str, Any]]) -> list[GaugeMetricFamily]:
        rollouts = GaugeMetricFamily("margo_rollouts", "Staged rollouts (one per intent "
                                     "with spec.rollout) by state.", labels=["state"])
        waves = GaugeMetricFamily(
            "margo_rollout_waves", "Waves of the staged rollouts by state: settled (every "
            "device installed or counted, soak begun or done), open (devices moving), "
            "waiting (not opened yet).", labels=["state"])
        by_state: Counter[str] = Counter()
        by_wave: Counter[str] = Counter()
        for state in states.values():
            status = str(state.get("status", "complete"))
            by_state[status] += 1
            count = max(state.get("waves", {}).values(), default=-1) + 1
            open_wave = int(state.get("openWave", 0))
            settled = state.get("settledAt", {})
            for wave in range(count):
                if status == "complete" or str(wave) in settled:
                    by_wave["settled"] += 1
                elif wave <= open_wave and status != "rolled back":
                    by_wave["open"] += 1
                else:
                    by_wave["waiting"] += 1
        for status in sorted({*ROLLOUT_STATES, *by_state}):
            rollouts.add_metric([_label(status)], by_state.get(status, 0))
        for wave_state in WAVE_STATES:
            waves.add_metric([wave_state], by_wave.get(wave_state, 0))
        return [rollouts, waves]

    @staticmethod
    def _source(condition: Any) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "margo_source_condition", "What the last compile made of the fleet source: 1 "
            "for the current state (ready, invalid, unreadable, failing, waiting).",
            labels=["state"])
        current = "waiting" if condition is None else condition.state
        for state in sorted({*SOURCE_STATES, current}):
            family.add_metric([state], 1 if state == current else 0)
        return family

    def _replica(self) -> Iterator[GaugeMetricFamily]:
        coordinator = self._coordinator
        holding = coordinator is None or coordinator.holding
        yield GaugeMetricFamily("margo_replica_compile_lease", "1 while this replica holds "
                                "the compile lease (the one that compiles; one SQLite "
                                "server always does).", value=1 if holding else 0)
        lag = 0
        if coordinator is not None:
            published = self._db.read(fleet_rows.fleet_generation)
            lag = max(0, published - coordinator.generation)
        yield GaugeMetricFamily("margo_replica_generation_lag", "Published generations "
                                "this replica does not serve yet.", value=lag)

