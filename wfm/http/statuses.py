"""Status intake: a device reports how a deployment of its desired state went.

A report is checked whole before anything is stored (the document, its ids, that the
deployment was assigned to one of the caller's devices), attributed to the bytes it is
about (`wfm.fleet.attribution`), stored durably, and only then answered; a stored report may
settle a staged rollout's wave, so it may trigger a compile.
"""

from __future__ import annotations

import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from margo.digests import digest_of, sorted_json
from margo.errors import DocumentError
from margo.identifiers import DEPLOYMENT_ID, DEVICE_ID
from margo.kinds import Kind, Shape
from margo.models import DeploymentStatus
from margo.validation import validate_value
from wfm.fleet.attribution import claim_of
from wfm.http.callers import Callers
from wfm.http.device_api import Api
from wfm.http.request_parts import check_identifier, generation, json_body
from wfm.identity.clients import Client
from wfm.problems import ProblemError, semantic_error
from wfm.store import records
from wfm.store.coalesced import CoalescedWrites
from wfm.store.database import Connection

__all__ = ["MAX_MANIFEST_VERSION", "StatusIntake"]

#: The largest manifestVersion a status may say it adopted (SQL integers are signed 64-bit).
MAX_MANIFEST_VERSION = 2**63 - 1
#: What a manifest version sent as a string may look like (at most 2^64 - 1: 20 digits).
_DECIMAL = re.compile(r"[0-9]{1,20}")


class StatusIntake:
    """`POST .../deployments/{deploymentId}/status`, in every generation of the API."""

    def __init__(self, api: Api, callers: Callers) -> None:
        self.api, self.callers = api, callers
        self._rollouts_checked, self._rollouts_moving = -1e9, False
        self._written: CoalescedWrites[records.StatusReport, records.StatusWrite] | None = None

    @property
    def _writes(self) -> CoalescedWrites[records.StatusReport, records.StatusWrite]:
        """The reports that arrive together are written together (`wfm.store.coalesced`);
        the database exists once the server has started."""
        if self._written is None:
            self._written = CoalescedWrites(self.api.db, records.store_statuses,
                                            _store_one)
        return self._written

    async def post(self, request: Request) -> Response:
        client, _ = await self.callers.scoped(request)
        doc = await json_body(request)
        deployment_id = request.path_params["deploymentId"]
        path_device = request.path_params.get("deviceId")
        if path_device is not None:
            check_identifier(DEVICE_ID, path_device, "deviceId")
        doc, status = _validated(doc, deployment_id)
        device_id = await self._reporting_device(client, status, path_device, deployment_id)
        applied = await self.api.attribution.applied(
            client_id=client.client_id, device_id=device_id,
            deployment_id=deployment_id, claim=claim_of(doc))

        text = sorted_json(doc)  # serialized once: digested here, stored by the writer
        written = await self._writes.write(records.StatusReport(
            client.client_id, deployment_id, device_id, str(status.state), doc,
            digest_of(text.encode("utf-8")), status.adopted_manifest_version, applied, text))
        self.api.last_status_at = time.monotonic()
        if self.api.lead_times is not None:  # (queues an installed report; never waits)
            self.api.lead_times.reported(client.client_id, device_id, deployment_id,
                                         str(status.state), doc, applied, written.changed)
        if written.changed and await self._rollout_moving():
            self.api.compiles.trigger()  # the report may settle a wave or exhaust a budget
        # The status of an assigned deployment exists from its assignment on, so a report
        # updates it: 200 (what the official conformance kit expects); Oct-2024 said 201.
        return Response(status_code=201 if generation(request) == Shape.OCT_2024 else 200)

    async def _reporting_device(self, client: Client, status: DeploymentStatus,
                                path_device: str | None, deployment_id: str) -> str:
        """The device a report is filed under: the one it names, else the one the
        deployment was assigned to; 422 unless that is one of the caller's devices."""
        named = status.device_id or path_device
        if named is not None and not await self._is_clients_device(client, named):
            # Another client's device and an unknown id get the same answer (no oracle for
            # which ids other clients use), and a report is never filed under either.
            raise ProblemError(422, f"deviceId {named!r} is not one of this client's devices",
                               margo_type="semantic-error",
                               errors=[{"field": "deviceId", "message": "not one of this "
                                        "client's devices"}])
        owner = await self._deployment_device(client, deployment_id)
        if owner is None and await self.api.caught_up():  # assigned in a newer generation
            owner = await self._deployment_device(client, deployment_id)
        if owner is None:
            raise ProblemError(422, f"deployment {deployment_id} was never assigned to this "
                               "client's devices", margo_type="semantic-error")
        return named or owner

    async def _is_clients_device(self, client: Client, device_id: str) -> bool:
        """Whether the report's device is one of the client's: among its devices as its
        served state is made of them (on replicas read once per generation served, as the
        manifest reads them: `Api.served_devices`), else among those it has now (one
        registered since that list was read). Why not read every time: `margo device run`
        names its device in every report, and on replicas that was a PostgreSQL read per
        report. A device deleted on another replica stays listed until this replica
        syncs the deletion (itself a generation), as its branch stays served until then."""
        if device_id in await self.api.served_devices(client):
            return True
        return device_id in await self.api.devices_of(client)

    async def _rollout_moving(self) -> bool:
        """Whether a staged rollout moves (read at most every second: asked per status; the
        rollout is also evaluated every `wfm.fleet.rollouts.RECHECK_SECONDS` while it moves)."""
        now = time.monotonic()
        if now - self._rollouts_checked > 1:
            self._rollouts_checked = now
            self._rollouts_moving = await self.api.db.aread(records.rollout_progressing,
                                                            periodic=True)
        return self._rollouts_moving

    async def _deployment_device(self, client: Client, deployment_id: str) -> str | None:
        """The client's device the deployment is assigned to: in its recent REST manifests,
        else on a device's branch (a document that names no device, Oct-2024's shape, is
        served on its device's branch only, never in a REST manifest its siblings share),
        else where its last report was filed."""
        await self.api.served_state(client)
        for state in self.api.desired.recent_states(client.client_id):
            for served in state.deployments:
                if served.deployment_id == deployment_id:
                    return served.device_id
        for device_id in await self.api.devices_of(client):
            if any(served.deployment_id == deployment_id
                   for served in self.api.desired.device_deployments(device_id)):
                return device_id
        return await self.api.db.aread(lambda conn: records.status_device(conn, deployment_id,
                                                                          client.client_id))


