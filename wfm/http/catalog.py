"""The read API's lists for `margo get` and `margo describe`: the fleet source's intents
and applications, every deployment of every device in one answer, and the staged
rollouts one device belongs to.

`wfm.http.fleet_api` answers per device and counts per state; a listing of the fleet's
parts, each with the labels a selector filters on, is this module's job. Everything here
only reads, behind the same viewer authorization as the rest of the read API, and shows
no parameter value (a literal may be a secret in plain text): only parameter names.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from compiler.intents import Intent
from compiler.source import FleetSource, SourceError, load_source
from wfm.http.fleet_api import FleetApi
from wfm.identity.operators import Role
from wfm.problems import ProblemError
from wfm.store import records
from wfm.store.fleet_rows import load_rollouts

__all__ = ["FleetCatalog", "catalog_routes"]

#: The problems listed with a broken intent or application (the rest are counted).
MAX_PROBLEMS = 20


def _problems(source: FleetSource, prefix: str) -> list[str]:
    """The located problems of the files under `prefix` (an intent's file, an app's
    directory), formatted as editors read them."""
    found = [p for p in source.problems if (p.file or "").startswith(prefix)]
    return [p.format() for p in found[:MAX_PROBLEMS]]


def _intent_view(intent: Intent) -> dict[str, Any]:
    """An intent for people: what it deploys, where, how; parameter names only."""
    document = intent.document.value if isinstance(intent.document.value, dict) else {}
    metadata, spec = document.get("metadata") or {}, document.get("spec") or {}
    return {"name": intent.name, "file": intent.file, "broken": False, "problems": [],
            "labels": dict(metadata.get("labels") or {}),
            "description": metadata.get("description"),
            "application": {"id": intent.application_id,
                            "version": intent.application_version},
            "profile": {"id": intent.profile_id,
                        "type": intent.profile_type.value if intent.profile_type else None},
            "namespace": intent.namespace, "priority": intent.priority,
            "overcommit": intent.overcommit, "gracePeriodSeconds": intent.grace_seconds,
            "targets": spec.get("targets"), "constraints": spec.get("constraints"),
            "parameters": sorted(intent.parameters), "rollout": spec.get("rollout"),
            "outputShape": intent.output_shape, "digest": intent.digest}


class FleetCatalog:
    """The listing endpoints; reads through the `FleetApi` it extends (its store, desired
    state, source configuration and authorization)."""

    def __init__(self, fleet: FleetApi):
        self.fleet = fleet

    def _source(self) -> FleetSource:
        """The fleet source as the compiler reads it; a 409 problem when there is none or
        it cannot be read. Blocking (Git): call it in a worker thread."""
        config = self.fleet.source
        if config.path is None:
            raise ProblemError(409, "no fleet source is configured")
        try:
            return load_source(config.path, ref=config.ref)
        except SourceError as exc:
            raise ProblemError(409, f"the fleet source cannot be read: {exc}") from None

    def intent_views(self) -> list[dict[str, Any]]:
        """Every intent of the source (broken ones with their problems), each with its
        deployments per state and its rollout's status. Blocking: a worker thread."""
        source = self._source()
        counts = self.fleet.deployment_counts(self.fleet.statuses())["byIntent"]
        rollouts = self.fleet.api.db.read(load_rollouts)
        views = [_intent_view(i) for i in source.intents.values()]
        views += [{"name": name, "file": f"deployments/{name}.yaml", "broken": True,
                   "problems": _problems(source, f"deployments/{name}."), "labels": {}}
                  for name in source.broken_intents if name not in source.intents]
        for view in views:
            view["deployments"] = counts.get(view["name"], {})
            state = rollouts.get(view["name"])
            view["rolloutStatus"] = state["status"] if state else None
        return sorted(views, key=lambda v: str(v["name"]))

    def application_views(self) -> list[dict[str, Any]]:
        """Every application of the source: its versions with their profiles, the intents
        naming it, its deployments per state. Blocking: a worker thread."""
        source = self._source()
        counts = self.fleet.deployment_counts(self.fleet.statuses())["byApplication"]
        names = sorted(set(source.applications) | source.broken_apps)
        views = []
        for app_id in names:
            versions = source.applications.get(app_id, {})
            views.append({
                "id": app_id, "labels": {}, "broken": app_id in source.broken_apps,
                "problems": _problems(source, f"apps/{app_id}/"),
                "name": next((v.description.name for v in versions.values()), None),
                "versions": [{"version": version, "file": found.file,
                              "digest": found.digest, "profiles": [
                                  {"id": p.id, "type": p.type.value}
                                  for p in found.description.profiles]}
                             for version, found in sorted(versions.items())],
                "intents": sorted(i.name for i in source.intents.values()
                                  if i.application_id == app_id),
                "deployments": counts.get(app_id, {})})
        return views

    def deployment_views(self) -> list[dict[str, Any]]:
        """Every deployment every device's branch holds, with its last status and the
        device's labels (a selector on deployments filters by their device's)."""
        statuses = self.fleet.statuses()
        return [{"deviceId": row.device_id, "clientId": row.client_id,
                 "labels": row.document.get("labels", {}), **deployment}
                for row in self.fleet.device_rows()
                for deployment in self.fleet.device_deployments(row.device_id, statuses)]

    def memberships(self, device_id: str) -> list[dict[str, Any]]:
        """The staged rollouts `device_id` is a member of: the wave it is in (index and
        name), whether the rollout moved it yet, the rollout's status. Blocking."""
        views = {v["intent"]: v for v in self.fleet.rollout_views()}
        found = []
        for name, state in self.fleet.api.db.read(load_rollouts).items():
            wave = state.get("waves", {}).get(device_id)
            if wave is None:
                continue
            waves = views.get(name, {}).get("waves", [])
            moved = state.get("moved")
            found.append({"intent": name, "status": state["status"], "wave": wave,
                          "waveName": waves[wave]["name"] if wave < len(waves) else None,
                          "openWave": state.get("openWave"),
                          "moved": state["status"] == "complete"
                          or (moved is not None and device_id in moved)})
        return found

    def _viewer(self, request: Request) -> None:
        """Refuse callers below the viewer role, as the rest of the read API does."""
        self.fleet.auth.require(request, Role.VIEWER)

    async def intents(self, request: Request) -> Response:
        self._viewer(request)
        return JSONResponse({"intents": await run_in_threadpool(self.intent_views)})

    async def applications(self, request: Request) -> Response:
        self._viewer(request)
        return JSONResponse({"applications": await run_in_threadpool(self.application_views)})

    async def deployments(self, request: Request) -> Response:
        self._viewer(request)
        await self.fleet.api.catch_up()
        return JSONResponse({"deployments": await run_in_threadpool(self.deployment_views)})

    async def rollout_members(self, request: Request) -> Response:
        self._viewer(request)
        device_id = request.query_params.get("device")
        if not device_id:
            raise ProblemError(400, "name the device: ?device=ID")
        if self.fleet.api.db.read(lambda c: records.device_owner(c, device_id)) is None:
            raise ProblemError(404, f"no device {device_id!r}", margo_type="device-not-found")
        return JSONResponse({"deviceId": device_id, "rollouts": await run_in_threadpool(
            self.memberships, device_id)})


def catalog_routes(fleet: FleetApi) -> list[Route]:
    """The listing endpoints, next to `FleetApi.routes()` in the server's routing."""
    catalog = FleetCatalog(fleet)
    return [
        Route("/api/fleet/intents", catalog.intents, methods=["GET"]),
        Route("/api/fleet/applications", catalog.applications, methods=["GET"]),
        Route("/api/fleet/deployment-list", catalog.deployments, methods=["GET"]),
        Route("/api/fleet/rollout-members", catalog.rollout_members, methods=["GET"]),
    ]
