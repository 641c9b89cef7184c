"""The fleet server's ASGI application: Margo API, Git hosting, hooks, read API, health.

Resources (database, Git store, compile thread) are opened in `lifespan` and closed when
the server stops; domain code raises `ProblemError` and one handler renders every error
as RFC 9457 problem+json, including Starlette's own 404/405 and unexpected exceptions.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from compiler.gitstore import DeviceStore
from wfm import records
from wfm.api import Api, routes
from wfm.clients import ClientRegistry
from wfm.compiles import CompileService, SourceConfig
from wfm.db import Database
from wfm.desired import DesiredState
from wfm.problems import ProblemError, problem_response

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger("margo.wfm")


@dataclass(frozen=True)
class ServerConfig:
    data: Path
    source: SourceConfig = field(default_factory=lambda: SourceConfig(None))
    webhook_secret: str | None = None
    debounce: float = 0.3

    @property
    def repos(self) -> Path:
        return self.data / "repos"

    @property
    def database(self) -> Path:
        return self.data / "wfm.sqlite"


def _problem_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProblemError)
    return problem_response(exc, instance=request.url.path)


def _http_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return problem_response(ProblemError(exc.status_code, str(exc.detail),
                                         headers=dict(exc.headers or {})),
                            instance=request.url.path)


def _crash_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return problem_response(ProblemError(500, "internal error; the server log has details",
                                         retry_after=5), instance=request.url.path)


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def create_app(config: ServerConfig) -> Starlette:
    """The server app; its resources open when it starts and close when it stops."""
    api = Api()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        config.data.mkdir(parents=True, exist_ok=True)
        db = Database(config.database)
        desired = DesiredState(DeviceStore(config.repos))
        compiles = CompileService(config.repos, config.source,
                                  lambda: db.read(records.device_documents),
                                  lambda report: desired.bump(), debounce=config.debounce)
        api.open(db=db, clients=ClientRegistry(db), desired=desired, compiles=compiles)
        app.state.api = api
        compiles.trigger()
        try:
            yield
        finally:
            compiles.stop()
            db.close()

    return Starlette(
        routes=[Route("/healthz", _healthz, methods=["GET"]), *routes(api)],
        lifespan=lifespan,
        exception_handlers={ProblemError: _problem_handler, HTTPException: _http_handler,
                            Exception: _crash_handler},
    )
