"""The device API in its three generations, one behaviour: what its surfaces share.

rc.3 (`/api/v1/...`), rc.2 (`/api/v1/clients/{clientId}/...` plus onboarding) and the
Oct-2024 Preview Release 1 (`/device/{deviceId}/...` plus the OAuth2 token endpoint) all
land in the same handlers; only status codes and path shapes differ where the generations
differ (rc.3 capabilities answer 201 created / 200 updated, rc.2 and Oct-2024 always 201).
The caller is always the authenticated client, and every resource is scoped to it.

`Api` holds the resources every surface uses (the store, the client registry, the served
desired state, the compile trigger, replicas' coordination) and the reads they share: a
client's devices and its state at the generation this replica serves. The surfaces
themselves (`wfm.http.callers`, `.capabilities`, `.statuses`, `.manifests`,
`.onboarding`) are bound to routes by `wfm.http.device_routes`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

from starlette.concurrency import run_in_threadpool

from wfm.fleet.attribution import Attribution
from wfm.fleet.clientdevices import ClientDevices
from wfm.fleet.compiles import CompileService
from wfm.fleet.desired import DesiredState
from wfm.fleet.lastseen import PollClock
from wfm.fleet.waiters import DEFAULT_MAX_WAIT, Waiters
from wfm.identity.clients import Client, ClientRegistry
from wfm.identity.credentialcache import CredentialCache, watch_epoch
from wfm.identity.proofs import Identity, IdentitySettings
from wfm.problems import ProblemError
from wfm.store import records
from wfm.store.database import Database

if TYPE_CHECKING:  # psycopg loads only where PostgreSQL is used
    from wfm.fleet.coordination import Coordinator
    from wfm.fleet.leadtime import LeadTimes

__all__ = ["DEFAULT_MAX_DEVICES_PER_CLIENT", "Api", "ServedManifest"]

#: The most devices one client may hold unless `margo serve --max-devices-per-client` says
#: otherwise: far above a site's gateway, far below what fills a disk with histories.
DEFAULT_MAX_DEVICES_PER_CLIENT = 100_000
#: How many times `Api.served_state` reads a client's device list for the generation it
#: serves before it answers 503 (the generation moved after every read).
_STATE_READS = 3
#: Clients whose device lists a replica remembers at once (`Api.served_state`); past it,
#: all are forgotten and read again.
_MAX_DEVICE_LISTS = 200_000


class ServedManifest(NamedTuple):
    """The manifest a client was last served through one URL prefix (`wfm.http.manifests`):
    at which local generation, its bytes and ETag, its manifestVersion and the digest of
    the state it describes."""

    generation: int
    body: bytes
    etag: str
    version: int
    state_digest: str


class Api:
    """The device API's resources; routes are bound when the app is built, resources when
    it starts (`open`)."""

    db: Database
    clients: ClientRegistry
    desired: DesiredState
    compiles: CompileService
    ca_certificate: str | None = None  # PEM, served to rc.2 onboarding
    #: The most devices one client may hold (None: no limit); `margo serve
    #: --max-devices-per-client`.
    max_devices: int | None = None
    identity: Identity
    coordinator: Coordinator | None = None  # replicas on PostgreSQL (wfm.fleet.coordination)
    lead_times: LeadTimes | None = None  # told of each stored status (wfm.fleet.leadtime)
    #: Waiting polls (`wfm.fleet.waiters`): the requests held, and the longest hold
    #: (`margo serve --max-waiters`, `--max-wait`); replaced when the app is built.
    waiters: Waiters = Waiters()
    max_wait: float = DEFAULT_MAX_WAIT
    #: When a status report was last stored (time.monotonic()): while devices take up a
    #: change they report, and the server puts off work that holds the interpreter
    #: (`Api.quiet`).
    last_status_at: float = float("-inf")

    def quiet(self, seconds: float = 1.0) -> bool:
        """Whether no status report was stored in the last `seconds`."""
        return time.monotonic() - self.last_status_at >= seconds

    def open(self, *, db: Database, clients: ClientRegistry, desired: DesiredState,
             compiles: CompileService, ca_certificate: str | None = None,
             identity: Identity | None = None, coordinator: Coordinator | None = None) -> None:
        self.db, self.clients, self.desired, self.compiles = db, clients, desired, compiles
        self.coordinator = coordinator
        self.ca_certificate = ca_certificate
        self.identity = identity or Identity(IdentitySettings())
        self.identity.open(clients)
        #: Polls dominate the traffic: per (client, URL prefix), the manifest served at a
        #: generation (`wfm.http.manifests`).
        self.served_manifests: dict[tuple[str, str], ServedManifest] = {}
        # A retired client or a replaced token wakes the polls held meanwhile, which are
        # then refused as a poll arriving now would be (`Callers.admission`).
        self.credentials = CredentialCache(
            lambda: db.offload(clients.credentials_epoch, periodic=True),
            lambda token: db.offload(clients.token_lookup, token),
            on_change=lambda: self.waiters.wake_all())
        self.devices = ClientDevices(db, sole_writer=coordinator is None,
                                     on_change=lambda c: self.waiters.wake_clients((c,)))
        #: Replicas: per client, its devices at the generation served (`served_devices`).
        self._devices_at: dict[str, tuple[int, tuple[str, ...]]] = {}
        self.polls = PollClock(db)
        self.attribution = Attribution(db, desired.deployments_at,
                                       sole_writer=coordinator is None)

    async def watch_credentials(self) -> None:
        """While polls are held, read the credentials epoch every second, so that a client
        retired or a token replaced meanwhile (by any process) wakes them (`on_change`)
        even when no request arrives (`wfm.identity.credentialcache.watch_epoch`). Runs
        until cancelled."""
        await watch_epoch(self.credentials, lambda: len(self.waiters) > 0)

    # --- for Git hosting ---------------------------------------------------------------

    def git_delivered(self, device_id: str, commit: str) -> None:
        """Git hosting handed the device its branch at `commit`: its reports that name no
        adopted state are about that commit from now on (`wfm.fleet.attribution`)."""
        self.attribution.handouts.delivered(device_id, commit)

    def lost_branch(self, device_id: str) -> str | None:
        """Git hosting, for a device without a branch in the served repository: why that is
        lost state, as the REST manifest would say it (None: no desired state yet)."""
        lost = self.desired.missing_branch(device_id)
        return None if lost is None else lost.detail

    # --- shared reads ------------------------------------------------------------------

    def client_polls(self) -> dict[str, tuple[float | None, float | None]]:
        """Every client's last poll and polling interval: as stored, brought up to date
        with this process's polls not written yet (`PollClock.up_to_date`)."""
        return self.polls.up_to_date(self.db.read(records.client_polls))

    async def devices_of(self, client: Client) -> tuple[str, ...]:
        return await self.devices.of(client.client_id)

    async def served_devices(self, client: Client) -> tuple[str, ...]:
        """The client's devices as its served state is made of them
        (`_devices_at_generation`)."""
        return (await self._devices_at_generation(client))[1]

    async def _devices_at_generation(self, client: Client) -> tuple[int, tuple[str, ...]]:
        """The client's devices, and the generation they were read for. One server: its
        devices (remembered until they change), generation 0. Replicas: read once per
        generation served, not on every poll. Safe because a device contributes to the
        state only through a branch, and branches move only with a generation: one
        registered on another replica meanwhile has none here until a sync brings it (and a
        new read), and a deletion is itself a generation
        (`wfm.fleet.deletions.publish_deletion`); a state made without a device whose
        id was deleted and registered again is refused by the manifest versions'
        generation guard (`Coordinator.registered`)."""
        if self.coordinator is None:
            return 0, await self.devices_of(client)
        generation = self.coordinator.generation
        known = self._devices_at.get(client.client_id)
        if known is not None and known[0] == generation:
            return known
        devices = await self.devices_of(client)
        if len(self._devices_at) >= _MAX_DEVICE_LISTS:
            self._devices_at.clear()
        self._devices_at[client.client_id] = (generation, devices)
        return generation, devices

    async def served_state(self, client: Client) -> tuple[int, Any]:
        """The fleet generation this replica serves and the client's state at it, read
        together (a sync moves the repository under the coordinator's lock, held here only
        while the state is computed from the repository, never across a database read).

        The device list must belong to that generation too: a list read before a sync
        that brought a newly registered device's first branch lacks the device, and a
        state made from it, labelled with the newer generation, would pass the manifest
        versions' generation guard and hand the client its older (empty) state under a
        newer version. So a list read for an older generation is read again. Neither
        generation is a true label for a list of one and branches of the other (the older
        one, recorded, would let a replica still at it hand out older branches under a
        newer version), so a sync after every read (replicas publishing without pause) is
        answered 503 with Retry-After."""
        if self.coordinator is None:
            return 0, self.desired.client_state(client.client_id,
                                                await self.devices_of(client))
        for _ in range(_STATE_READS):
            listed, devices = await self._devices_at_generation(client)
            with self.coordinator.lock:
                generation = self.coordinator.generation
                if generation == listed:
                    return generation, self.desired.client_state(client.client_id, devices)
        raise ProblemError(503, "the fleet's desired state kept moving while it was read",
                           retry_after=1)

    async def catch_up(self) -> None:
        """With replicas: serve the newest published generation before answering (the read
        API must not show a device's older state than what another replica served it)."""
        await self.caught_up()

    async def caught_up(self) -> bool:
        """With replicas: sync to the newest published generation; whether that moved
        anything (a miss may be a manifest another replica served from a newer one)."""
        if self.coordinator is None:
            return False
        return bool(await run_in_threadpool(self.coordinator.sync))
