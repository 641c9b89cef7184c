"""Run the real `margo serve` in a subprocess on loopback, and check what it answers
against the official OpenAPI documents.

`STORE` says which server the kits start: `sqlite` (one process, the embedded default) or
`replicas` (two processes on one PostgreSQL database, each with its own data directory,
behind a round-robin balancer that sends each request to the next one). The suites that
must pass on both set it per module (`use_store`); `MARGO_TEST_STORE` sets the default.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from compiler.gitstore import REPOSITORY_NAME
from kits.balancer import balancing
from kits.pgkit import database_for
from kits.processkit import free_port
from margo.kinds import detect
from margo.loading import load_document
from margo.schemas import validator_for
from margo_cli.main import main as cli_main
from tools.margoserver import running_margo
from tools.polling import poll_until

ROOT = Path(__file__).resolve().parents[2]
OPENAPI = {
    "rc.3": "workload-management-api-1.0.0-rc.3.yaml",
    "rc.2": "workload-management-api-1.0.0-rc.2.yaml",
}
#: Verbatim copies of the official OpenAPI documents.
OPENAPI_DIRS = [ROOT / "tests" / "fixtures" / "openapi"]


#: "sqlite" or "replicas" (see the module docstring).
STORE = [os.environ.get("MARGO_TEST_STORE", "sqlite")]
REPLICAS = 2
#: The servers' log level (their logs are `server-<port>.log` next to the data directory).
LOG_LEVEL = os.environ.get("MARGO_TEST_SERVER_LOG_LEVEL", "warning")


@contextlib.contextmanager
def use_store(store: str) -> Iterator[None]:
    """Start servers on `store` inside the block."""
    before, STORE[0] = STORE[0], store
    try:
        yield
    finally:
        STORE[0] = before


def store_args(data: Path) -> list[str]:
    """The options that put a data directory's server on the current store."""
    return ["--database", database_for(data)] if STORE[0] == "replicas" else []


def access_token(data: Path, client_id: str, lifetime: float) -> str:
    """A new access token (the kind `/oauth/token` hands out) for `client_id`, expiring in
    `lifetime` seconds, written to the store of the server(s) of `data` beside them."""
    from wfm.identity.clients import token_hash
    from wfm.store.client_rows import store_access_token
    from wfm.store.opening import open_database

    token = "short-lived-" + secrets.token_urlsafe(16)
    db = open_database(database_for(data) if store_args(data) else data / "wfm.sqlite")
    try:
        db.write_sync(lambda conn: store_access_token(
            conn, token_hash(token), client_id, time.time() + lifetime, time.time()))
    finally:
        db.close()
    return token


