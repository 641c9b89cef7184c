"""Desired state for devices: the client's manifest, each deployment's document and the
bundle, as the device API serves them.

The manifest's `manifestVersion` is 1 for a client's first state and grows by one whenever
the served state changes; it is persisted, so it never goes back (restarts and replicas
included). Documents and bundles are addressed by digest, so they are immutable.
"""

from __future__ import annotations

from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from margo.digests import digest_of
from wfm.admission.parking import raise_parked_failure
from wfm.fleet.desired import BUNDLE_MEDIA_TYPE, ClientState, manifest_body
from wfm.http.callers import Callers
from wfm.http.device_api import Api, ServedManifest
from wfm.http.httpcache import accepts, etag_matches, immutable
from wfm.http.manifest_waits import MANIFEST_MEDIA_TYPE, manifest_answer
from wfm.http.request_parts import header
from wfm.identity.clients import Client
from wfm.problems import ProblemError
from wfm.store import records

__all__ = ["MANIFEST_MEDIA_TYPE", "Manifests"]


class Manifests:
    """`GET .../deployments`, `.../deployments/{id}/{digest}` and `.../bundles/{digest}`."""

    def __init__(self, api: Api, callers: Callers) -> None:
        self.api, self.callers = api, callers

    async def get_manifest(self, request: Request) -> Response:
        raise_parked_failure(request.scope)  # a held poll whose hold failed, back here
        client, prefix = await self.callers.scoped(request)
        if not accepts(header(request, b"accept"), MANIFEST_MEDIA_TYPE):
            raise ProblemError(406, f"this server produces {MANIFEST_MEDIA_TYPE}",
                               margo_type="server-cannot-generate-response")
        self.api.polls.seen(client.client_id)
        since = self.api.waiters.mark()  # a waiting poll wakes for what comes after this
        condition = header(request, b"if-none-match")
        body, etag = await self._manifest(client, prefix, condition)
        return await manifest_answer(
            request, self.api, client, since=since, condition=condition, body=body,
            etag=etag, current=partial(self._manifest, client, prefix, condition),
            admission=self.callers.admission)

    async def _manifest(self, client: Client, prefix: str,
                        condition: str | None) -> tuple[bytes, str]:
        """The client's manifest and its ETag: the one served at this generation, else a
        fresh one. A cached one the client already holds (`condition`) is answered without
        asking the database whether it is still the newest (`_still_current`): telling a
        client it is current while another replica has a newer version for it is what an
        earlier poll would have told it, while handing it an older one would not be. A
        replica does so only while it reaches the database (`Coordinator.database_reached`):
        one cut off from it hears no news and would tell its devices "unchanged" forever,
        where it must answer 503 so that they turn to another replica
        (tests/reconciler/test_device_failover.py)."""
        cached = self.api.served_manifests.get((client.client_id, prefix))
        coordinator = self.api.coordinator
        from_memory = coordinator is None or coordinator.database_reached
        if cached is not None and cached.generation == self.api.desired.generation and (
                (from_memory and etag_matches(condition, cached.etag))
                or await self._still_current(client, cached.version)):
            return cached.body, cached.etag
        return await self._fresh_manifest(client, prefix, cached)

    async def get_deployment(self, request: Request) -> Response:
        client, _ = await self.callers.scoped(request)
        deployment_id, digest = request.path_params["deploymentId"], request.path_params["digest"]
        for _ in range(2):
            await self.api.served_state(client)
            for state in self.api.desired.recent_states(client.client_id):
                found = state.find(deployment_id, digest)
                if found is not None:
                    return immutable(request, found.data, "application/yaml", digest)
            if not await self.api.caught_up():
                break
        devices = await self.api.devices_of(client)
        data = await run_in_threadpool(self.api.desired.find_in_history, devices,
                                       deployment_id, digest)
        if data is not None:  # named by a manifest this replica never computed
            return immutable(request, data, "application/yaml", digest)
        raise ProblemError(404, f"no deployment {deployment_id} with digest {digest} for this "
                           "client", margo_type="deployment-not-found")

    async def get_bundle(self, request: Request) -> Response:
        client, _ = await self.callers.scoped(request)
        digest = request.path_params["digest"]
        for _ in range(2):
            await self.api.served_state(client)
            for state in self.api.desired.recent_states(client.client_id):
                if state.bundle is not None and state.bundle_digest == digest:
                    return immutable(request, state.bundle, BUNDLE_MEDIA_TYPE, digest)
            if not await self.api.caught_up():
                break
        raise ProblemError(404, f"no bundle with digest {digest} for this client",
                           margo_type="invalid-bundle")

    async def _manifest_version(self, client: Client, state: ClientState, generation: int,
                                served: ServedManifest | None) -> int | None:
        """The client's manifestVersion for this state: 1 for the first, +1 whenever the
        served state changes; persisted, so it never goes back (restarts included). None
        when another replica already gave the client a newer generation's state.

        The version is read first, and written only when the state changed; unless this
        process `served` the client another state already: then it changed (or another
        replica moved the version to this state, which the write finds and keeps), and the
        read would be a round trip for nothing on every device a change reaches. What the
        version holds is handed to `Attribution`, which the device's status reports about
        it ask next."""
        state_digest = state.state_digest
        if served is None or served.state_digest == state_digest:
            current = await self.api.db.aread(
                lambda conn: records.manifest_version(conn, client.client_id))
            if current is not None and current[0] > 0 and current[1] == state_digest:
                return current[0]
        contents = {d.deployment_id: d.digest for d in state.deployments}
        version = await self.api.db.write(lambda conn: records.advance_manifest_version(
            conn, client.client_id, state_digest, generation, contents))
        if version is not None:
            self.api.attribution.remember(client.client_id, version, contents)
        return version

    async def _still_current(self, client: Client, version: int) -> bool:
        """Whether a cached manifest is still the client's newest. One process knows (its
        cache moves with its compiles); a replica asks the database, since another replica
        may have given the client a newer version from a generation this one has not synced
        yet, and serving the cached one would take the client back."""
        if self.api.coordinator is None:
            return True
        current = await self.api.db.aread(
            lambda conn: records.manifest_version(conn, client.client_id))
        return current is not None and current[0] == version

    async def _fresh_manifest(self, client: Client, prefix: str,
                              served: ServedManifest | None) -> tuple[bytes, str]:
        for _ in range(3):
            local = self.api.desired.generation
            generation, state = await self.api.served_state(client)
            version = await self._manifest_version(client, state, generation, served)
            if version is None:  # behind another replica: catch up, then answer
                await run_in_threadpool(self.api.coordinator.sync)  # type: ignore[union-attr]
                continue
            body = manifest_body(version, state, prefix)
            etag = '"' + digest_of(body) + '"'
            self.api.served_manifests[(client.client_id, prefix)] = ServedManifest(
                local, body, etag, version, state.state_digest)
            return body, etag
        raise ProblemError(503, "the fleet's newest desired state is not here yet",
                           retry_after=1)