def _store_one(conn: Connection, report: records.StatusReport) -> records.StatusWrite:
    return records.store_statuses(conn, [report])[0]


def _validated(doc: dict[str, Any], deployment_id: str
               ) -> tuple[dict[str, Any], DeploymentStatus]:
    """The report as stored and as read: a DeploymentStatus whose ids are valid names,
    whose deployment is the path's and whose adopted version was ever served; else 422."""
    adopted = doc.get("adoptedManifestVersion")
    if isinstance(adopted, str) and _DECIMAL.fullmatch(adopted):
        # The official conformance kit fills this from a template as a string ("3").
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
        doc = {**doc, "adoptedManifestVersion": int(adopted)}
    try:
        status: DeploymentStatus = validate_value(doc, expect=Kind.DEPLOYMENT_STATUS)
    except DocumentError as exc:
        raise semantic_error(exc.problems) from None
    check_identifier(DEPLOYMENT_ID, status.deployment_id, "deploymentId")
    adopted_version = status.adopted_manifest_version
    if adopted_version is not None and adopted_version > MAX_MANIFEST_VERSION:
        # The schema allows up to 2^64 - 1, but versions start at 1 and grow by one per
        # change: a larger one was never served (and does not fit an SQL integer).
        raise ProblemError(422, f"adoptedManifestVersion {adopted_version} was never "
                           "served: versions this server gives out stay below 2^63",
                           margo_type="semantic-error",
                           errors=[{"field": "adoptedManifestVersion",
                                    "message": "larger than any manifestVersion served"}])
    if status.device_id is not None:
        check_identifier(DEVICE_ID, status.device_id, "deviceId")
    if status.deployment_id != deployment_id:
        raise ProblemError(422, "deploymentId in the body does not match the path",
                           margo_type="semantic-error",
                           errors=[{"field": "deploymentId", "message": "must equal the "
                                    "deploymentId in the path"}])
    return doc, status