def margo(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "margo_cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, check=check, timeout=60)


def add_client(data: Path, client_id: str, *, reactivate: bool = False) -> str:
    """`margo clients add` (with `--reactivate`: a retired client accepted again); the
    client's new token. The command's own code (`margo_cli.main.main`), run in this
    process: here it is a test's set-up, not its subject (tests/wfm/test_identity_commands.py
    tests the command; test_replica_failover.py and others run it as a process), and a new
    interpreter importing the CLI costs a third of a second on every call."""
    args = ["clients", "add", client_id, "--data", str(data), "--json",
            *(["--reactivate"] if reactivate else []), *store_args(data)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(args)
    assert code == 0, f"margo {' '.join(args)}: exit {code}: {err.getvalue()}"
    token: str = json.loads(out.getvalue().strip().splitlines()[-1])["token"]
    return token


@contextmanager
def running_server(data: Path, *extra: str) -> Iterator[str]:
    """Start `margo serve` (on `STORE`); yield its base URL; stop it (SIGTERM) afterwards."""
    if STORE[0] == "replicas":
        with running_replicas(data, *extra) as base:
            yield base
        return
    with _one_server(data, *extra) as base:
        yield base


@contextmanager
def running_replicas(data: Path, *extra: str, count: int = REPLICAS,
                     preserve_host: bool = False) -> Iterator[str]:
    """`count` servers on the data directory's PostgreSQL database (data in
    `<data>/replica-<i>`), behind a round-robin balancer (passing the client's `Host`
    through with `preserve_host`: kits.balancer); yields the balancer's URL."""
    with contextlib.ExitStack() as stack:
        bases = [stack.enter_context(_one_server(
            data / f"replica-{i}", *extra, "--database", database_for(data),
            log_dir=data.parent)) for i in range(count)]
        balancer = stack.enter_context(balancing(bases, preserve_host=preserve_host))
        yield balancer.url


@contextmanager
def two_replicas(folder: Path, clients: Iterable[str],
                 extra: Iterable[str] = ()) -> Iterator[dict[str, Any]]:
    """Two servers on one PostgreSQL database, each reached directly (no balancer), on a
    copy of the example fleet (`<folder>/fleet`), with `clients` added (and `extra`
    options, such as `--watch-source`). Yields `bases`,
    `tokens` (per client), `data`, `url` (the database), `args` (what another replica is
    started with), `log_dir`, `source` and `repos` (each replica's device repository)."""
    source = folder / "fleet"
    shutil.copytree(ROOT / "examples" / "fleet", source)
    data = folder / "data"
    with use_store("replicas"):
        tokens = {name: add_client(data, name) for name in clients}
        url = database_for(data)
        args = ("--source", str(source), "--database", url, *extra)
        with _one_server(data / "replica-0", *args, log_dir=folder) as first, \
                _one_server(data / "replica-1", *args, log_dir=folder) as second:
            yield {"bases": [first, second], "tokens": tokens, "data": data, "url": url,
                   "args": args, "log_dir": folder, "source": source,
                   "repos": [data / f"replica-{i}" / "repos" / REPOSITORY_NAME
                             for i in (0, 1)]}


def replica_client(replicas: dict[str, Any], name: str, replica: int) -> httpx.Client:
    """An HTTP client of `two_replicas` for client `name`, talking to one replica."""
    return httpx.Client(base_url=replicas["bases"][replica], timeout=10,
                        headers={"Authorization": f"Bearer {replicas['tokens'][name]}"})


@contextmanager
def _one_server(data: Path, *extra: str, log_dir: Path | None = None) -> Iterator[str]:
    with running_margo(data, *extra, log_dir=log_dir, log_level=LOG_LEVEL, cwd=ROOT) as base:
        yield base


@contextmanager
def killable_server(data: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """One server process (on `STORE`: with replicas, one replica on the database), for
    tests that kill it."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "margo_cli.main", "serve", "--port", str(port), "--data",
         str(data), "--log-level", LOG_LEVEL, *store_args(data), *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        with contextlib.suppress(TimeoutError):  # the test sees a server that never answered
            poll_until("the server", lambda: httpx.get(f"{base}/healthz", timeout=1)
                       .status_code == 200, timeout=30, not_yet=(httpx.TransportError,))
        yield base, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@cache
def _openapi(version: str) -> dict[str, Any]:
    for directory in OPENAPI_DIRS:
        path = directory / OPENAPI[version]
        if path.exists():
            doc: dict[str, Any] = yaml.safe_load(path.read_text())
            schema = doc["components"]["schemas"].get("UnsignedAppStateManifest")
            if schema:  # the documented defect: dotted names listed as required properties
                schema["required"] = [r for r in schema["required"] if "." not in r]
            if version == "rc.3":  # required there, defined nowhere (docs/spec-interpretation.md)
                metadata = doc["components"]["schemas"]["appDeploymentMetadata"]
                metadata["required"] = [r for r in metadata["required"] if r != "annotations"]
            return doc
    raise FileNotFoundError(OPENAPI[version])


def assert_matches_openapi(version: str, schema_name: str, body: Any) -> None:
    """Validate a response body against `#/components/schemas/<schema_name>`."""
    doc = _openapi(version)
    registry = Registry().with_resource("urn:openapi", DRAFT202012.create_resource(doc))
    validator = Draft202012Validator({"$ref": f"urn:openapi#/components/schemas/{schema_name}"},
                                     registry=registry)
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


def assert_deployment_in_generation(generation: str, data: bytes) -> dict[str, Any]:
    """A served ApplicationDeployment (its exact bytes) is in `generation`'s shape: valid
    against our schema of that generation (`margo.schemas`), detected as that shape, and,
    for rc.2 and rc.3, valid against the official OpenAPI's `appDeploymentManifest`
    (Oct-2024 had no REST API). The parsed document, for further checks."""
    doc: dict[str, Any] = load_document(data, file="served.yaml").value
    errors = [f"{list(e.path)}: {e.message}" for e in
              validator_for("ApplicationDeployment", generation).iter_errors(doc)]
    assert not errors, (generation, errors)
    assert detect(doc).shape == generation, (generation, detect(doc))
    if generation != "oct-2024":
        assert_matches_openapi(generation, "appDeploymentManifest", doc)
    return doc


# (method, path pattern, status) -> (OpenAPI version, schema) for JSON responses the official
# documents define. Every response of the API tests passes through `check_response`.
_RESPONSE_SCHEMAS: list[tuple[str, re.Pattern[str], int, str, str]] = [
    ("GET", re.compile(r"^/api/v1/deployments$"), 200, "rc.3", "UnsignedAppStateManifest"),
    ("GET", re.compile(r"^/api/v1/clients/[^/]+/deployments$"), 200, "rc.2",
     "UnsignedAppStateManifest"),
]


def check_response(response: httpx.Response) -> None:
    """Validate a response body against the official OpenAPI schema for it, if any:
    problem+json against rc.3 ProblemDetail, manifests against UnsignedAppStateManifest."""
    response.read()
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("application/problem+json"):
        assert_matches_openapi("rc.3", "ProblemDetail", response.json())
        return
    for method, pattern, status, version, schema in _RESPONSE_SCHEMAS:
        if (response.request.method == method and pattern.match(response.request.url.path)
                and response.status_code == status):
            assert_matches_openapi(version, schema, response.json())
