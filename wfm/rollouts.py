"""Staged rollouts, the fleet server's side: how far each rollout has got, from the status
reports and the clock, as the plan the compiler turns into desired state
(`compiler.rollout`).

A rollout starts when an intent with `spec.rollout` changes revision (its document without
the rollout spec, plus its application version's digest) after its previous revision
finished. State per intent lives in the database (`rollouts`), so any replica can show it
and the compiling one moves it on:

* devices of the open waves that reported `installed` for the deployment's current bytes
  (`wfm.freshness`: the manifestVersion a status adopted held that digest) count as
  installed; `failed` for those bytes counts as failed; a device still pending when its
  wave has been open for `waveDeadline` counts as stale;
* failed plus stale beyond `maxFailed` → `rolled back`: every moved device gets its file
  from before back (the compiler commits that, saying why), and the rollout stays so until
  the intent changes again;
* once no device of the open wave is pending, the wave has settled; `soak` later the next
  wave opens, or after the last one the rollout is `complete`;
* a new revision while a rollout moves supersedes it: waves start again at the first, held
  devices go straight to the newest revision, and the moved devices keep the base they had
  (the last revision that completed);
* `pause` stops waves from opening (moved devices stay where they are), `resume` lets them
  open again, `abort` rolls back.

Evaluation runs before each compile on the replica that compiles; status reports and timers
(the end of a soak, a wave deadline) ask for compiles while a rollout moves.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compiler.compilation import CompileReport, resolve_intents
from compiler.rollout import RolloutPlan, RolloutSpec, budget_of
from compiler.source import FleetSource
from margo.digests import data_digest
from wfm import records
from wfm.db import Connection, Database
from wfm.desired import DesiredState
from wfm.freshness import status_for_current

__all__ = ["ACTIVE", "RolloutController", "RolloutError", "Served", "load_rollouts",
           "served_from"]

#: Rollout states in which waves still move (status reports matter, timers are set).
ACTIVE = ("progressing",)
#: While a rollout moves, it is evaluated at least this often (seconds).
RECHECK_SECONDS = 5.0
_HISTORY = 200


class RolloutError(ValueError):
    """An operator action that does not apply (no such rollout, or not in that state)."""


@dataclass(frozen=True, slots=True)
class Served:
    """Where a device's deployment of the intent stands."""

    deployment_id: str
    digest: str
    client_id: str


def served_from(desired: DesiredState, db: Database) -> Callable[[str, str], Served | None]:
    """`RolloutController`'s view of the device branches: what a replica serves."""
    def served(device_id: str, intent: str) -> Served | None:
        for deployment in desired.device_deployments(device_id):
            if deployment.intent == intent:
                owner = db.read(lambda conn: records.device_owner(conn, device_id))
                return None if owner is None else Served(
                    deployment.deployment_id, deployment.digest, owner)
        return None

    return served


def load_rollouts(conn: Connection) -> dict[str, dict[str, Any]]:
    return {row[0]: json.loads(row[1]) for row in conn.execute(
        "SELECT intent, state FROM rollouts ORDER BY intent")}


def _save(conn: Connection, name: str, state: dict[str, Any]) -> None:
    conn.execute("INSERT INTO rollouts (intent, state) VALUES (?, ?) ON CONFLICT (intent) "
                 "DO UPDATE SET state = excluded.state",
                 (name, json.dumps(state, sort_keys=True)))


