"""Capability intake: devices register, report and delete what they are.

The capabilities endpoints also take the cluster proposal's `ClusterCapabilitiesManifest`:
it is validated, converted to the rc.3 document the device client would have sent for the
same cluster (`margo.cluster.device_capabilities_from_cluster`) and from then on stored,
compiled and shown exactly like one, so both bodies are matched alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from compiler.gitstore import GitStoreError
from margo.cluster import (
    CLUSTER_API_VERSION,
    CLUSTER_KIND,
    device_capabilities_from_cluster,
    is_cluster_manifest,
    validate_cluster_manifest,
)
from margo.digests import data_digest
from margo.errors import DocumentError, Problem, short_repr
from margo.identifiers import DEVICE_ID, LABEL_KEY, label_value_problem
from margo.kinds import Kind, Shape
from margo.models import DeviceCapabilities
from margo.sealing import ENCRYPTION_KEY, EXTENSION, KEY_TYPE, device_recipient
from margo.validation import validate_value
from wfm.http.callers import Callers
from wfm.http.device_api import Api
from wfm.http.request_parts import check_identifier, generation, json_body
from wfm.identity.clients import Client
from wfm.problems import ProblemError, semantic_error
from wfm.store import records
from wfm.store.database import Connection

__all__ = ["CapabilityIntake"]


class CapabilityIntake:
    """`PUT|POST|DELETE .../capabilities`, in every generation of the API."""

    def __init__(self, api: Api, callers: Callers) -> None:
        self.api, self.callers = api, callers

    async def put(self, request: Request) -> Response:
        """rc.3 `PUT /api/v1/capabilities/{deviceId}` (201 created, 200 updated); rc.2
        `POST|PUT .../capabilities[/{deviceId}]` (always 201)."""
        client, _ = await self.callers.scoped(request)
        doc = await json_body(request)
        device_id = request.path_params.get("deviceId")
        if device_id is None:  # rc.2 POST/PUT .../capabilities, id from the body
            device_id = _reported_id(doc)
        else:
            check_identifier(DEVICE_ID, device_id, "deviceId")
        created = await self.report(client, device_id, doc, generation(request))
        rc3 = request.scope["path"].startswith("/api/v1/capabilities/")
        return Response(status_code=201 if created or not rc3 else 200)

    async def put_oct_2024(self, request: Request) -> Response:
        """Oct-2024 `POST|PUT /device/{deviceId}/capabilities`."""
        client = await self.callers.authenticate(request)
        doc = await json_body(request)
        device_id = request.path_params["deviceId"]
        check_identifier(DEVICE_ID, device_id, "deviceId")
        await self.report(client, device_id, doc, Shape.OCT_2024)
        return Response(status_code=201)

    async def report(self, client: Client, device_id: str, doc: dict[str, Any],
                     speaks: str) -> bool:
        """Validate and store a device's capabilities; whether the device is new. `speaks`:
        the API generation the report came through, stored as the device's generation
        (its documents' shape: docs/server.md "Generations"), not the shape of the
        document, which cannot tell rc.2 from rc.3 (rc.3 examples carry rc.2's apiVersion
        and kind, our rc.2 client sends labels)."""
        if is_cluster_manifest(doc):
            doc = _cluster_document(device_id, doc)
        try:
            caps: DeviceCapabilities = validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
        except DocumentError as exc:
            raise semantic_error(exc.problems) from None
        problems = _label_problems(doc) + _key_problems(doc)
        if problems:
            raise semantic_error(problems)
        if caps.device_id != device_id:
            raise ProblemError(422, f"properties.id {caps.device_id!r} does not match the "
                               f"deviceId {device_id!r} in the path",
                               margo_type="semantic-error",
                               errors=[{"field": "properties.id", "message": "must equal the "
                                        "deviceId in the path"}])
        parent = device_id.rpartition("/")[0]
        # Another client's gateway is answered like an unknown one: no way to learn which
        # ids other clients use, and no child under a gateway the caller does not own.
        if parent and await self.api.db.aread(
                lambda c: records.device_owner(c, parent)) != client.client_id:
            raise ProblemError(404, f"no gateway {parent!r} of this client has reported its "
                               "capabilities", margo_type="gateway-not-found")
        result = await self._store(client, device_id, doc, speaks)
        if result.created:
            self.api.devices.changed(client.client_id)
            self.api.desired.bump()
        if result.changed:
            self.api.compiles.trigger()
        return result.created

    async def _store(self, client: Client, device_id: str, doc: dict[str, Any],
                     shape: str) -> records.CapabilityWrite:
        api = self.api

        def write(conn: Connection) -> records.CapabilityWrite:
            result = records.store_capabilities(
                conn, client_id=client.client_id, device_id=device_id, document=doc,
                digest=data_digest(doc), shape=shape, max_devices=api.max_devices)
            if result.created and api.coordinator is not None:
                api.coordinator.registered(conn, client.client_id, device_id)
            return result

        try:
            return await api.db.write(write)
        except PermissionError:
            # Ids are unique across the fleet: registering a taken one can only fail.
            raise ProblemError(403, f"device {device_id!r} belongs to another client",
                               margo_type="not-authorized") from None
        except records.DeviceLimitReached as limit:
            raise ProblemError(403, f"client {client.client_id!r} holds {limit.limit} "
                               "devices, the most one client may (margo serve "
                               "--max-devices-per-client); delete one first",
                               margo_type="not-authorized") from None
        except BaseException:
            api.devices.changed(client.client_id)  # it may have committed before failing
            raise

    async def delete(self, request: Request) -> Response:
        """Forget a device of the caller (and its children): its rows, its statuses, and
        its branch with its whole history, so that the id, once registered again (by
        anyone), starts from nothing. Another client's device is answered like an unknown
        one (404): no way to learn which ids others use. The branch goes first: if it
        cannot (the compile lock stays taken), nothing is forgotten and the caller retries.
        With replicas the branch's deletion is published with the rows instead
        (`_delete_published`)."""
        client, _ = await self.callers.scoped(request)
        device_id = request.path_params["deviceId"]
        family = [d for d in await self.api.devices_of(client)
                  if d == device_id or d.startswith(device_id + "/")]
        if not family:
            raise ProblemError(404, f"no device {device_id!r} for this client",
                               margo_type="device-not-found")
        if self.api.coordinator is not None:
            return await self._delete_published(client, device_id)
        try:
            await run_in_threadpool(self.api.desired.forget_devices, family)
        except GitStoreError as exc:
            raise ProblemError(503, f"device {device_id!r} was not deleted: its branch "
                               f"could not be deleted now ({exc})", retry_after=5) from None
        await self._forget(client, device_id,
                           lambda conn: records.forget_device(conn, client.client_id, device_id))
        self.api.desired.bump()
        self.api.compiles.trigger()
        return Response(status_code=204)

    async def _delete_published(self, client: Client, device_id: str) -> Response:
        """Replicas: the served repository is a copy of what is published, so the device's
        rows go together with a publication of its branches as deleted, in one
        transaction (`Coordinator.forget_device`); every replica drops them when it syncs
        (this one before it answers), and the compiling one forgets the devices before it
        compiles again."""
        coordinator = self.api.coordinator
        assert coordinator is not None
        await self._forget(
            client, device_id,
            lambda conn: coordinator.forget_device(conn, client.client_id, device_id))
        await self.api.caught_up()
        self.api.desired.bump()
        self.api.compiles.trigger()
        return Response(status_code=204)

    async def _forget(self, client: Client, device_id: str,
                      forget: Callable[[Connection], bool]) -> None:
        """Run a deletion's write. Afterwards the client's devices are read again (even if
        the write failed: it may have committed first); a device that another request
        forgot in the meantime is 404."""
        try:
            removed = await self.api.db.write(forget)
        finally:
            self.api.devices.changed(client.client_id)
            self.api.attribution.handouts.forget(device_id)
        if not removed:
            raise ProblemError(404, f"no device {device_id!r} for this client",
                               margo_type="device-not-found")


def _reported_id(doc: dict[str, Any]) -> str:
    """The device id a body names: `properties.id`, or a cluster manifest's `metadata.id`."""
    field = "metadata" if is_cluster_manifest(doc) else "properties"
    section = doc.get(field)
    device_id = section.get("id") if isinstance(section, dict) else None
    if not isinstance(device_id, str):
        raise ProblemError(400, f"{field}.id is required", margo_type="invalid-request")
    return check_identifier(DEVICE_ID, device_id, f"{field}.id")


def _key_problems(doc: dict[str, Any]) -> list[Problem]:
    """An `encryptionKey` the compiler could not seal to (docs/secrets.md): refused now,
    rather than the device silently getting no sensitive values."""
    ours = doc.get(EXTENSION)
    if not isinstance(ours, dict) or ENCRYPTION_KEY not in ours:
        return []
    if device_recipient(doc) is not None:
        return []
    return [Problem((EXTENSION, ENCRYPTION_KEY), "an encryption key is "
                    f"{{type: {KEY_TYPE}, recipient: age1...}} (an age X25519 recipient)",
                    found=short_repr(ours[ENCRYPTION_KEY]))]


def _label_problems(doc: dict[str, Any]) -> list[Problem]:
    """Every label key that is not a `margo.identifiers.LABEL_KEY`, and every value too big
    or with control characters (selectors, the dashboard and templates all read them)."""
    labels = doc.get("labels")
    if not isinstance(labels, dict):
        return []
    problems = []
    for key, value in labels.items():
        problem = LABEL_KEY.problem(key)
        if problem is not None:
            shown = key if len(key) <= 80 else key[:77] + "..."  # a path, not a copy
            problems.append(Problem(("labels", shown), problem, found=short_repr(key)))
            continue
        problem = label_value_problem(value)
        if problem is not None:
            problems.append(Problem(("labels", key), problem, found=short_repr(value)))
    return problems


def _cluster_document(device_id: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """A ClusterCapabilitiesManifest as the rc.3 document stored for it: every validation
    problem in one 422, and the cluster id must be the device id of the path. A body the
    proposal's field test recognises (apiSurface + metadata.kubernetesVersion) may leave out
    apiVersion/kind, as rc.3 device documents do."""
    manifest = {"apiVersion": CLUSTER_API_VERSION, "kind": CLUSTER_KIND, **manifest}
    problems = validate_cluster_manifest(manifest)
    if problems:
        raise semantic_error(problems)
    cluster_id = check_identifier(DEVICE_ID, manifest["metadata"]["id"], "metadata.id")
    if cluster_id != device_id:
        raise ProblemError(422, f"metadata.id {cluster_id!r} does not match the deviceId "
                           f"{device_id!r} in the path", margo_type="semantic-error",
                           errors=[{"field": "metadata.id", "message": "must equal the "
                                    "deviceId in the path"}])
    try:
        return device_capabilities_from_cluster(manifest)
    except DocumentError as exc:
        raise semantic_error(exc.problems) from None
