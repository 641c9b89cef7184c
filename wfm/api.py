"""The Margo device API in its three generations, one behaviour.

rc.3 (`/api/v1/...`), rc.2 (`/api/v1/clients/{clientId}/...` plus onboarding) and the
Oct-2024 Preview Release 1 (`/device/{deviceId}/...` plus the OAuth2 token endpoint) all
land in the same handlers; only status codes and path shapes differ where the generations
differ (rc.3 capabilities answer 201 created / 200 updated, rc.2 and Oct-2024 always 201).
The caller is always the authenticated client, and every resource is scoped to it.

The capabilities endpoints also take the cluster proposal's `ClusterCapabilitiesManifest`:
it is validated, converted to the rc.3 document the device client would have sent for the
same cluster (`margo.cluster.device_capabilities_from_cluster`) and from then on stored,
compiled and shown exactly like one, so both bodies are matched alike.
"""

from __future__ import annotations

import base64
import re
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from compiler.gitstore import GitStoreError
from margo import jsonstrict
from margo.cluster import (
    CLUSTER_API_VERSION,
    CLUSTER_KIND,
    device_capabilities_from_cluster,
    is_cluster_manifest,
    validate_cluster_manifest,
)
from margo.digests import data_digest, digest_of
from margo.errors import DocumentError, Problem, short_repr
from margo.identifiers import (
    DEPLOYMENT_ID,
    DEVICE_ID,
    LABEL_KEY,
    IdentifierFamily,
    label_value_problem,
)
from margo.kinds import Kind, Shape
from margo.models import DeploymentStatus, DeviceCapabilities
from margo.validation import validate_value
from wfm import records
from wfm.attribution import Attribution, claim_of
from wfm.clientdevices import ClientDevices
from wfm.clients import Client, ClientRegistry
from wfm.compiles import CompileService
from wfm.credentialcache import CredentialCache
from wfm.credentials import parse_basic, same_secret
from wfm.database import Connection, Database
from wfm.desired import BUNDLE_MEDIA_TYPE, ClientState, DesiredState, manifest_body
from wfm.httpcache import accepts as _accepts
from wfm.httpcache import etag_matches as _etag_matches
from wfm.httpcache import immutable as _immutable
from wfm.identity import Identity, IdentitySettings
from wfm.lastseen import PollClock
from wfm.problems import RETIRED, ProblemError, semantic_error
from wfm.signatures import OnboardingError, onboarding_key

if TYPE_CHECKING:  # psycopg loads only where PostgreSQL is used
    from wfm.coordination import Coordinator
    from wfm.leadtime import LeadTimes

__all__ = ["DEFAULT_MAX_DEVICES_PER_CLIENT", "MANIFEST_MEDIA_TYPE", "Api", "routes"]

MANIFEST_MEDIA_TYPE = "application/vnd.margo.manifest.v1+json"
MAX_BODY = 1024 * 1024
#: The most devices one client may hold unless `margo serve --max-devices-per-client` says
#: otherwise: far above a site's gateway, far below what fills a disk with histories.
DEFAULT_MAX_DEVICES_PER_CLIENT = 100_000
#: The largest manifestVersion a status may say it adopted (SQL integers are signed 64-bit).
MAX_MANIFEST_VERSION = 2**63 - 1