class RolloutController:
    def __init__(self, db: Database, served: Callable[[str, str], Served | None]) -> None:
        """`served(device, intent)`: the deployment the device's branch holds for the intent
        (None: none)."""
        self._db, self._served = db, served
        self.next_due: float | None = None

    # --- before and after a compile ----------------------------------------------------

    def plans(self, source: FleetSource, now: float | None = None) -> dict[str, RolloutPlan]:
        """Move every rollout on as far as the reports and the clock allow; the plans of
        those not complete (`compile_fleet(rollouts=)`)."""
        now = time.time() if now is None else now
        resolved = resolve_intents(source)
        stored = self._db.read(load_rollouts)
        plans: dict[str, RolloutPlan] = {}
        changed: dict[str, dict[str, Any]] = {}
        self.next_due = None
        for name, (intent, app) in sorted(resolved.usable.items()):
            if intent.rollout is None:
                continue
            revision = data_digest({"intent": intent.rollout_digest, "app": app.digest})
            state = stored.get(name)
            before = json.dumps(state, sort_keys=True)
            state = _started(state, revision, now)
            state["intent"] = name
            if state["status"] in ACTIVE:
                self._evaluate(state, intent.rollout, now)
            if state["status"] in ACTIVE:
                # Status reports ask for compiles, but one may reach a replica that has not
                # seen the rollout start yet: look again soon whatever happens.
                self._due(now + RECHECK_SECONDS)
            if json.dumps(state, sort_keys=True) != before:
                state["updatedAt"] = now
                changed[name] = state
            if state["status"] != "complete":
                plans[name] = RolloutPlan(revision, state["status"], int(state["openWave"]),
                                          dict(state["base"]), state.get("reason", ""))
        if changed:
            self._db.write_sync(lambda conn: [_save(conn, n, s) for n, s in changed.items()])
        return plans

    def after_compile(self, report: CompileReport) -> None:
        """Remember each rollout's waves and the bases of the devices the compile moved."""
        if not report.rollout_waves:
            return

        def update(conn: Connection) -> None:
            stored = load_rollouts(conn)
            for name, waves in report.rollout_waves.items():
                state = stored.get(name)
                if state is None:
                    continue
                state["waves"] = dict(sorted(waves.items()))
                for device, base in report.rollout_moves.get(name, {}).items():
                    state["base"].setdefault(device, base)
                _save(conn, name, state)

        self._db.write_sync(update)

    # --- progress -----------------------------------------------------------------------

    def _evaluate(self, state: dict[str, Any], spec: RolloutSpec, now: float) -> None:
        waves: dict[str, int] = state.get("waves", {})
        open_wave = int(state["openWave"])
        counts = {"installed": 0, "failed": 0, "stale": 0, "pending": 0}
        pending_in_open = 0
        statuses = self._statuses()
        for device, wave in sorted(waves.items()):
            if wave > open_wave:
                continue
            verdict = self._verdict(device, state, now, spec.deadline_seconds, wave, statuses)
            counts[verdict] += 1
            if wave == open_wave and verdict == "pending":
                pending_in_open += 1
                deadline = float(state["openedAt"][str(wave)]) + spec.deadline_seconds
                self._due(deadline)
        state["counts"] = counts
        history = state.setdefault("history", [])
        point = [round(now, 3), counts["installed"], counts["failed"], counts["stale"]]
        if not history or history[-1][1:] != point[1:]:
            history.append(point)
            del history[:-_HISTORY]
        budget = budget_of(spec, len(waves))
        if counts["failed"] + counts["stale"] > budget:
            state["status"] = "rolled back"
            state["reason"] = (f"{counts['failed']} failed and {counts['stale']} stale "
                               f"device(s) exceed the failure budget of {budget}")
            return
        if not waves or pending_in_open:
            return
        settled = state["settledAt"].setdefault(str(open_wave), now)
        if now < settled + spec.soak_seconds:
            self._due(settled + spec.soak_seconds)
            return
        if open_wave + 1 >= len(spec.waves):
            state["status"] = "complete"
            return
        state["openWave"] = open_wave + 1
        state["openedAt"][str(open_wave + 1)] = now
        self._evaluate(state, spec, now)  # an empty wave settles at once

    def _statuses(self) -> dict[str, tuple[str, int | None]]:
        """Every stored status (state, adopted manifestVersion) by deployment id, read once
        per evaluation rather than once per device."""
        return self._db.read(lambda c: {r[0]: (r[1], r[2]) for r in c.execute(
            "SELECT deployment_id, state, adopted_manifest_version FROM statuses")})

    def _verdict(self, device: str, state: dict[str, Any], now: float, deadline: float,
                 wave: int, statuses: dict[str, tuple[str, int | None]]) -> str:
        served = self._served(device, state["intent"])
        if served is None:
            return "installed"  # nothing of the intent there (no longer targeted): no wait
        status = statuses.get(served.deployment_id)
        if status is not None and status[0] in ("installed", "failed") and \
                status[1] is not None:
            contents = self._db.read(lambda c: records.manifest_contents(
                c, served.client_id, {int(status[1])}))
            report = {"state": status[0], "adopted": status[1]}
            if status_for_current(served.digest, report, contents, served.deployment_id):
                return status[0]
        opened = float(state["openedAt"].get(str(wave), now))
        return "stale" if now - opened > deadline else "pending"

    def _due(self, when: float) -> None:
        self.next_due = when if self.next_due is None else min(self.next_due, when)

    # --- what people see ----------------------------------------------------------------

    def view(self, state: dict[str, Any], spec: RolloutSpec | None,
             now: float | None = None) -> dict[str, Any]:
        """One rollout for people: per wave, its devices, how many moved, and where the
        devices of open waves stand (installed / failed / stale / pending); held devices
        of closed waves; the progress history."""
        now = time.time() if now is None else now
        waves: dict[str, int] = state.get("waves", {})
        names = [w.name for w in spec.waves] if spec is not None else []
        count = max(len(names), max(waves.values(), default=-1) + 1)
        per = [{"name": names[i] if i < len(names) else f"wave-{i}", "devices": 0,
                "moved": 0, "installed": 0, "failed": 0, "stale": 0, "pending": 0, "held": 0,
                "openedAt": state["openedAt"].get(str(i)),
                "settledAt": state["settledAt"].get(str(i))} for i in range(count)]
        open_wave = int(state["openWave"])
        deadline = spec.deadline_seconds if spec is not None else 3600
        statuses = self._statuses()
        for device, wave in sorted(waves.items()):
            entry = per[wave]
            entry["devices"] += 1
            entry["moved"] += device in state["base"]
            if state["status"] == "complete" or wave <= open_wave:
                entry[self._verdict(device, state, now, deadline, wave, statuses)] += 1
            else:
                entry["held"] += 1
        return {"intent": state["intent"], "status": state["status"],
                "revision": state["revision"], "previous": state.get("previous"),
                "superseded": state.get("superseded"), "openWave": open_wave,
                "reason": state.get("reason", ""), "startedAt": state.get("startedAt"),
                "updatedAt": state.get("updatedAt"),
                "failureBudget": budget_of(spec, len(waves)) if spec is not None else None,
                "waves": per, "history": state.get("history", [])}

    # --- operators ----------------------------------------------------------------------

    def act(self, name: str, action: str, now: float | None = None) -> dict[str, Any]:
        """pause | resume | abort the rollout of intent `name`; its new state."""
        now = time.time() if now is None else now
        allowed = {"pause": ("progressing",), "resume": ("paused",),
                   "abort": ("progressing", "paused")}
        if action not in allowed:
            raise RolloutError(f"unknown action {action!r} (pause, resume or abort)")

        def change(conn: Connection) -> dict[str, Any]:
            state = load_rollouts(conn).get(name)
            if state is None:
                raise RolloutError(f"intent {name!r} has no rollout")
            if state["status"] not in allowed[action]:
                raise RolloutError(f"the rollout of {name!r} is {state['status']}; "
                                   f"{action} needs it {' or '.join(allowed[action])}")
            state["status"] = {"pause": "paused", "resume": "progressing",
                               "abort": "rolled back"}[action]
            if action == "abort":
                state["reason"] = "aborted by an operator"
            state["updatedAt"] = now
            _save(conn, name, state)
            return state

        result: dict[str, Any] = self._db.write_sync(change)
        return result


def _started(state: dict[str, Any] | None, revision: str, now: float) -> dict[str, Any]:
    """The state after seeing `revision`: the first revision seen is complete (there is
    nothing to stage against); a new one starts a rollout, superseding one that moves."""
    if state is None:
        return {"intent": None, "revision": revision, "previous": None, "status": "complete",
                "openWave": 0, "openedAt": {}, "settledAt": {}, "base": {}, "waves": {},
                "reason": "", "history": [], "startedAt": now}
    if state["revision"] == revision:
        return state
    superseding = state["status"] != "complete"
    return {**state, "revision": revision,
            "previous": state["previous"] if superseding else state["revision"],
            "status": "progressing", "openWave": 0, "openedAt": {"0": now}, "settledAt": {},
            "base": dict(state["base"]) if superseding else {}, "reason": "",
            "history": [], "startedAt": now,
            "superseded": state["revision"] if superseding else None}
