"""Staged rollouts, the fleet server's side: how far each rollout has got, from the status
reports and the clock, as the plan the compiler turns into desired state
(`compiler.rollout`).

A rollout starts when an intent with `spec.rollout` changes revision (its document without
the rollout spec, plus its application version's digest) after its previous revision
finished. State per intent lives in the database (`rollouts`), so any replica can show it
and the compiling one moves it on:

* devices of the open waves that reported `installed` for the deployment's current bytes
  (`wfm.fleet.attribution`: the status is about that digest, whatever the device's generation
  or source) count as installed; `failed` for those bytes counts as failed; a device
  still pending when its wave has been open for `waveDeadline` counts as stale;
* failed plus stale beyond `maxFailed` → `rolled back`: every moved device gets its file
  from before back (the compiler commits that, saying why), and the rollout stays so until
  the intent changes again;
* a device of an open wave counts as pending until a compile has moved it (the plan that
  compile was given opened its wave: `moved`), so a wave never settles on the reports its
  devices made for the revision they ran before;
* with `maxUnavailable`, the open wave lets its devices through progressively (`admitted`,
  in `compiler.rollout.next_admissions` order): only while fewer than that many devices of
  the rollout are unavailable (pending, failed or stale); the others wait;
* once no device of the open wave is pending or waiting, the wave has settled; `soak` later
  the next wave opens, or after the last one the rollout is `complete`;
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
from functools import partial
from typing import Any

from compiler.compilation import CompileReport, resolve_intents
from compiler.rollout import (
    RolloutPlan,
    RolloutSpec,
    budget_of,
    next_admissions,
    unavailable_limit,
)
from compiler.source import FleetSource
from margo.digests import data_digest
from wfm.fleet.desired import DesiredState
from wfm.fleet.freshness import status_for_current
from wfm.identity.operators import Operator
from wfm.store import records
from wfm.store.database import Connection, Database
from wfm.store.fleet_rows import (
    load_rollout_text,
    load_rollout_texts,
    replace_rollout,
    rollout_text,
    status_verdicts,
)

__all__ = ["ACTIONS", "ACTIVE", "RolloutController", "RolloutError", "Served", "actions_for",
           "served_from"]

#: Rollout states in which waves still move (status reports matter, timers are set).
ACTIVE = ("progressing",)
#: While a rollout moves, it is evaluated at least this often (seconds).
RECHECK_SECONDS = 5.0
_HISTORY = 200
#: Where a device of an open wave that has not installed the new revision stands.
_UNAVAILABLE = ("pending", "failed", "stale")
#: How often a rollout's read-change-write is tried again after another writer changed the
#: rollout in between (`replace_rollout`): operators act seconds apart, so more is a fault.
_ATTEMPTS = 20


#: The operator actions, each with the rollout states it applies in (`RolloutController.act`).
ACTIONS: dict[str, tuple[str, ...]] = {"pause": ("progressing",), "resume": ("paused",),
                                       "abort": ("progressing", "paused")}


def actions_for(status: str) -> tuple[str, ...]:
    """The operator actions that apply to a rollout in `status` (what `act` would accept)."""
    return tuple(action for action, states in ACTIONS.items() if status in states)


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


class RolloutController:
    def __init__(self, db: Database, served: Callable[[str, str], Served | None]) -> None:
        """`served(device, intent)`: the deployment the device's branch holds for the intent
        (None: none)."""
        self._db, self._served = db, served
        self.next_due: float | None = None
        #: The plans the last `plans()` gave the compiler: `after_compile` records which
        #: devices that compile moved.
        self._given: dict[str, RolloutPlan] = {}

    # --- before and after a compile ----------------------------------------------------

    def plans(self, source: FleetSource, now: float | None = None) -> dict[str, RolloutPlan]:
        """Move every rollout on as far as the reports and the clock allow; the plans of
        those not complete (`compile_fleet(rollouts=)`). A rollout another writer changed
        while it was evaluated (an operator's pause) is evaluated again as it now stands."""
        now = time.time() if now is None else now
        resolved = resolve_intents(source)
        for _ in range(_ATTEMPTS):
            plans, changed = self._evaluate_all(resolved.usable, now)
            if not changed or self._db.write_sync(partial(_replace_rollouts, changed)):
                self._given = plans
                return plans
        raise RuntimeError(f"the rollouts changed under {_ATTEMPTS} evaluations in a row")

    def _evaluate_all(self, usable: dict[str, Any], now: float
                      ) -> tuple[dict[str, RolloutPlan],
                                 dict[str, tuple[str | None, dict[str, Any]]]]:
        """Every rollout moved on from its stored state: the plans of those not complete,
        and the states that changed, each with the text it was read as."""
        stored = self._db.read(load_rollout_texts)
        plans: dict[str, RolloutPlan] = {}
        changed: dict[str, tuple[str | None, dict[str, Any]]] = {}
        self.next_due = None
        for name, (intent, app) in sorted(usable.items()):
            if intent.rollout is None:
                continue
            revision = data_digest({"intent": intent.rollout_digest, "app": app.digest})
            before = stored.get(name)
            state = _started(None if before is None else json.loads(before), revision, now)
            state["intent"] = name
            if state["status"] in ACTIVE:
                self._evaluate(state, intent.rollout, now)
            if state["status"] in ACTIVE:
                # Status reports ask for compiles, but one may reach a replica that has not
                # seen the rollout start yet: look again soon whatever happens.
                self._due(now + RECHECK_SECONDS)
            if rollout_text(state) != before:
                state["updatedAt"] = now
                changed[name] = (before, state)
            if state["status"] != "complete":
                capped = unavailable_limit(intent.rollout, len(state.get("waves", {})))
                plans[name] = RolloutPlan(
                    revision, state["status"], int(state["openWave"]), dict(state["base"]),
                    state.get("reason", ""),
                    admitted=None if capped is None else frozenset(state.get("admitted", {})))
        return plans, changed

    def after_compile(self, report: CompileReport) -> None:
        """Remember each rollout's waves, the bases of the devices the compile moved, and
        which devices the plan it was given let move (from now on their reports count)."""
        if not report.rollout_waves:
            return
        given = self._given

        def record(name: str, waves: dict[str, int], state: dict[str, Any]) -> None:
            state["waves"] = dict(sorted(waves.items()))
            for device, base in report.rollout_moves.get(name, {}).items():
                state["base"].setdefault(device, base)
            plan = given.get(name)
            if plan is not None and plan.revision == state["revision"] and "moved" in state:
                moved = set(state["moved"])
                moved.update(d for d, w in waves.items() if plan.is_open(w, d))
                state["moved"] = sorted(moved)

        def update(conn: Connection) -> None:
            for name, waves in report.rollout_waves.items():
                _change_rollout(conn, name, partial(record, name, waves))

        self._db.write_sync(update)

    # --- progress -----------------------------------------------------------------------

    def _evaluate(self, state: dict[str, Any], spec: RolloutSpec, now: float) -> None:
        waves: dict[str, int] = state.get("waves", {})
        open_wave = int(state["openWave"])
        limit = unavailable_limit(spec, len(waves))
        statuses = self._statuses()
        verdicts = {device: self._verdict(device, state, now, spec.deadline_seconds, wave,
                                          statuses, capped=limit is not None)
                    for device, wave in sorted(waves.items()) if wave <= open_wave}
        if limit is not None:
            admitted = state.setdefault("admitted", {})
            unavailable = sum(v in _UNAVAILABLE for v in verdicts.values())
            for device in next_admissions(
                    state["intent"], [d for d, v in verdicts.items() if v == "waiting"],
                    unavailable, limit):
                admitted[device] = now
                verdicts[device] = "pending"  # until the compile after this one moves it
        counts = {"installed": 0, "failed": 0, "stale": 0, "pending": 0, "waiting": 0}
        pending_in_open = 0
        for device, verdict in verdicts.items():
            counts[verdict] += 1
            if waves[device] == open_wave and verdict in ("pending", "waiting"):
                pending_in_open += 1
                if verdict == "pending":
                    self._due(_started_at(state, device, open_wave, now)
                              + spec.deadline_seconds)
        state["counts"] = counts
        history = state.setdefault("history", [])
        point = [round(now, 3), counts["installed"], counts["failed"], counts["stale"]]
        if not history or history[-1][1:] != point[1:]:
            history.append(point)
            del history[:-_HISTORY]
        budget = budget_of(spec, len(waves))
        if counts["failed"] + counts["stale"] > budget:
            state["status"] = "rolled back"
            # Where each device stood when the budget ran out: the reason's counts and the
            # view's columns both come from it (the rollback moves the devices on).
            state["verdicts"] = verdicts
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

    def _statuses(self) -> dict[str, tuple[str, str | None]]:
        """Every stored status (state, the digest it is about) by deployment id, read once
        per evaluation rather than once per device."""
        return self._db.read(status_verdicts)

    def _verdict(self, device: str, state: dict[str, Any], now: float, deadline: float,
                 wave: int, statuses: dict[str, tuple[str, str | None]], *,
                 capped: bool) -> str:
        """installed | failed | stale | pending, or waiting: a device of the open wave of a
        capped rollout not let through yet. `capped`: the rollout has a `maxUnavailable`."""
        moved = state.get("moved")  # None: a rollout stored before moves were recorded
        if moved is not None and device not in moved:
            if capped and wave == int(state["openWave"]) and \
                    device not in state.get("admitted", {}):
                return "waiting"
            # Its wave is open, but no compile has moved it yet: whatever it reported was
            # about the revision it ran before.
            opened = _started_at(state, device, wave, now)
            return "stale" if now - opened > deadline else "pending"
        served = self._served(device, state["intent"])
        if served is None:
            return "installed"  # nothing of the intent there (no longer targeted): no wait
        status = statuses.get(served.deployment_id)
        if status is not None and status[0] in ("installed", "failed") and \
                status_for_current(served.digest, {"applied": status[1]}):
            return status[0]
        opened = _started_at(state, device, wave, now)
        return "stale" if now - opened > deadline else "pending"

    def _due(self, when: float) -> None:
        self.next_due = when if self.next_due is None else min(self.next_due, when)

    # --- what people see ----------------------------------------------------------------

    def view(self, state: dict[str, Any], spec: RolloutSpec | None,
             now: float | None = None) -> dict[str, Any]:
        """One rollout for people: per wave, its devices, how many moved, and where the
        devices of open waves stand (installed / failed / stale / pending, or waiting for
        room under `maxUnavailable`); held devices of closed waves; the cap, how many
        devices are unavailable and why the rest waits (`blocked`); the progress history."""
        now = time.time() if now is None else now
        waves: dict[str, int] = state.get("waves", {})
        names = [w.name for w in spec.waves] if spec is not None else []
        count = max(len(names), max(waves.values(), default=-1) + 1)
        per = [{"name": names[i] if i < len(names) else f"wave-{i}", "devices": 0,
                "moved": 0, "installed": 0, "failed": 0, "stale": 0, "pending": 0,
                "waiting": 0, "held": 0, "openedAt": state["openedAt"].get(str(i)),
                "settledAt": state["settledAt"].get(str(i))} for i in range(count)]
        open_wave = int(state["openWave"])
        deadline = spec.deadline_seconds if spec is not None else 3600
        limit = unavailable_limit(spec, len(waves)) if spec is not None else None
        statuses = self._statuses()
        complete = state["status"] == "complete"
        # A finished rollout moved every device (the last compile was given no plan, so it
        # recorded no moves); one rolled back moves no device further.
        shown = state if not complete else {**state, "moved": None}
        never_moved = (state["status"] == "rolled back" and state.get("moved") is not None)
        # Rolled back by the failure budget: where the devices stood then, as the reason
        # counts them (since, the rollback has moved them back to their base).
        frozen: dict[str, str] | None = (state.get("verdicts")
                                         if state["status"] == "rolled back" else None)
        unavailable = 0
        for device, wave in sorted(waves.items()):
            entry = per[wave]
            entry["devices"] += 1
            entry["moved"] += device in state["base"]
            if frozen is not None:
                verdict = frozen.get(device, "held")
                entry[verdict] += 1
                unavailable += verdict in _UNAVAILABLE
            elif (complete or wave <= open_wave) and not (never_moved
                                                          and device not in state["moved"]):
                verdict = self._verdict(device, shown, now, deadline, wave, statuses,
                                        capped=limit is not None)
                entry[verdict] += 1
                unavailable += verdict in _UNAVAILABLE
            else:
                entry["held"] += 1
        waiting = sum(w["waiting"] for w in per)
        return {"intent": state["intent"], "status": state["status"],
                "revision": state["revision"], "previous": state.get("previous"),
                "superseded": state.get("superseded"), "openWave": open_wave,
                "reason": state.get("reason", ""), "startedAt": state.get("startedAt"),
                "updatedAt": state.get("updatedAt"),
                "failureBudget": budget_of(spec, len(waves)) if spec is not None else None,
                "maxUnavailable": limit, "unavailable": unavailable,
                "blocked": (f"{unavailable} device(s) unavailable, maxUnavailable {limit}: "
                            f"{waiting} device(s) of the open wave wait"
                            if limit is not None and waiting and unavailable >= limit
                            and state["status"] in ACTIVE else ""),
                "waves": per, "history": state.get("history", [])}

    # --- operators ----------------------------------------------------------------------

    def act(self, name: str, action: str, now: float | None = None, *,
            by: Operator | None = None) -> dict[str, Any]:
        """pause | resume | abort the rollout of intent `name` (`by`: who, named in an
        abort's reason); its new state."""
        now = time.time() if now is None else now
        allowed = ACTIONS
        if action not in allowed:
            raise RolloutError(f"unknown action {action!r} (pause, resume or abort)")

        def change(state: dict[str, Any]) -> None:
            if state["status"] not in allowed[action]:
                raise RolloutError(f"the rollout of {name!r} is {state['status']}; "
                                   f"{action} needs it {' or '.join(allowed[action])}")
            state["status"] = {"pause": "paused", "resume": "progressing",
                               "abort": "rolled back"}[action]
            if action == "abort":
                state["reason"] = ("aborted by an operator" if by is None
                                   else f"aborted by {by.name}")
            state["updatedAt"] = now

        def act_on(conn: Connection) -> dict[str, Any]:
            state = _change_rollout(conn, name, change)
            if state is None:
                raise RolloutError(f"intent {name!r} has no rollout")
            return state

        result: dict[str, Any] = self._db.write_sync(act_on)
        return result


def _replace_rollouts(changed: dict[str, tuple[str | None, dict[str, Any]]],
                      conn: Connection) -> bool:
    """Every changed rollout stored over the text it was read as; whether all were (one
    that another writer changed meanwhile keeps that writer's state). A list, not a
    generator: the others are stored even when one is not."""
    return all([replace_rollout(conn, name, before, state)
                for name, (before, state) in changed.items()])


def _change_rollout(conn: Connection, name: str,
                    change: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
    """Read the rollout of intent `name`, `change` it in place and write it back, again from
    the row as it then stands if another writer changed it in between (another replica's;
    `replace_rollout`). The state written; None: no rollout."""
    for _ in range(_ATTEMPTS):
        before = load_rollout_text(conn, name)
        if before is None:
            return None
        state: dict[str, Any] = json.loads(before)
        change(state)
        if replace_rollout(conn, name, before, state):
            return state
    raise RuntimeError(f"the rollout of {name!r} changed under {_ATTEMPTS} writes in a row")


def _started_at(state: dict[str, Any], device: str, wave: int, now: float) -> float:
    """When a device's wait for the new revision began (its wave deadline runs from it):
    when `maxUnavailable` let it through, else when its wave opened."""
    admitted = state.get("admitted", {}).get(device)
    if admitted is not None:
        return float(admitted)
    return float(state["openedAt"].get(str(wave), now))


def _started(state: dict[str, Any] | None, revision: str, now: float) -> dict[str, Any]:
    """The state after seeing `revision`: the first revision seen is complete (there is
    nothing to stage against); a new one starts a rollout, superseding one that moves."""
    if state is None:
        return {"intent": None, "revision": revision, "previous": None, "status": "complete",
                "openWave": 0, "openedAt": {}, "settledAt": {}, "base": {}, "waves": {},
                "reason": "", "history": [], "startedAt": now, "moved": [], "admitted": {}}
    if state["revision"] == revision:
        return state
    superseding = state["status"] != "complete"
    return {**state, "revision": revision,
            "previous": state["previous"] if superseding else state["revision"],
            "status": "progressing", "openWave": 0, "openedAt": {"0": now}, "settledAt": {},
            "base": dict(state["base"]) if superseding else {}, "reason": "",
            "history": [], "startedAt": now, "moved": [], "admitted": {}, "verdicts": None,
            "superseded": state["revision"] if superseding else None}