class Api:
    """The handlers; routes are bound when the app is built, resources when it starts."""

    db: Database
    clients: ClientRegistry
    desired: DesiredState
    compiles: CompileService
    ca_certificate: str | None = None  # PEM, served to rc.2 onboarding
    #: The most devices one client may hold (None: no limit); `margo serve
    #: --max-devices-per-client`.
    max_devices: int | None = None
    identity: Identity
    coordinator: Coordinator | None = None  # replicas on PostgreSQL (wfm.coordination)
    lead_times: LeadTimes | None = None  # told of each stored status (wfm.leadtime)

    def open(self, *, db: Database, clients: ClientRegistry, desired: DesiredState,
             compiles: CompileService, ca_certificate: str | None = None,
             identity: Identity | None = None, coordinator: Coordinator | None = None) -> None:
        self.db, self.clients, self.desired, self.compiles = db, clients, desired, compiles
        self.coordinator = coordinator
        self.ca_certificate = ca_certificate
        self.identity = identity or Identity(IdentitySettings())
        self.identity.open(clients)
        # Polls dominate the traffic: per client, the manifest served at a generation.
        self._manifests: dict[tuple[str, str], tuple[int, bytes, str, int]] = {}
        self._credentials = CredentialCache(
            lambda: db.offload(clients.credentials_epoch),
            lambda token: db.offload(clients.token_lookup, token))
        self.devices = ClientDevices(db, sole_writer=coordinator is None)
        self.polls = PollClock(db)
        self.attribution = Attribution(db, desired.deployments_at,
                                       sole_writer=coordinator is None)
        self._rollouts_checked, self._rollouts_moving = -1e9, False

    # --- authentication ----------------------------------------------------------------

    async def authenticate(self, request: Request) -> Client:
        """The caller, from the first proof it presents: an SVID (rc.3), an rc.2 signature,
        then (when enabled) a token. `wfm.identity` has the rules and the policy."""
        client = (self.identity.svid_caller(request)
                  or self.identity.signature_caller(request))
        if client is None and self.identity.settings.bearer_tokens:
            client = await self._token_caller(request)
        if client is None:
            raise ProblemError(401, "valid client credentials are required",
                               headers={"WWW-Authenticate": f"{self.identity.challenge} "
                                        'realm="margo-gitops"'})
        if client.retired:
            raise ProblemError(403, "the client relationship has been retired",
                               margo_type="not-authorized", title=RETIRED)
        return self.identity.vouch(request, client)  # its body: the device API's budget

    async def _token_caller(self, request: Request) -> Client | None:
        header = _header(request, b"authorization") or ""
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return await self._credentials.client(value.strip())
        if scheme.lower() == "basic":
            pair = parse_basic(header)
            if pair is None:
                return None
            client = await self._credentials.client(pair[1])
            return client if client is not None and same_secret(pair[0],
                                                                client.client_id) else None
        return None

    async def may_fetch(self, request: Request, device_id: str) -> bool:
        """Git hosting: the caller (HTTP basic `<clientId>:<token>`, or a bearer token) may
        read this device's repository only if the device is one of its own. With replicas,
        the repository is first brought to the newest published generation, so the two
        requests of one fetch (advertisement, pack) may reach different replicas: the
        second never lacks what the first advertised, and no replica serves a branch older
        than what another already answered before the request arrived."""
        try:
            client = await self.authenticate(request)
        except ProblemError:
            return False
        owner = await self.db.aread(lambda conn: records.device_owner(conn, device_id))
        if owner != client.client_id:
            return False
        if request.url.path.endswith("/info/refs"):  # a Git device's poll: it was heard
            self.polls.seen(client.client_id)
        await self._caught_up()
        return True

    def git_delivered(self, device_id: str, commit: str) -> None:
        """Git hosting handed the device its branch at `commit`: its reports that name no
        adopted state are about that commit from now on (`wfm.attribution`)."""
        self.attribution.handouts.delivered(device_id, commit)

    def lost_branch(self, device_id: str) -> str | None:
        """Git hosting, for a device without a branch in the served repository: why that is
        lost state, as the REST manifest would say it (None: no desired state yet)."""
        lost = self.desired.missing_branch(device_id)
        return None if lost is None else lost.detail

    async def scoped(self, request: Request) -> tuple[Client, str]:
        """The caller and the URL prefix its manifest URLs use (rc.2 paths carry the id)."""
        client = await self.authenticate(request)
        path_client = request.path_params.get("clientId")
        if path_client is None:
            return client, "/api/v1"
        if path_client != client.client_id:
            raise ProblemError(403, "a client may only use its own clientId",
                               margo_type="not-authorized")
        return client, f"/api/v1/clients/{client.client_id}"

    # --- bodies ------------------------------------------------------------------------

    @staticmethod
    async def json_body(request: Request) -> dict[str, Any]:
        """The body as a JSON object, parsed strictly (`margo.jsonstrict`): what is stored
        must serialize again, so NaN or 1e999 is a 400 now rather than a 500 on every read.
        The size check is a second line: `wfm.bodylimit` stops a larger body while it
        streams, before it is buffered here."""
        body = await request.body()
        if len(body) > MAX_BODY:
            raise ProblemError(413, f"request bodies are limited to {MAX_BODY} bytes")
        try:
            doc = jsonstrict.loads(body)  # NaN, 1e999, duplicate keys: refused here
        except jsonstrict.JsonRefused as exc:
            raise ProblemError(400, f"the request body is not valid JSON: {exc}",
                               margo_type="invalid-request") from None
        if not isinstance(doc, dict):
            raise ProblemError(400, "the request body must be a JSON object",
                               margo_type="invalid-request")
        return doc

    # --- capabilities ------------------------------------------------------------------

    async def put_capabilities(self, request: Request) -> Response:
        client, _ = await self.scoped(request)
        doc = await self.json_body(request)
        device_id = request.path_params.get("deviceId")
        if device_id is None:  # rc.2 POST/PUT .../capabilities, id from the body
            device_id = _reported_id(doc)
        else:
            _check_identifier(DEVICE_ID, device_id, "deviceId")
        created = await self.report_capabilities(client, device_id, doc)
        rc3 = request.scope["path"].startswith("/api/v1/capabilities/")
        return Response(status_code=201 if created or not rc3 else 200)

    async def report_capabilities(self, client: Client, device_id: str,
                                  doc: dict[str, Any]) -> bool:
        if is_cluster_manifest(doc):
            doc = _cluster_document(device_id, doc)
        try:
            caps: DeviceCapabilities = validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
        except DocumentError as exc:
            raise semantic_error(exc.problems) from None
        problems = _label_problems(doc)
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
        if parent and await self.db.aread(
                lambda c: records.device_owner(c, parent)) != client.client_id:
            raise ProblemError(404, f"no gateway {parent!r} of this client has reported its "
                               "capabilities", margo_type="gateway-not-found")

        def write(conn: Connection) -> records.CapabilityWrite:
            result = records.store_capabilities(
                conn, client_id=client.client_id, device_id=device_id, document=doc,
                digest=data_digest(doc), shape=str(caps.shape),
                max_devices=self.max_devices)
            if result.created and self.coordinator is not None:
                self.coordinator.registered(conn, client.client_id, device_id)
            return result

        try:
            result = await self.db.write(write)
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
            self.devices.changed(client.client_id)  # it may have committed before failing
            raise
        if result.created:
            self.devices.changed(client.client_id)
            self.desired.bump()
        if result.changed:
            self.compiles.trigger()
        return result.created

    async def delete_capabilities(self, request: Request) -> Response:
        """Forget a device of the caller (and its children): its rows, its statuses, and
        its branch with its whole history, so that the id, once registered again (by
        anyone), starts from nothing. Another client's device is answered like an unknown
        one (404): no way to learn which ids others use. The branch goes first: if it
        cannot (the compile lock stays taken), nothing is forgotten and the caller retries.
        With replicas the branch's deletion is published with the rows instead
        (`_delete_published`)."""
        client, _ = await self.scoped(request)
        device_id = request.path_params["deviceId"]
        family = [d for d in await self._devices(client)
                  if d == device_id or d.startswith(device_id + "/")]
        if not family:
            raise ProblemError(404, f"no device {device_id!r} for this client",
                               margo_type="device-not-found")
        if self.coordinator is not None:
            return await self._delete_published(client, device_id)
        try:
            await run_in_threadpool(self.desired.forget_devices, family)
        except GitStoreError as exc:
            raise ProblemError(503, f"device {device_id!r} was not deleted: its branch "
                               f"could not be deleted now ({exc})", retry_after=5) from None
        await self._forget(client, device_id,
                           lambda conn: records.forget_device(conn, client.client_id, device_id))
        self.desired.bump()
        self.compiles.trigger()
        return Response(status_code=204)

    async def _delete_published(self, client: Client, device_id: str) -> Response:
        """Replicas: the served repository is a copy of what is published, so the device's
        rows go together with a publication of its branches as deleted, in one
        transaction (`Coordinator.forget_device`); every replica drops them when it syncs
        (this one before it answers), and the compiling one forgets the devices before it
        compiles again."""
        coordinator = self.coordinator
        assert coordinator is not None
        await self._forget(
            client, device_id,
            lambda conn: coordinator.forget_device(conn, client.client_id, device_id))
        await self._caught_up()
        self.desired.bump()
        self.compiles.trigger()
        return Response(status_code=204)

    async def _forget(self, client: Client, device_id: str,
                      forget: Callable[[Connection], bool]) -> None:
        """Run a deletion's write. Afterwards the client's devices are read again (even if
        the write failed: it may have committed first); a device that another request
        forgot in the meantime is 404."""
        try:
            removed = await self.db.write(forget)
        finally:
            self.devices.changed(client.client_id)
            self.attribution.handouts.forget(device_id)
        if not removed:
            raise ProblemError(404, f"no device {device_id!r} for this client",
                               margo_type="device-not-found")

    # --- desired state -----------------------------------------------------------------

    async def _devices(self, client: Client) -> tuple[str, ...]:
        return await self.devices.of(client.client_id)

    async def _manifest_version(self, client: Client, state: ClientState,
                                generation: int) -> int | None:
        """The client's manifestVersion for this state: 1 for the first, +1 whenever the
        served state changes; persisted, so it never goes back (restarts included). None
        when another replica already gave the client a newer generation's state."""
        state_digest = state.state_digest
        current = await self.db.aread(
            lambda conn: records.manifest_version(conn, client.client_id))
        if current is not None and current[0] > 0 and current[1] == state_digest:
            return current[0]
        contents = {d.deployment_id: d.digest for d in state.deployments}
        return await self.db.write(lambda conn: records.advance_manifest_version(
            conn, client.client_id, state_digest, generation, contents))

    async def _still_current(self, client: Client, version: int) -> bool:
        """Whether a cached manifest is still the client's newest. One process knows (its
        cache moves with its compiles); a replica asks the database, since another replica
        may have given the client a newer version from a generation this one has not synced
        yet, and serving the cached one would take the client back."""
        if self.coordinator is None:
            return True
        current = await self.db.aread(
            lambda conn: records.manifest_version(conn, client.client_id))
        return current is not None and current[0] == version

    async def _served_state(self, client: Client) -> tuple[int, Any]:
        """The fleet generation this replica serves and the client's state at it, read
        together (a sync moves the repository under the coordinator's lock, held here only
        while the state is computed from the repository, never across a database read)."""
        devices = await self._devices(client)
        if self.coordinator is None:
            return 0, self.desired.client_state(client.client_id, devices)
        with self.coordinator.lock:
            return (self.coordinator.generation,
                    self.desired.client_state(client.client_id, devices))

    async def _fresh_manifest(self, client: Client, prefix: str) -> tuple[bytes, str]:
        for _ in range(3):
            local = self.desired.generation
            generation, state = await self._served_state(client)
            version = await self._manifest_version(client, state, generation)
            if version is None:  # behind another replica: catch up, then answer
                await run_in_threadpool(self.coordinator.sync)  # type: ignore[union-attr]
                continue
            body = manifest_body(version, state, prefix)
            etag = '"' + digest_of(body) + '"'
            self._manifests[(client.client_id, prefix)] = (local, body, etag, version)
            return body, etag
        raise ProblemError(503, "the fleet's newest desired state is not here yet",
                           retry_after=1)

    async def get_manifest(self, request: Request) -> Response:
        client, prefix = await self.scoped(request)
        if not _accepts(_header(request, b"accept"), MANIFEST_MEDIA_TYPE):
            raise ProblemError(406, f"this server produces {MANIFEST_MEDIA_TYPE}",
                               margo_type="server-cannot-generate-response")
        self.polls.seen(client.client_id)
        key = (client.client_id, prefix)
        cached = self._manifests.get(key)
        if cached is not None and cached[0] == self.desired.generation and \
                await self._still_current(client, cached[3]):
            body, etag = cached[1], cached[2]
        else:
            body, etag = await self._fresh_manifest(client, prefix)
        headers = {"ETag": etag, "Cache-Control": "private"}
        if _etag_matches(_header(request, b"if-none-match"), etag):
            return Response(status_code=304, headers=headers)
        return Response(body, media_type=MANIFEST_MEDIA_TYPE, headers=headers)

    async def get_deployment(self, request: Request) -> Response:
        client, _ = await self.scoped(request)
        deployment_id, digest = request.path_params["deploymentId"], request.path_params["digest"]
        for _ in range(2):
            await self._served_state(client)
            for state in self.desired.recent_states(client.client_id):
                found = state.find(deployment_id, digest)
                if found is not None:
                    return _immutable(request, found.data, "application/yaml", digest)
            if not await self._caught_up():
                break
        devices = await self._devices(client)
        data = await run_in_threadpool(self.desired.find_in_history, devices, deployment_id,
                                       digest)
        if data is not None:  # named by a manifest this replica never computed
            return _immutable(request, data, "application/yaml", digest)
        raise ProblemError(404, f"no deployment {deployment_id} with digest {digest} for this "
                           "client", margo_type="deployment-not-found")

    async def get_bundle(self, request: Request) -> Response:
        client, _ = await self.scoped(request)
        digest = request.path_params["digest"]
        for _ in range(2):
            await self._served_state(client)
            for state in self.desired.recent_states(client.client_id):
                if state.bundle is not None and state.bundle_digest == digest:
                    return _immutable(request, state.bundle, BUNDLE_MEDIA_TYPE, digest)
            if not await self._caught_up():
                break
        raise ProblemError(404, f"no bundle with digest {digest} for this client",
                           margo_type="invalid-bundle")

    async def catch_up(self) -> None:
        """With replicas: serve the newest published generation before answering (the read
        API must not show a device's older state than what another replica served it)."""
        await self._caught_up()

    async def _caught_up(self) -> bool:
        """With replicas: sync to the newest published generation; whether that moved
        anything (a miss may be a manifest another replica served from a newer one)."""
        if self.coordinator is None:
            return False
        return bool(await run_in_threadpool(self.coordinator.sync))

    # --- status ------------------------------------------------------------------------

    async def post_status(self, request: Request) -> Response:
        client, _ = await self.scoped(request)
        doc = await self.json_body(request)
        deployment_id = request.path_params["deploymentId"]
        path_device = request.path_params.get("deviceId")
        if path_device is not None:
            _check_identifier(DEVICE_ID, path_device, "deviceId")
        adopted = doc.get("adoptedManifestVersion")
        if isinstance(adopted, str) and _DECIMAL.fullmatch(adopted):
            # The official conformance kit fills this from a template as a string ("3").
            # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
            doc = {**doc, "adoptedManifestVersion": int(adopted)}
        try:
            status: DeploymentStatus = validate_value(doc, expect=Kind.DEPLOYMENT_STATUS)
        except DocumentError as exc:
            raise semantic_error(exc.problems) from None
        _check_identifier(DEPLOYMENT_ID, status.deployment_id, "deploymentId")
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
            _check_identifier(DEVICE_ID, status.device_id, "deviceId")
        if status.deployment_id != deployment_id:
            raise ProblemError(422, "deploymentId in the body does not match the path",
                               margo_type="semantic-error",
                               errors=[{"field": "deploymentId", "message": "must equal the "
                                        "deploymentId in the path"}])
        named = status.device_id or path_device
        if named is not None and named not in await self._devices(client):
            # Another client's device and an unknown id get the same answer (no oracle for
            # which ids other clients use), and a report is never filed under either.
            raise ProblemError(422, f"deviceId {named!r} is not one of this client's devices",
                               margo_type="semantic-error",
                               errors=[{"field": "deviceId", "message": "not one of this "
                                        "client's devices"}])
        owner = await self._deployment_device(client, deployment_id)
        if owner is None and await self._caught_up():  # assigned in a newer generation
            owner = await self._deployment_device(client, deployment_id)
        if owner is None:
            raise ProblemError(422, f"deployment {deployment_id} was never assigned to this "
                               "client's devices", margo_type="semantic-error")
        device_id = status.device_id or path_device or owner
        applied = await self.attribution.applied(
            client_id=client.client_id, device_id=device_id or owner,
            deployment_id=deployment_id, claim=claim_of(doc))

        def write(conn: Connection) -> records.StatusWrite:
            return records.store_status(
                conn, client_id=client.client_id, deployment_id=deployment_id,
                device_id=device_id, state=str(status.state), document=doc,
                digest=data_digest(doc), adopted=status.adopted_manifest_version,
                applied=applied)

        written = await self.db.write(write)
        if self.lead_times is not None:  # (queues an installed report; never waits)
            self.lead_times.reported(client.client_id, device_id, deployment_id,
                                     str(status.state), doc, applied, written.changed)
        if written.changed and await self._rollout_moving():
            self.compiles.trigger()  # the report may settle a wave or exhaust a budget
        # The status of an assigned deployment exists from its assignment on, so a report
        # updates it: 200 (what the official conformance kit expects); Oct-2024 said 201.
        return Response(status_code=201 if _generation(request) == Shape.OCT_2024 else 200)

    async def _rollout_moving(self) -> bool:
        """Whether a staged rollout moves (read at most every second: asked per status; the
        rollout is also evaluated every `wfm.rollouts.RECHECK_SECONDS` while it moves)."""
        now = time.monotonic()
        if now - self._rollouts_checked > 1:
            self._rollouts_checked = now
            self._rollouts_moving = bool(await self.db.aread(lambda conn: conn.execute(
                "SELECT COUNT(*) FROM rollouts WHERE state LIKE ?",
                ('%"status": "progressing"%',)).fetchone()[0]))
        return self._rollouts_moving

    async def _deployment_device(self, client: Client, deployment_id: str) -> str | None:
        await self._served_state(client)
        for state in self.desired.recent_states(client.client_id):
            for served in state.deployments:
                if served.deployment_id == deployment_id:
                    return served.device_id
        return await self.db.aread(lambda conn: records.status_device(conn, deployment_id,
                                                                      client.client_id))

    # --- rc.2 onboarding and Oct-2024 tokens -------------------------------------------

    async def onboarding_certificate(self, request: Request) -> Response:
        if self.ca_certificate is None:
            raise ProblemError(503, "no CA certificate is configured", retry_after=60)
        encoded = base64.b64encode(self.ca_certificate.encode()).decode()
        return JSONResponse({"certificate": encoded})

    async def onboard(self, request: Request) -> Response:
        """rc.2 onboarding: bind the device certificate's key to a client (400 unreadable,
        403 refused by policy, 201 with the clientId). The same key onboarded again gets its
        existing clientId back, so a device that lost the response can retry."""
        doc = await self.json_body(request)
        try:
            key = onboarding_key(doc)
        except OnboardingError as exc:
            raise ProblemError(exc.status, exc.detail, margo_type="invalid-request"
                               if exc.status == 400 else "not-authorized") from None
        known = self.clients.by_key_id(key.key_id)
        if known is not None and known.client.retired:
            raise ProblemError(403, "the client relationship for this key has been retired",
                               margo_type="not-authorized", title=RETIRED)
        if known is None and self.identity.settings.onboarding != "open":
            raise ProblemError(403, "onboarding of new certificates is closed: the operator "
                               "imports them (`margo clients import ID --cert FILE`)",
                               margo_type="not-authorized")
        client_id = known.client.client_id if known else self.clients.add_key(
            str(uuid.uuid4()), key_id=key.key_id, public_key=key.public_key_pem,
            certificate=key.certificate_pem)
        body = {"clientId": client_id}
        if self.identity.settings.bearer_tokens:  # development: tokens work alongside
            body["token"] = self.clients.add(client_id)[1]
        return JSONResponse(body, status_code=201)

    async def oauth_token(self, request: Request) -> Response:
        form = await request.form()
        client_id, secret = form.get("client_id"), form.get("client_secret")
        pair = parse_basic(request.headers.get("authorization", ""))
        if pair:
            client_id, secret = pair
        if form.get("grant_type") != "client_credentials":
            return JSONResponse({"error": "unsupported_grant_type"}, status_code=400)
        client = (self.clients.by_basic(str(client_id), str(secret))
                  if client_id and secret else None)
        if client is None or client.retired:
            return JSONResponse({"error": "invalid_client"}, status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="margo-gitops"'})
        token, expires = await self.clients.issue_access_token(client)
        return JSONResponse({"access_token": token, "token_type": "Bearer",
                             "expires_in": expires}, headers={"Cache-Control": "no-store"})

    async def device_capabilities(self, request: Request) -> Response:
        """Oct-2024 `POST|PUT /device/{deviceId}/capabilities`."""
        client = await self.authenticate(request)
        doc = await self.json_body(request)
        device_id = request.path_params["deviceId"]
        _check_identifier(DEVICE_ID, device_id, "deviceId")
        await self.report_capabilities(client, device_id, doc)
        return Response(status_code=201)


def _reported_id(doc: dict[str, Any]) -> str:
    """The device id a body names: `properties.id`, or a cluster manifest's `metadata.id`."""
    field = "metadata" if is_cluster_manifest(doc) else "properties"
    section = doc.get(field)
    device_id = section.get("id") if isinstance(section, dict) else None
    if not isinstance(device_id, str):
        raise ProblemError(400, f"{field}.id is required", margo_type="invalid-request")
    return _check_identifier(DEVICE_ID, device_id, f"{field}.id")


#: What a manifest version sent as a string may look like (at most 2^64 - 1: 20 digits).
_DECIMAL = re.compile(r"[0-9]{1,20}")


def _check_identifier(family: IdentifierFamily, value: object, field: str) -> str:
    """`value` if it is a valid name of `family`; otherwise a 422 naming `field` (a path
    parameter such as ``deviceId``, or a body field), before anything is stored: an id the
    store, Git or a device's clone cannot hold must never get as far as a compile. 422, as
    for every other id the schema's pattern refuses, wherever the id was written."""
    problem = family.problem(value)
    if problem is None:
        assert isinstance(value, str)
        return value
    raise ProblemError(422, f"{field} {short_repr(value)}: {problem}",
                       margo_type="semantic-error",
                       errors=[{"field": field, "message": problem}])


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
    cluster_id = _check_identifier(DEVICE_ID, manifest["metadata"]["id"], "metadata.id")
    if cluster_id != device_id:
        raise ProblemError(422, f"metadata.id {cluster_id!r} does not match the deviceId "
                           f"{device_id!r} in the path", margo_type="semantic-error",
                           errors=[{"field": "metadata.id", "message": "must equal the "
                                    "deviceId in the path"}])
    try:
        return device_capabilities_from_cluster(manifest)
    except DocumentError as exc:
        raise semantic_error(exc.problems) from None


def _header(request: Request, name: bytes) -> str | None:
    """One request header (`name` lowercase, as ASGI servers give names), read straight
    from the scope: the per-request calls skip building Starlette's `Headers`."""
    for key, value in request.scope["headers"]:
        if key == name:
            value_text: str = value.decode("latin-1")
            return value_text
    return None


def _generation(request: Request) -> str:
    path = request.scope["path"]  # (not `request.url`: building it costs more than the rest)
    if path.startswith("/device/"):
        return Shape.OCT_2024
    return Shape.RC2 if path.startswith("/api/v1/clients/") else Shape.RC3


def routes(api: Api) -> list[Route]:
    rc2 = "/api/v1/clients/{clientId}"
    return [
        # rc.3; the routes every device calls all the time first (routing tries each in turn)
        Route("/api/v1/deployments", api.get_manifest, methods=["GET"]),
        Route("/api/v1/deployments/{deploymentId}/status", api.post_status, methods=["POST"]),
        Route("/api/v1/capabilities/{deviceId:path}", api.put_capabilities, methods=["PUT"]),
        Route("/api/v1/capabilities/{deviceId:path}", api.delete_capabilities,
              methods=["DELETE"]),
        Route("/api/v1/deployments/{deploymentId}/{digest}", api.get_deployment,
              methods=["GET"]),
        Route("/api/v1/bundles/{digest}", api.get_bundle, methods=["GET"]),
        # rc.2
        Route("/api/v1/onboarding", api.onboard, methods=["POST"]),
        Route("/api/v1/onboarding/certificate", api.onboarding_certificate, methods=["GET"]),
        Route(f"{rc2}/capabilities", api.put_capabilities, methods=["POST", "PUT"]),
        Route(f"{rc2}/capabilities/{{deviceId:path}}", api.put_capabilities,
              methods=["POST", "PUT"]),
        Route(f"{rc2}/capabilities/{{deviceId:path}}", api.delete_capabilities,
              methods=["DELETE"]),
        Route(f"{rc2}/deployments", api.get_manifest, methods=["GET"]),
        Route(f"{rc2}/deployments/{{deploymentId}}/status", api.post_status, methods=["POST"]),
        Route(f"{rc2}/deployment/{{deploymentId}}/status", api.post_status, methods=["POST"]),
        Route(f"{rc2}/deployments/{{deploymentId}}/{{digest}}", api.get_deployment,
              methods=["GET"]),
        Route(f"{rc2}/bundles/{{digest}}", api.get_bundle, methods=["GET"]),
        # Oct-2024 Preview Release 1
        Route("/oauth/token", api.oauth_token, methods=["POST"]),
        Route("/device/{deviceId:path}/capabilities", api.device_capabilities,
              methods=["POST", "PUT"]),
        Route("/device/{deviceId:path}/deployment/{deploymentId}/status", api.post_status,
              methods=["POST"]),
    ]
