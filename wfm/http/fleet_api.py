"""The read API for people and tools (`/api/fleet/...`) and the Git-hosting hook.

Devices with their capabilities, what their branch holds, the last status of every
deployment per component and its recent reports (each with the server's receive time and
the device's own time of it), eligibility per intent with every failing clause, and the
branch history; deployment counts per state, rolled up per intent and application.
When the server has operator credentials (`wfm.identity.operators`), reading needs the
viewer role, rollout actions the operator role, and the operators and the audit trail the
admin role; each action is recorded in the audit trail (`wfm.fleet.audit`), refusals of a
known caller below the role too.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from compiler.explain import explain_device
from compiler.explain_fleet import explain_fleet
from compiler.secrets import FleetKey, SecretError
from compiler.snapshot import snapshot_from_documents
from compiler.source import SourceError, load_source
from wfm.fleet.audit import FAILED, OK, REFUSED, Auditor, entries
from wfm.fleet.compiles import SourceConfig
from wfm.fleet.freshness import STALE_POLLS, Freshness, device_freshness
from wfm.fleet.leadtime import LeadTimes
from wfm.fleet.rollouts import ACTIONS, RolloutController, RolloutError, served_from
from wfm.fleet.sourcecondition import load_condition
from wfm.fleet.sources import RemoteSource, fetch_source
from wfm.http.device_api import Api
from wfm.http.webhooks import WebhookError, check_headers, verify_push
from wfm.identity.operators import (
    Operator,
    OperatorAuth,
    Role,
    caller_address,
    refusal,
)
from wfm.identity.operatorstore import OperatorRegistry
from wfm.problems import ProblemError
from wfm.store import records
from wfm.store.fleet_rows import load_rollouts
from wfm.telemetry.metrics import WEBHOOKS

__all__ = ["AUDIT_LIMIT", "FleetApi"]

#: The most audit entries one read returns (`?limit=`).
AUDIT_LIMIT = 10_000


def _instant(text: str | None) -> float | None:
    """`?since=` as Unix time: seconds, or an ISO 8601 time (UTC unless it says)."""
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ProblemError(400, f"?since={text!r}: Unix seconds or an ISO 8601 time"
                           ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def _errors(deployments: list[Any], statuses: dict[str, dict[str, Any]]
            ) -> list[dict[str, Any]]:
    """The failed deployments of a device with the error each reported (what a person
    scanning the fleet needs next to the state counts)."""
    found = []
    for deployment in deployments:
        status = statuses.get(deployment.deployment_id)
        if status is None or status["state"] != "failed":
            continue
        error = status["document"].get("status", {}).get("error") or {}
        found.append({"intent": deployment.intent, "deploymentId": deployment.deployment_id,
                      "code": error.get("code"), "message": error.get("message")})
    return found


def _repaired(status: dict[str, Any] | None) -> dict[str, str] | None:
    """What the device's last report says a drift repair restored (component -> what had
    drifted: `x-margo-gitops-extensions.repaired`), if it says so."""
    extension = (status or {}).get("document", {}).get("x-margo-gitops-extensions")
    repaired = extension.get("repaired") if isinstance(extension, dict) else None
    if not isinstance(repaired, dict):
        return None
    return {str(k)[:256]: str(v)[:1024] for k, v in list(repaired.items())[:100]}


class FleetApi:
    def __init__(self, api: Api, *, source: SourceConfig, admin_token: str | None = None,
                 remote: RemoteSource | None = None, webhook_secret: str | None = None,
                 source_kind: str = "directory", stale_polls: float = STALE_POLLS,
                 auth: OperatorAuth | None = None, audit: Auditor | None = None):
        """`source_kind`: hosted, mirrored, directory or none (shown with its condition);
        `stale_polls`: polling intervals of silence after which a device is stale; `auth`:
        who may do what (default: `admin_token` alone, an admin); `audit`: the trail each
        action is recorded in (opened when the server starts)."""
        self.api, self.source, self.source_kind = api, source, source_kind
        self.stale_polls = stale_polls
        self.admin_token, self.remote, self.webhook_secret = admin_token, remote, webhook_secret
        self.auth = auth if auth is not None else OperatorAuth(admin_token=admin_token)
        self.audit = audit if audit is not None else Auditor()
        #: Told of each change a verified push hook brings (set when the server starts).
        self.lead: LeadTimes | None = None

    def _authorize(self, request: Request) -> Operator:
        """The caller of a read: it needs the viewer role."""
        return self.auth.require(request, Role.VIEWER)

    async def authorize(self, request: Request, role: Role, *, action: str | None = None,
                        target: str = "") -> Operator:
        """The caller, when it may act as `role` (`OperatorAuth.require`: else 401 or 403).
        For a change (`action` named: `rollout.pause`...), a known caller refused below
        the role is recorded in the audit trail before the 403 goes out."""
        caller = self.auth.caller(request)
        if caller.may(role):
            return caller
        refused = refusal(caller, role)
        if action is not None:
            await self.audit.record(caller, action, target, outcome=REFUSED,
                                    detail=refused.detail, address=caller_address(request))
        raise refused

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Every deployment's last reported status, by deployment id."""
        return self.api.db.read(records.statuses_by_deployment)

    def device_row(self, device_id: str) -> records.DeviceRow | None:
        return self.api.db.read(lambda c: records.device_row(c, device_id))

    def device_summary(self, row: records.DeviceRow, statuses: dict[str, dict[str, Any]],
                       polls: dict[str, tuple[float | None, float | None]] | None = None,
                       ) -> dict[str, Any]:
        """`polls`: every client's last poll and interval (`Api.client_polls`), when the
        caller summarises many devices; read here otherwise."""
        deployments = self.api.desired.device_deployments(row.device_id)
        states = Counter(statuses.get(d.deployment_id, {}).get("state", "pending")
                         for d in deployments)
        properties = row.document.get("properties", {})
        return {"deviceId": row.device_id, "clientId": row.client_id, "shape": row.shape,
                "vendor": properties.get("vendor"), "reportedAt": row.reported_at,
                "deployments": len(deployments), "states": dict(sorted(states.items())),
                "labels": row.document.get("labels", {}),
                "freshness": self._freshness(row, deployments, statuses, polls).to_json(),
                "errors": _errors(deployments, statuses)}

    def _freshness(self, row: records.DeviceRow, deployments: list[Any],
                   statuses: dict[str, dict[str, Any]],
                   polls: dict[str, tuple[float | None, float | None]] | None) -> Freshness:
        if polls is None:
            polls = self.api.client_polls()
        held = {d.deployment_id: d.digest for d in deployments}
        mine = {i: statuses[i] for i in held if i in statuses}
        last_poll, interval = polls.get(row.client_id, (None, None))
        heard = [t for t in (row.reported_at, last_poll,
                             *(s.get("reportedAt") for s in mine.values())) if t is not None]
        return device_freshness(deployments=held, statuses=mine,
                                last_seen=max(heard) if heard else None,
                                poll_interval=interval, now=time.time(),
                                stale_polls=self.stale_polls)

    def device_rows(self) -> list[records.DeviceRow]:
        return self.api.db.read(records.device_rows)

    async def devices(self, request: Request) -> Response:
        self._authorize(request)
        await self.api.catch_up()
        statuses = self.statuses()
        polls = self.api.client_polls()
        return JSONResponse({"devices": [self.device_summary(r, statuses, polls)
                                         for r in self.device_rows()]})

    def eligibility(self, device_ids: Iterable[str]) -> dict[str, list[dict[str, Any]] | str]:
        """Per device, every intent's explanation, or why none can be given. The source and
        the snapshot are read once for all devices (the dashboard asks for the whole fleet).
        Blocking (Git, compiler): call it in a worker thread."""
        ids = list(device_ids)
        if self.source.path is None:
            return dict.fromkeys(ids, "no fleet source is configured")
        try:
            source = load_source(self.source.path, ref=self.source.ref)
        except SourceError as exc:
            return dict.fromkeys(ids, str(exc))
        snapshot = snapshot_from_documents(self.api.db.read(records.device_documents))
        key = self._fleet_key()
        return {device_id: [e.to_json() for e in explain_device(
                    source, snapshot, device_id, placed=self._placed(device_id),
                    fleet_key=key)]
                if device_id in snapshot.devices else "the device's capabilities are not valid"
                for device_id in ids}

    def _fleet_key(self) -> FleetKey | None:
        """The fleet key the compiler uses, so explanations open secrets as it does; None
        when none is configured or it cannot be read (explanations then say so)."""
        if self.source.fleet_key is None:
            return None
        try:
            return FleetKey.load(self.source.fleet_key)
        except (OSError, SecretError):
            return None

    def fleet_explanation(self, intent: str | None, application: str | None) -> dict[str, Any]:
        """One intent's or application's verdict on every device (`compiler.explain_fleet`).
        Blocking: call it in a worker thread."""
        if self.source.path is None:
            raise ProblemError(409, "no fleet source is configured")
        try:
            source = load_source(self.source.path, ref=self.source.ref)
        except SourceError as exc:
            raise ProblemError(409, f"the fleet source cannot be read: {exc}") from None
        snapshot = snapshot_from_documents(self.api.db.read(records.device_documents))
        try:
            return explain_fleet(source, snapshot, intent=intent, application=application,
                                 placed_of=self._placed, fleet_key=self._fleet_key())
        except KeyError:
            raise ProblemError(404, f"no intent {intent!r} in the fleet source") from None

    async def explain(self, request: Request) -> Response:
        self._authorize(request)
        intent = request.query_params.get("intent") or None
        application = request.query_params.get("app") or None
        if (intent is None) == (application is None):
            raise ProblemError(400, "name exactly one of ?intent=NAME or ?app=ID")
        return JSONResponse(await run_in_threadpool(self.fleet_explanation, intent,
                                                    application))

    def _rollout_controller(self) -> RolloutController:
        return RolloutController(self.api.db, served_from(self.api.desired, self.api.db))

    def rollout_views(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every rollout (or one), for people. Blocking: call it in a worker thread."""
        states = self.api.db.read(load_rollouts)
        if name is not None:
            if name not in states:
                raise ProblemError(404, f"intent {name!r} has no rollout")
            states = {name: states[name]}
        specs: dict[str, Any] = {}
        if self.source.path is not None:
            try:
                source = load_source(self.source.path, ref=self.source.ref)
                specs = {n: i.rollout for n, i in source.intents.items()}
            except SourceError:
                pass
        controller = self._rollout_controller()
        return [controller.view(state, specs.get(n)) for n, state in sorted(states.items())]

    async def rollouts(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"rollouts": await run_in_threadpool(self.rollout_views)})

    async def rollout(self, request: Request) -> Response:
        self._authorize(request)
        [view] = await run_in_threadpool(self.rollout_views, request.path_params["intent"])
        return JSONResponse(view)

    async def rollout_action(self, request: Request) -> Response:
        """pause | resume | abort: the operator role."""
        name, action = request.path_params["intent"], request.path_params["action"]
        if action not in ACTIONS:
            raise ProblemError(404, f"unknown action {action!r} (pause, resume or abort)")
        caller = await self.authorize(request, Role.OPERATOR, action=f"rollout.{action}",
                                      target=name)
        return JSONResponse(await self.act_on_rollout(request, caller, name, action))

    async def act_on_rollout(self, request: Request, caller: Operator, name: str,
                             action: str) -> dict[str, Any]:
        """Pause, resume or abort the rollout of intent `name` as `caller`, who was
        authorized for the operator role (`authorize`); recorded in the audit trail
        (failures too: 404 no rollout, 409 not in a state the action applies to). The
        rollout's view afterwards."""
        address = caller_address(request)
        try:
            await run_in_threadpool(self._rollout_controller().act, name, action, by=caller)
        except RolloutError as exc:
            await self.audit.record(caller, f"rollout.{action}", name, outcome=FAILED,
                                    detail=str(exc), address=address)
            status = 404 if "has no rollout" in str(exc) else 409
            raise ProblemError(status, str(exc)) from None
        await self.audit.record(caller, f"rollout.{action}", name, outcome=OK,
                                address=address)
        self.api.compiles.trigger(settle=False)
        [view] = await run_in_threadpool(self.rollout_views, name)
        return view

    async def operators(self, request: Request) -> Response:
        """Every registered operator (never a token): the admin role."""
        self.auth.require(request, Role.ADMIN)
        rows = await self.api.db.offload(OperatorRegistry(self.api.db).describe)
        return JSONResponse({"operators": rows})

    async def audit_trail(self, request: Request) -> Response:
        """The audit trail, oldest first: `?since=` (Unix seconds or ISO 8601), `?actor=`,
        `?limit=` (the newest N; default and most `AUDIT_LIMIT`). The admin role."""
        self.auth.require(request, Role.ADMIN)
        query = request.query_params
        since = _instant(query.get("since"))
        try:
            limit = int(query.get("limit") or AUDIT_LIMIT)
        except ValueError:
            raise ProblemError(400, "?limit= must be a whole number") from None
        if not 1 <= limit <= AUDIT_LIMIT:
            raise ProblemError(400, f"?limit= must be between 1 and {AUDIT_LIMIT}")
        found = await self.api.db.offload(
            lambda: entries(self.api.db, since=since, actor=query.get("actor") or None,
                            limit=limit))
        return JSONResponse({"entries": [e.to_json() for e in found]})

    def _placed(self, device_id: str) -> dict[str, bytes]:
        """The intents the device's branch holds, with their files (capacity accounting
        counts them first, and decides from the files whether an upgrade is held)."""
        return {served.intent: served.data
                for served in self.api.desired.device_deployments(device_id) if served.intent}

    def device_deployments(self, device_id: str,
                           statuses: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """What the device's branch holds, each with its last reported status and which
        bytes that status is about (`applied`: their digest, how that was known, and
        whether they are the bytes the branch holds now: `wfm.fleet.attribution`)."""
        deployments = []
        for served in self.api.desired.device_deployments(device_id):
            status = statuses.get(served.deployment_id)
            deployments.append({
                "deploymentId": served.deployment_id, "intent": served.intent,
                "applicationId": served.application_id, "digest": served.digest,
                "state": status["state"] if status else "pending",
                "components": status["document"].get("components", []) if status else [],
                "error": status["document"].get("status", {}).get("error") if status else None,
                "reportedAt": status["reportedAt"] if status else None,
                "applied": None if status is None else {
                    "digest": status["applied"], "via": status["appliedVia"],
                    "current": status["applied"] == served.digest},
                "repaired": _repaired(status)})
        return deployments

    def history(self, device_id: str) -> list[dict[str, Any]]:
        return [{"commit": c.id, "time": c.timestamp, "message": c.message}
                for c in self.api.desired.history(device_id, limit=20)]

    async def device(self, request: Request) -> Response:
        self._authorize(request)
        await self.api.catch_up()
        device_id = request.path_params["deviceId"]
        row = self.device_row(device_id)
        if row is None:
            raise ProblemError(404, f"no device {device_id!r}", margo_type="device-not-found")
        statuses = self.statuses()
        deployments = self.device_deployments(device_id, statuses)
        reports = self.api.db.read(lambda c: records.status_history(
            c, [d["deploymentId"] for d in deployments]))
        for deployment in deployments:  # each report: server receive time and device time
            deployment["statusHistory"] = reports.get(deployment["deploymentId"], [])
        history = self.history(device_id)
        eligibility = (await run_in_threadpool(self.eligibility, [device_id]))[device_id]
        return JSONResponse({**self.device_summary(row, statuses),
                             "capabilities": row.document, "deployments": deployments,
                             "eligibility": eligibility, "history": history})

    async def deployments(self, request: Request) -> Response:
        self._authorize(request)
        await self.api.catch_up()
        return JSONResponse(self.deployment_counts(self.statuses()))

    def deployment_counts(self, statuses: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Deployments per state: in total, per intent and per application."""
        by_state: Counter[str] = Counter()
        by_intent: dict[str, Counter[str]] = defaultdict(Counter)
        by_application: dict[str, Counter[str]] = defaultdict(Counter)
        for row in self.device_rows():
            for served in self.api.desired.device_deployments(row.device_id):
                state = statuses.get(served.deployment_id, {}).get("state", "pending")
                by_state[state] += 1
                by_intent[served.intent or "?"][state] += 1
                by_application[served.application_id or "?"][state] += 1
        return {
            "total": sum(by_state.values()), "byState": dict(sorted(by_state.items())),
            "byIntent": {k: dict(sorted(v.items())) for k, v in sorted(by_intent.items())},
            "byApplication": {k: dict(sorted(v.items()))
                              for k, v in sorted(by_application.items())}}

    async def source_condition(self, request: Request) -> Response:
        """What the last compile made of the fleet source (`wfm.fleet.sourcecondition`)."""
        self._authorize(request)
        condition = self.api.db.read(load_condition)
        doc = condition.to_json() if condition is not None else {
            "state": "waiting", "revision": None, "message": "not compiled yet",
            "problems": [], "problemCount": 0, "checkedAt": None}
        return JSONResponse({"kind": self.source_kind, **doc})

    async def git_hook(self, request: Request) -> Response:
        arrived = time.time()
        if self.remote is None or not self.webhook_secret:
            WEBHOOKS.labels("not_configured").inc()
            raise ProblemError(404, "this server has no webhook-triggered fleet source")
        try:
            # Refused unread when the headers already tell (wfm.http.webhooks.check_headers).
            check_headers(request.headers, self.webhook_secret)
            event = verify_push(await request.body(), request.headers, self.webhook_secret)
        except WebhookError as exc:
            WEBHOOKS.labels("refused").inc()
            raise ProblemError(exc.status, str(exc)) from None
        if event is None or event.ref != self.remote.ref:
            WEBHOOKS.labels("ignored").inc()
        if event is None:
            return Response(status_code=204)
        if event.ref != self.remote.ref:
            return JSONResponse({"ignored": f"push to {event.ref}, not {self.remote.ref}"},
                                status_code=202)
        try:
            commit = await run_in_threadpool(fetch_source, self.remote, self.api.coordinator)
        except RuntimeError as exc:
            WEBHOOKS.labels("fetch_failed").inc()
            raise ProblemError(502, str(exc), retry_after=30) from None
        WEBHOOKS.labels("fetched").inc()
        if self.lead is not None:
            self.lead.received("webhook", arrived)
        self.api.compiles.trigger(settle=False)
        return JSONResponse({"fetched": commit, "compiling": True}, status_code=202)

    def routes(self) -> list[Route]:
        return [
            Route("/api/fleet/devices", self.devices, methods=["GET"]),
            Route("/api/fleet/devices/{deviceId:path}", self.device, methods=["GET"]),
            Route("/api/fleet/deployments", self.deployments, methods=["GET"]),
            Route("/api/fleet/source", self.source_condition, methods=["GET"]),
            Route("/api/fleet/explain", self.explain, methods=["GET"]),
            Route("/api/fleet/rollouts", self.rollouts, methods=["GET"]),
            Route("/api/fleet/rollouts/{intent}", self.rollout, methods=["GET"]),
            Route("/api/fleet/rollouts/{intent}/{action}", self.rollout_action,
                  methods=["POST"]),
            Route("/api/fleet/operators", self.operators, methods=["GET"]),
            Route("/api/fleet/audit", self.audit_trail, methods=["GET"]),
            Route("/hooks/git", self.git_hook, methods=["POST"]),
        ]
