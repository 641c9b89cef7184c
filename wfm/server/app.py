"""The fleet server's ASGI application: Margo API, Git hosting, hooks, read API, health
(`/livez` and `/healthz`: liveness; `/readyz`: readiness, as Kubernetes probes expect).

Resources (database, Git store, compile thread) are opened in `lifespan` and closed when
the server stops; domain code raises `ProblemError` and one handler renders every error
as RFC 9457 problem+json, including Starlette's own 404/405 and unexpected exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from compiler.gitstore import REPOSITORY_NAME, DeviceStore
from wfm.admission.bodylimit import DEFAULT_BODY_TIMEOUT, BodyLimit, BodyLimitMiddleware
from wfm.admission.budgets import DEFAULT_BUDGETS, BudgetSettings, Ledger, Trimmer
from wfm.admission.parking import Parking
from wfm.fleet.audit import RETENTION_DAYS, Auditor
from wfm.fleet.compiles import CompileService, SourceConfig
from wfm.fleet.desired import DesiredState
from wfm.fleet.fleetmetrics import CACHE_SECONDS, FleetCollector
from wfm.fleet.freshness import STALE_POLLS
from wfm.fleet.leadtime import LeadTimes
from wfm.fleet.reported import ReportedFleet
from wfm.fleet.rollouts import RolloutController, served_from
from wfm.fleet.sourcecondition import store_condition
from wfm.fleet.sources import RemoteSource, SourceWatcher, fetch_source
from wfm.fleet.waiters import DEFAULT_MAX_WAIT, DEFAULT_MAX_WAITERS, Waiters
from wfm.git.githttp import git_app
from wfm.git.refwaits import RefWaits
from wfm.git.sourcehost import MAX_PUSH_BYTES, ensure_repository, source_app
from wfm.git.upload_gate import MAX_REQUEST_BYTES
from wfm.http.catalog import catalog_routes
from wfm.http.dashboard import dashboard_routes
from wfm.http.device_api import DEFAULT_MAX_DEVICES_PER_CLIENT, Api
from wfm.http.device_routes import DeviceEdge, routes
from wfm.http.fleet_api import FleetApi
from wfm.http.metrics_endpoint import HttpStats, MetricsEndpoint, MetricsMiddleware, RouteMiddleware
from wfm.http.request_parts import MAX_BODY
from wfm.http.webhooks import MAX_BODY_BYTES as MAX_HOOK_BYTES
from wfm.identity.authority import ensure_ca, ensure_shared_ca
from wfm.identity.clients import ClientRegistry
from wfm.identity.oidc import OidcSettings, OidcVerifier
from wfm.identity.operators import OperatorAuth
from wfm.identity.operatorstore import StoreOperators
from wfm.identity.proofs import Identity, IdentitySettings, SignatureMiddleware
from wfm.problems import ProblemError, problem_response
from wfm.server.accesslog import install as install_redaction
from wfm.server.datalock import DataDirLock
from wfm.server.gcpolicy import tune_for_serving
from wfm.store import fleet_rows
from wfm.store.database import Database, DatabaseUnavailable
from wfm.store.opening import is_url, open_database
from wfm.telemetry.tracing import Tracing

if TYPE_CHECKING:
    from compiler.report import CompileReport
    from wfm.fleet.coordination import Coordinator

__all__ = ["GIT_BODY_TIMEOUT", "ServerConfig", "body_limits", "create_app"]

log = logging.getLogger("margo.wfm")


@dataclass(frozen=True)
class ServerConfig:
    data: Path
    source: SourceConfig = field(default_factory=lambda: SourceConfig(None))
    source_url: str | None = None  # a remote fleet source, mirrored into data/source.git
    source_branch: str = "main"
    webhook_secret: str | None = None
    host_source: bool = False  # serve data/hosted-source.git for pushes (operator token)
    watch_source: bool = False
    admin_token: str | None = None
    debounce: float = 0.3
    #: Polling intervals of silence after which a device is `stale` (wfm.fleet.freshness).
    stale_polls: float = STALE_POLLS
    #: How long one computation of the fleet's gauges answers scrapes (wfm.fleet.fleetmetrics).
    metrics_cache_seconds: float = CACHE_SECONDS
    #: The most devices one client may register (None: no limit).
    max_devices_per_client: int | None = DEFAULT_MAX_DEVICES_PER_CLIENT
    #: A `postgresql://` URL: the shared store of several replicas; None: `<data>/wfm.sqlite`.
    database_url: str | None = None
    identity: IdentitySettings = field(default_factory=IdentitySettings)
    #: The data directory's lock, when the caller took it already (`margo serve` does, to
    #: refuse a second server before anything starts); else the server takes it itself.
    data_lock: DataDirLock | None = field(default=None, compare=False)
    #: Seconds a request body may take to arrive after its headers (`wfm.admission.bodylimit`); Git
    #: requests get at least `GIT_BODY_TIMEOUT`, a push being large by nature.
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    #: Bytes of request bodies held at once, per route class and client address
    #: (`wfm.admission.budgets`).
    budgets: BudgetSettings = DEFAULT_BUDGETS
    #: A bearer token that may read `GET /metrics` and nothing else (a scraper's); the
    #: operator token may too. Neither set: `/metrics` is open, as the read API is.
    metrics_token: str | None = None
    #: Where OpenTelemetry spans go (an OTLP/HTTP base URL); None: no tracing.
    otlp_endpoint: str | None = None
    #: Days the audit trail keeps its entries (`wfm.fleet.audit`).
    audit_retention_days: float = RETENTION_DAYS
    #: An OIDC issuer whose tokens prove operators (`wfm.identity.oidc`); None: none.
    oidc: OidcSettings | None = None
    #: Waiting polls (`wfm.fleet.waiters`): the longest a request is held (seconds), and
    #: how many are held at once.
    max_wait: float = DEFAULT_MAX_WAIT
    max_waiters: int = DEFAULT_MAX_WAITERS

    @property
    def remote(self) -> RemoteSource | None:
        if self.source_url is None:
            return None
        return RemoteSource(self.source_url, self.source_branch, self.data / "source.git")

    @property
    def hosted_source(self) -> Path:
        return self.data / "hosted-source.git"

    @property
    def effective_source(self) -> SourceConfig:
        remote = self.remote
        if remote:
            return SourceConfig(remote.mirror, remote.ref)
        if self.host_source:
            return SourceConfig(self.hosted_source, f"refs/heads/{self.source_branch}")
        return self.source

    @property
    def repos(self) -> Path:
        return self.data / "repos"

    @property
    def database(self) -> Path | str:
        return self.database_url or self.data / "wfm.sqlite"


def _problem_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProblemError)
    return problem_response(exc, instance=request.url.path)


def _http_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return problem_response(ProblemError(exc.status_code, str(exc.detail),
                                         headers=dict(exc.headers or {})),
                            instance=request.url.path)


def _unavailable_handler(request: Request, exc: Exception) -> Response:
    log.warning("%s: %s", request.url.path, exc)
    return problem_response(ProblemError(503, "the fleet server's database is unavailable; "
                                         "nothing was stored, retry later", retry_after=5),
                            instance=request.url.path)


def _gone_handler(request: Request, exc: Exception) -> Response:
    """A client that went away before its body was complete: expected on the Internet, so
    one line, no traceback (there were 47 per disconnect); nobody receives the answer."""
    log.info("%s %s: the client disconnected before its request body was complete",
             request.method, request.url.path)
    return problem_response(ProblemError(400, "the client disconnected before its request "
                                         "body was complete"), instance=request.url.path)


def _crash_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return problem_response(ProblemError(500, "internal error; the server log has details",
                                         retry_after=5), instance=request.url.path)


def _health(request: Request, reason: str | None) -> Response:
    if reason is None:
        return JSONResponse({"status": "ok"})
    return problem_response(ProblemError(503, reason, retry_after=5),
                            instance=request.url.path)


def _database(request: Request) -> Database | None:
    api = getattr(request.app.state, "api", None)
    return getattr(api, "db", None)


async def _livez(request: Request) -> Response:
    """Liveness (`/livez`, and `/healthz` as before): the process answers and its database
    writer runs. Not whether the store can be reached: restarting a server because its
    database is away (or locked by a backup) would only cost its caches."""
    db = _database(request)
    return _health(request, None if db is None or db.alive()
                   else db.readiness() or "the database writer stopped")


async def _readyz(request: Request) -> Response:
    """Readiness (`/readyz`): durable writes can be taken now, and the fleet's desired state
    can be compiled. 503 problem while the writer is stopped or stuck, or after a write was
    refused as unavailable until the store takes a write again (a quick probe, in a worker
    thread: it may wait a moment for a lock), and while this server's compiles keep failing
    (`wfm.fleet.compiles.CompileService.unready`)."""
    db = _database(request)
    if db is None:
        return _health(request, "the server is starting")
    reason = await run_in_threadpool(db.readiness)
    if reason is None:
        reason = request.app.state.api.compiles.unready
    return _health(request, reason)


class _Late:
    """A metric source that exists once the server has started (its database does)."""

    def __init__(self) -> None:
        self.source: FleetCollector | None = None
        self.lead: LeadTimes | None = None

    def __call__(self) -> Iterator[Any]:
        return iter(()) if self.source is None else self.source()


def create_app(config: ServerConfig) -> Starlette:
    """The server app; its resources open when it starts and close when it stops."""
    install_redaction()  # `/?token=` never reaches uvicorn's access log (wfm.server.accesslog)
    api = Api()
    edge = DeviceEdge(api)
    stats, late = HttpStats(), _Late()
    operators = StoreOperators()
    oidc = OidcVerifier(config.oidc) if config.oidc is not None else None
    auth = operator_auth(config, operators, oidc)
    metrics = MetricsEndpoint(stats, late, tokens=(config.metrics_token,), auth=auth)
    api.max_devices = config.max_devices_per_client
    api.waiters, api.max_wait = Waiters(config.max_waiters), config.max_wait
    identity = Identity(config.identity)
    fleet = FleetApi(api, source=config.effective_source, admin_token=config.admin_token,
                     remote=config.remote, webhook_secret=config.webhook_secret,
                     source_kind=_source_kind(config), stale_polls=config.stale_polls,
                     auth=auth, audit=Auditor(config.audit_retention_days))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        running = _start(config, api, identity, fleet, late)
        operators.open(running.db)
        if oidc is not None:
            oidc.start()
        app.state.api = api
        watch = asyncio.ensure_future(api.watch_credentials())
        try:
            yield
        finally:
            watch.cancel()
            api.waiters.close()  # (`wfm.server.serving` did, before the connections closed)
            if oidc is not None:
                oidc.stop()
            running.stop()

    app = Starlette(
        routes=_routes(config, edge, fleet, metrics, late),
        lifespan=lifespan,
        # Requests are counted outermost (refusals too, and a held request once, over its
        # whole time); held requests wait outside the rest of the stack and are answered
        # from there (`wfm.admission.parking`); then body limits and budgets: nothing below
        # (signature checks buffer bodies) sees more.
        middleware=[Middleware(MetricsMiddleware, stats=stats),
                    Middleware(Parking),
                    Middleware(BodyLimitMiddleware, rules=body_limits(config),
                               ledger=Ledger(config.budgets, Trimmer())),
                    Middleware(SignatureMiddleware, identity=identity),
                    Middleware(RouteMiddleware)],
        exception_handlers={ProblemError: _problem_handler, HTTPException: _http_handler,
                            DatabaseUnavailable: _unavailable_handler,
                            ClientDisconnect: _gone_handler, Exception: _crash_handler},
    )
    #: What `margo serve` releases first when it stops (`wfm.server.serving`).
    app.state.waiters = api.waiters
    return app


def operator_auth(config: ServerConfig, operators: StoreOperators,
                  oidc: OidcVerifier | None = None) -> OperatorAuth:
    """Who may do what: the admin token, the store's operators, and the OIDC issuer's
    tokens when one is configured. Open until one of them exists (an operator registered
    while the server runs closes it within a second)."""
    lookups: tuple[Any, ...] = (operators,) if oidc is None else (operators, oidc)
    fixed = config.admin_token is not None or oidc is not None
    return OperatorAuth(admin_token=config.admin_token, lookups=lookups,
                        configured=lambda: fixed or operators.registered())


def _routes(config: ServerConfig, edge: DeviceEdge, fleet: FleetApi,
            metrics: MetricsEndpoint, late: _Late) -> list[BaseRoute]:
    """Every route of the server: the device API, health, metrics, the read API and the
    dashboard, the hosted source (when asked for) and Git hosting of the device branches."""
    api = edge.api

    def pushed(arrived: float) -> None:
        if late.lead is not None:
            late.lead.received("push", arrived)
        api.compiles.trigger(settle=False)  # one event: no burst to wait for

    hosted: list[BaseRoute] = [Mount("/git/source.git", app=source_app(
        config.hosted_source, fleet.auth, pushed, replicas=lambda: api.coordinator,
        audit=fleet.audit))] if config.host_source else []
    return [*routes(edge), Route("/healthz", _livez, methods=["GET"]),
            Route("/livez", _livez, methods=["GET"]),
            Route("/readyz", _readyz, methods=["GET"]),
            Route("/metrics", metrics.serve, methods=["GET"]), *fleet.routes(),
            *catalog_routes(fleet),
            *dashboard_routes(fleet), *hosted,
            Mount("/git", app=git_app(config.repos / REPOSITORY_NAME,
                                      edge.callers.may_fetch, lost=api.lost_branch,
                                      delivered=api.git_delivered,
                                      waits=RefWaits(api.waiters, max_wait=config.max_wait,
                                                     epoch=lambda: api.credentials.epoch)))]


@dataclass
class _Running:
    """What a started server holds, closed in the reverse order of opening."""

    config: ServerConfig
    api: Api
    lock: DataDirLock
    db: Database
    coordinator: Coordinator | None
    compiles: CompileService
    lead: LeadTimes
    tracing: Tracing
    watcher: SourceWatcher | None = None

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        self.compiles.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
        self.lead.stop()
        self.tracing.close()
        self.api.polls.flush()
        self.api.attribution.handouts.flush()
        self.db.close()
        if self.config.data_lock is None:
            self.lock.release()


def _start(config: ServerConfig, api: Api, identity: Identity, fleet: FleetApi,
           late: _Late) -> _Running:
    """Open the server's resources (data lock, store, fleet control, identity) and start
    compiling; what is open is returned, to be stopped when the server stops."""
    config.data.mkdir(parents=True, exist_ok=True)
    lock = config.data_lock or DataDirLock(config.data)
    if not lock.held:
        lock.acquire()  # DataDirBusy: another server runs on this directory
    lock.record(store="postgresql" if is_url(config.database) else "sqlite")
    db = open_database(config.database)
    if config.host_source:
        ensure_repository(config.hosted_source, config.source_branch)
    coordinator = _coordinator(db, config)
    desired, compiles, lead, tracing = _fleet_control(config, api, db, coordinator)
    running = _Running(config, api, lock, db, coordinator, compiles, lead, tracing)
    ca = ensure_ca(config.data / "ca") if coordinator is None else ensure_shared_ca(db)
    api.open(db=db, clients=ClientRegistry(db), desired=desired, compiles=compiles,
             ca_certificate=ca, identity=identity, coordinator=coordinator)
    api.lead_times = fleet.lead = late.lead = lead
    fleet.audit.open(db, replica=coordinator.name if coordinator is not None else None)
    late.source = FleetCollector(db, desired, stale_polls=config.stale_polls,
                                 coordinator=coordinator,
                                 cache_seconds=config.metrics_cache_seconds,
                                 polls=api.polls)
    if coordinator is not None:
        coordinator.on_synced = lambda moved: _published(desired, api.waiters, moved)
        api.waiters.owners = lambda ids: db.aread(lambda c: fleet_rows.device_owners(c, ids))
        coordinator.start()
    tune_for_serving()  # few collections, none over what start-up built (wfm.server.gcpolicy)
    if config.watch_source and config.source.path is not None:
        running.watcher = SourceWatcher(config.source.path, compiles.trigger)
    if config.remote is not None:
        threading.Thread(target=_initial_fetch, args=(config.remote, compiles,
                                                      coordinator), daemon=True).start()
    else:
        compiles.trigger()
    return running


def _fleet_control(config: ServerConfig, api: Api, db: Database,
                   coordinator: Coordinator | None
                   ) -> tuple[DesiredState, CompileService, LeadTimes, Tracing]:
    """The desired state served, the compile service (with its rollouts) and the lead
    times with their traces, on the opened store."""
    desired = DesiredState(DeviceStore(config.repos)) if coordinator is None else \
        DesiredState(DeviceStore(config.repos), recorded=coordinator.published_branch,
                     on_lost=coordinator.request_repair)
    rollouts = RolloutController(db, served_from(desired, db))
    tracing = Tracing(config.otlp_endpoint,
                      instance=coordinator.name if coordinator is not None else None)
    lead = LeadTimes(db, desired, tracing,
                     handout=lambda device_id: api.attribution.handouts.when(device_id),
                     catch_up=coordinator.sync if coordinator is not None else None,
                     recheck=coordinator is not None)
    compiles = CompileService(
        config.repos, config.effective_source, ReportedFleet(db.read).snapshot,
        (lambda report: _published(desired, api.waiters, _committed(report)))
        if coordinator is None else (lambda report: None),
        debounce=config.debounce, coordinator=coordinator,
        on_condition=lambda condition: db.submit(
            lambda conn: store_condition(conn, condition)), rollouts=rollouts,
        lead_times=lead, quiet=api.quiet)
    return desired, compiles, lead, tracing


def _published(desired: DesiredState, waiters: Waiters, moved: Iterable[str]) -> None:
    """New desired state is served (a compile here, or a replica's sync): recompute on
    demand, and wake the waiting polls of the devices whose branches moved."""
    desired.bump()
    waiters.wake_devices(moved)


def _committed(report: CompileReport | None) -> list[str]:
    """The devices a compile committed to."""
    return [] if report is None else [r.device_id for r in report.results
                                      if r.status == "committed"]


#: The shortest deadline for a Git request's body: a 64 MiB push at 256 KiB/s.
GIT_BODY_TIMEOUT = 300.0


def body_limits(config: ServerConfig) -> list[BodyLimit]:
    """Per path, the largest body, how long it may take to arrive
    (`wfm.admission.bodylimit`) and whose budget it counts against (`wfm.admission.budgets`):
    each route's own limit, enforced before its handler buffers anything. Onboarding and
    OAuth tokens read their bodies before anyone is authenticated; the rest of the device
    API counts as authenticated once a handler vouched for the caller."""
    git, body = max(config.body_timeout, GIT_BODY_TIMEOUT), config.body_timeout
    return [BodyLimit("/git/source.git/", MAX_PUSH_BYTES, git, "push"),
            BodyLimit("/git/", MAX_REQUEST_BYTES, git, "git"),
            BodyLimit("/hooks/git", MAX_HOOK_BYTES, body, "webhook"),
            BodyLimit("/api/v1/onboarding", MAX_BODY, body, "anonymous"),
            BodyLimit("/oauth/token", MAX_BODY, body, "anonymous"),
            BodyLimit("", MAX_BODY, body, "device")]


def _source_kind(config: ServerConfig) -> str:
    if config.remote is not None:
        return "mirrored"
    if config.host_source:
        return "hosted"
    return "directory" if config.source.path is not None else "none"


def _coordinator(db: Database, config: ServerConfig) -> Coordinator | None:
    """Replicas coordinate through PostgreSQL; a single SQLite server needs nothing."""
    if db.dialect != "postgresql":
        return None
    from wfm.fleet.coordination import Coordinator

    source = (config.hosted_source if config.host_source
              else config.remote.mirror if config.remote is not None else None)
    return Coordinator(db, config.data, source_repo=source)  # type: ignore[arg-type]


def _initial_fetch(remote: RemoteSource, compiles: CompileService,
                   coordinator: Coordinator | None) -> None:
    """At start, in a thread of its own: whatever the fetch raises, compile what the mirror
    holds (a thread that died here would leave the server without desired state)."""
    try:
        fetch_source(remote, coordinator)
    except (RuntimeError, OSError) as exc:
        log.error("initial fetch of the fleet source failed: %s", exc)
    except Exception:
        log.exception("initial fetch of the fleet source failed")
    compiles.trigger()

