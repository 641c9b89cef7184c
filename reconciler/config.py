"""The device client's configuration file (`margo device run --config FILE`).

One YAML (or JSON) document, validated against a JSON Schema with every problem reported as
`file:line:col: $.path: message`, then checked for combinations that cannot work. Relative
paths are relative to the configuration file, so a device directory can be moved as a whole.
See `docs/device.md` for the reference and examples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from jsonschema import Draft202012Validator

from margo.errors import DocumentError, Problem
from margo.kinds import GENERATIONS, Shape
from margo.loading import LoadedDocument, load_document
from margo.schemas import python_patterns
from margo.signature_names import ALGORITHM_NAMES
from margo.validation import explain_schema_errors
from reconciler.desired import parse_duration
from reconciler.encryption_key import default_key_path
from reconciler.failover import DEFAULT_FAILBACK_SECONDS
from reconciler.registry_credentials import REGISTRY_HOST, RegistryCredential, secret_file_problem
from reconciler.releases import DEFAULT_DRIFT, DRIFT_POLICIES
from reconciler.schedule import OneOffWindow, RecurringWindow, Schedule, parse_window
from reconciler.telemetry import PROTOCOLS, Injection, TelemetryConfig

__all__ = ["CONFIG_API_VERSION", "DeviceConfig", "IdentityConfig", "config_schema",
           "device_repository", "load_config", "parse_config"]

CONFIG_API_VERSION = "margo-gitops.dev/v1alpha1"
DEVICE_ID = r"^[A-Za-z0-9._~-]+(/[A-Za-z0-9._~-]+)*$"
DURATION = r"^(\d+(\.\d+)?(ms|h|m|s))+$"
#: The most URLs one list may hold beyond the first: with every one of them silent, a
#: request waits its timeout once per URL.
MAX_FALLBACK_URLS = 8
_SERVER_URL = {"type": "string", "pattern": r"^https?://[^/\s]+(/\S*)?$"}
_GIT_URL = {"type": "string", "pattern": r"^(https?|file)://\S+$"}


def _urls(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item, "uniqueItems": True, "maxItems": MAX_FALLBACK_URLS}


def _closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": required or []}


_TEXT = {"type": "string", "minLength": 1}


def _server_schema() -> dict[str, Any]:
    """The fleet server this device reports to (and, with failover, its other replicas)."""
    return _closed({
        "url": _SERVER_URL,
        # the same server through other replicas; see reconciler.failover
        "fallbackUrls": _urls(_SERVER_URL),
        "failback": {"type": "string", "pattern": DURATION},
        "api": {"enum": list(GENERATIONS)},
        "clientId": _TEXT,
        "tokenFile": _TEXT,
        "timeout": {"type": "string", "pattern": DURATION},
    }, ["url"])


def _source_schema() -> dict[str, Any]:
    """Where desired state comes from: the device's Git repository or the REST API."""
    return _closed({
        "type": {"enum": ["git", "margo-rest"]},
        "url": _GIT_URL,
        "fallbackUrls": _urls(_GIT_URL),  # git only, with url
        "depth": {"type": "integer", "minimum": 0},
        # git only: a tip the operator moved the branch to on purpose, accepted once
        "acceptHistoryRewrite": {"type": "string",
                                 "pattern": r"^[0-9a-f]{40}([0-9a-f]{24})?$"},
    }, ["type"])


def _driver_schema() -> dict[str, Any]:
    """The engine that runs components, and its engine-specific settings."""
    return _closed({
        "type": {"enum": ["helm", "compose", "render"]},
        "outputDir": _TEXT,
        "kubeconfig": _TEXT,
        "kubeContext": _TEXT,
        "storageDriver": {"enum": ["secret", "configmap", "memory"]},
        "driftDetection": {"enum": list(DRIFT_POLICIES)},
        "rollbackOnFailure": {"type": "boolean"},
        "docker": _TEXT,
        "compose": _TEXT,
        "dockerHost": {"type": "string", "pattern": r"^(unix|tcp|ssh|fd)://\S+$"},
    }, ["type"])


def _registries_schema() -> dict[str, Any]:
    """Credentials per registry host, for charts, Compose packages and images."""
    return {
        "type": "object", "propertyNames": {"pattern": REGISTRY_HOST},
        "additionalProperties": {
            **_closed({"username": _TEXT, "usernameFile": _TEXT, "passwordFile": _TEXT},
                      ["passwordFile"]),
            "oneOf": [{"required": ["username"]}, {"required": ["usernameFile"]}]}}


def _identity_schema() -> dict[str, Any]:
    """The device's own identity: an SVID (rc.3) or an rc.2 key and certificate."""
    return _closed({
        "svid": _closed({"cert": _TEXT, "key": _TEXT}, ["cert", "key"]),
        "trustBundle": _TEXT,
        "trustDomain": {"type": "string", "pattern": r"^[a-z0-9._-]+$"},
        "wfmId": {"type": "string", "pattern": r"^[A-Za-z0-9._~-]+$"},
        "tls12": {"type": "boolean"},
        "rc2": _closed({"key": _TEXT, "certificate": _TEXT,
                        "algorithm": {"enum": list(ALGORITHM_NAMES)}},
                       ["key", "certificate"]),
        # the age identity sealed values are opened with (default: <dataDir>/keys/...)
        "encryptionKey": _TEXT,
    })


def _capabilities_schema() -> dict[str, Any]:
    """Where the capability report comes from: a file, host facts or a cluster."""
    return _closed({
        "file": _TEXT,
        "host": _closed({
            "vendor": _TEXT, "modelNumber": _TEXT, "serialNumber": _TEXT,
            "otelCollector": {"type": "boolean"},
            "labels": {"type": "object"},
        }),
        "kubernetes": _closed({
            "kubeconfig": _TEXT,
            "context": _TEXT,
            "inCluster": {"type": "boolean"},
            "vendor": _TEXT, "modelNumber": _TEXT, "serialNumber": _TEXT,
            "labels": {"type": "object"},
            "threshold": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            "debounce": {"type": "string", "pattern": DURATION},
            "doctor": {"type": "boolean"},
        }),
    })


def _telemetry_schema() -> dict[str, Any]:
    """The OpenTelemetry collector, the client's own export, what containers get."""
    return _closed({
        # the collector's OTLP/HTTP base URL as this client reaches it
        "collector": _SERVER_URL,
        "export": {"type": "boolean"},  # the client's own metrics and logs
        "interval": {"type": "string", "pattern": DURATION},
        "timeout": {"type": "string", "pattern": DURATION},
        "caFile": _TEXT,
        "inject": _closed({  # what every container gets (its view of the collector)
            "httpEndpoint": _SERVER_URL,
            "grpcEndpoint": _SERVER_URL,
            "certificate": {"type": "string", "pattern": r"^/\S+$"},
            "protocol": {"enum": list(PROTOCOLS)},
        }),
    }, ["collector"])


def _schedule_schema() -> dict[str, Any]:
    """When the client polls and re-asserts its reports."""
    return _closed({
        "interval": {"type": "string", "pattern": DURATION},
        "resync": {"type": "string", "pattern": DURATION},
        # the most a poll asks the server to hold it until the state changes; "0s": plain
        "wait": {"type": "string", "pattern": DURATION},
        "pollingWindows": {"type": "array", "items": _TEXT},
        "downtime": {"type": "array", "items": _TEXT},
        "timezone": _TEXT,
    })


@cache
def config_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of the device client configuration."""
    return _closed({
        "apiVersion": {"const": CONFIG_API_VERSION},
        "kind": {"const": "DeviceClientConfig"},
        "device": _closed({"id": {"type": "string", "pattern": DEVICE_ID}}, ["id"]),
        "server": _server_schema(),
        "source": _source_schema(),
        "driver": _driver_schema(),
        "dataDir": _TEXT,
        "registries": _registries_schema(),
        "identity": _identity_schema(),
        "capabilities": _capabilities_schema(),
        "telemetry": _telemetry_schema(),
        "schedule": _schedule_schema(),
    }, ["device", "server", "source", "driver", "dataDir"])


@cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(python_patterns(config_schema()))


@dataclass(frozen=True)
class IdentityConfig:
    """The `identity:` section: rc.3 mutual TLS with an SVID (`svid_cert`/`svid_key`, the
    WFM's SPIFFE ID from our own SVID unless `trust_domain`/`wfm_id` say otherwise), rc.2
    onboarding and request signing (`rc2_*`), and the trust bundle for the server's
    certificate (SVID chain for rc.3; a CA with host name checks otherwise)."""

    svid_cert: Path | None = None
    svid_key: Path | None = None
    trust_bundle: Path | None = None
    trust_domain: str | None = None
    wfm_id: str | None = None
    tls12: bool = False
    rc2_key: Path | None = None
    rc2_certificate: Path | None = None
    rc2_algorithm: str | None = None
    #: The device's encryption key file (None: `<dataDir>/keys/encryption.age`).
    encryption_key: Path | None = None


@dataclass(frozen=True)
class DeviceConfig:
    """A validated configuration with paths made absolute. `client_id` is empty when the
    identity supplies it (the SVID's client segment, or rc.2 onboarding); `token_file` is None
    when no bearer token is used."""

    file: str
    device_id: str
    server_url: str
    api: str
    client_id: str
    token_file: Path | None
    timeout: float
    source: str
    git_url: str | None
    git_depth: int | None
    driver: str
    output_dir: Path
    kubeconfig: Path | None
    kube_context: str | None
    storage_driver: str
    docker: str
    data_dir: Path
    capabilities_file: Path | None
    host_facts: dict[str, Any] | None
    kubernetes: dict[str, Any] | None = None  # KubernetesProvider keyword arguments
    #: off | warn | repair, for every driver; "" = the driver's default (DEFAULT_DRIFT).
    drift_detection: str = ""
    rollback_on_failure: bool = False  # Helm driver: roll a failed upgrade back at once
    #: Compose driver: "plugin" (the docker CLI's compose plugin) or a standalone binary.
    compose: str = "auto"
    docker_host: str | None = None  # Compose driver: DOCKER_HOST for the CLI and engine
    registry_credentials: tuple[RegistryCredential, ...] = ()
    schedule: Schedule = field(default_factory=Schedule)
    identity: IdentityConfig | None = None
    #: Git source: the commit of a deliberately rewound or rewritten branch to accept once
    #: although it does not descend from the adopted commit (rollback protection).
    git_accept_history_rewrite: str | None = None
    #: The same server through other URLs (replicas), tried in turn (reconciler.failover).
    fallback_urls: tuple[str, ...] = ()
    #: The Git source's further URLs: under `fallback_urls` unless `source.url` was given.
    git_fallback_urls: tuple[str, ...] = ()
    #: Seconds on a fallback URL before the first one is tried again (0: never).
    failback: float = DEFAULT_FAILBACK_SECONDS
    #: The `telemetry:` section (None: nothing injected, nothing exported).
    telemetry: TelemetryConfig | None = None

    @property
    def server_urls(self) -> tuple[str, ...]:
        """`server_url` and then its fallbacks: the order requests try them in."""
        return (self.server_url, *self.fallback_urls)

    @property
    def encryption_key(self) -> Path:
        """The device's encryption key file (`reconciler.encryption_key`): as configured
        (`identity.encryptionKey`), else in the data directory."""
        configured = self.identity.encryption_key if self.identity else None
        return configured or default_key_path(self.data_dir)

    @property
    def git_urls(self) -> tuple[str, ...]:
        """The Git source's URLs in the order they are tried (empty for the REST source)."""
        return () if self.git_url is None else (self.git_url, *self.git_fallback_urls)

    def token(self) -> str:
        """Read at use, so a rotated token file is picked up without a restart."""
        if self.token_file is None:
            raise ValueError("no server.tokenFile is configured")
        return self.token_file.read_text(encoding="utf-8").strip()


def _path(base: Path, text: str) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def _schedule(raw: dict[str, Any], problems: list[Problem]) -> Schedule:
    polling: list[RecurringWindow] = []
    downtime: list[RecurringWindow | OneOffWindow] = []
    for key, target, one_off in (("pollingWindows", polling, False),
                                 ("downtime", downtime, True)):
        for index, text in enumerate(raw.get(key, [])):
            try:
                target.append(parse_window(text, one_off=one_off))  # type: ignore[arg-type]
            except ValueError as exc:
                problems.append(Problem(("schedule", key, index), str(exc)))
    timezone = raw.get("timezone", "UTC")
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):  # ValueError: names like '../etc'
        problems.append(Problem(("schedule", "timezone"), f"unknown time zone {timezone!r}",
                                expected="an IANA name such as 'Europe/Berlin' or 'UTC'"))
        timezone = "UTC"
    interval = parse_duration(raw.get("interval", "30s"))
    if interval <= 0:
        problems.append(Problem(("schedule", "interval"), "the polling interval must be > 0"))
    resync = parse_duration(raw.get("resync", "10m"))
    wait = parse_duration(raw.get("wait", "60s"))
    return Schedule(interval=interval or 30.0, polling=tuple(polling),
                    downtime=tuple(downtime), timezone=timezone, resync=resync, wait=wait)


def _kubernetes(raw: dict[str, Any] | None, base: Path,
                driver: dict[str, Any]) -> dict[str, Any] | None:
    """The cluster capability provider's settings: its kubeconfig defaults to the Helm
    driver's, and `inCluster: true` means the pod's service account."""
    if raw is None:
        return None
    kubeconfig = raw.get("kubeconfig") or (None if raw.get("inCluster")
                                           else driver.get("kubeconfig"))
    return {"kubeconfig": _path(base, kubeconfig) if kubeconfig else None,
            "context": raw.get("context") or driver.get("kubeContext"),
            "vendor": raw.get("vendor", "unknown"),
            "model_number": raw.get("modelNumber", "unknown"),
            "serial_number": raw.get("serialNumber", "unknown"),
            "labels": raw.get("labels"), "threshold": raw.get("threshold", 0.10),
            "debounce_seconds": parse_duration(raw.get("debounce", "30s")),
            "doctor": bool(raw.get("doctor", False))}


def _compose_cli(driver: dict[str, Any], base: Path, found: list[Problem]) -> str:
    """`auto`, `plugin`, or the absolute path of a standalone Compose v2 binary that exists."""
    value = driver.get("compose", "auto")
    if value in ("auto", "plugin"):
        return str(value)
    path = _path(base, value)
    if not path.is_file() or not os.access(path, os.X_OK):
        found.append(Problem(("driver", "compose"), "not an executable file",
                             expected="auto, plugin, or the path of a docker-compose v2 binary",
                             found=str(path)))
    return str(path)


def _telemetry(raw: dict[str, Any] | None, driver: str, base: Path,
               found: list[Problem]) -> TelemetryConfig | None:
    """The `telemetry:` section: the collector, what workloads get injected (by default the
    collector's own URL), and the client's own export settings."""
    if raw is None:
        return None
    inject = raw.get("inject", {})
    protocol = inject.get("protocol", "http/protobuf")
    if protocol == "grpc" and "grpcEndpoint" not in inject:
        found.append(Problem(("telemetry", "inject", "protocol"), "protocol grpc needs "
                             "telemetry.inject.grpcEndpoint (the collector's OTLP/gRPC URL)",
                             found=protocol))
    certificate = inject.get("certificate")
    certificate_file = None
    if certificate is not None and driver == "compose":
        # Compose: the host file is bind-mounted at the same path, read-only.
        certificate_file = Path(certificate)
        if not certificate_file.is_file() or not os.access(certificate_file, os.R_OK):
            found.append(Problem(("telemetry", "inject", "certificate"), "not a readable file "
                                 "on this host (the Compose driver mounts it into every "
                                 "container at the same path)", found=certificate))
    for key in ("interval", "timeout"):
        if key in raw and parse_duration(raw[key]) <= 0:
            found.append(Problem(("telemetry", key), "must be more than 0", found=raw[key]))
    injection = Injection(
        http_endpoint=inject.get("httpEndpoint", raw["collector"]).rstrip("/"),
        grpc_endpoint=(inject["grpcEndpoint"].rstrip("/") if "grpcEndpoint" in inject
                       else None),
        certificate=certificate, certificate_file=certificate_file, protocol=protocol)
    return TelemetryConfig(
        collector=raw["collector"].rstrip("/"), inject=injection,
        export=bool(raw.get("export", True)),
        interval=parse_duration(raw.get("interval", "30s")),
        timeout=parse_duration(raw.get("timeout", "5s")),
        ca_file=_path(base, raw["caFile"]) if "caFile" in raw else None)


def _credentials(raw: dict[str, Any], base: Path,
                 found: list[Problem]) -> tuple[RegistryCredential, ...]:
    """Per-registry credentials; a password file others can read is a located problem."""
    out: list[RegistryCredential] = []
    for host, entry in sorted(raw.items()):
        password_file = _path(base, entry["passwordFile"])
        problem = secret_file_problem(password_file)
        if problem is not None:
            found.append(Problem(("registries", host, "passwordFile"), problem))
            continue
        username = entry.get("username")
        if "usernameFile" in entry:
            try:
                username = _path(base, entry["usernameFile"]).read_text(
                    encoding="utf-8").strip()
            except OSError as exc:
                found.append(Problem(("registries", host, "usernameFile"),
                                     f"cannot read: {exc.strerror or exc}"))
                continue
        out.append(RegistryCredential(host, str(username), password_file))
    return tuple(out)


def _identity(raw: dict[str, Any] | None, base: Path) -> IdentityConfig | None:
    if raw is None:
        return None
    svid, rc2 = raw.get("svid", {}), raw.get("rc2", {})

    def path(section: dict[str, Any], key: str) -> Path | None:
        return _path(base, section[key]) if key in section else None

    return IdentityConfig(
        svid_cert=path(svid, "cert"), svid_key=path(svid, "key"),
        trust_bundle=path(raw, "trustBundle"), trust_domain=raw.get("trustDomain"),
        wfm_id=raw.get("wfmId"), tls12=bool(raw.get("tls12", False)),
        rc2_key=path(rc2, "key"), rc2_certificate=path(rc2, "certificate"),
        rc2_algorithm=rc2.get("algorithm"), encryption_key=path(raw, "encryptionKey"))


def _server_urls(server: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """Every server URL with where it is in the file: `url`, then each fallback."""
    return [(("server", "url"), server["url"]),
            *((("server", "fallbackUrls", i), url)
              for i, url in enumerate(server.get("fallbackUrls", [])))]


def _check_urls(doc: dict[str, Any], found: list[Problem]) -> None:
    """A fallback that repeats an earlier URL, and fallbacks for a Git URL given alone."""
    for key in ("server", "source"):
        section = doc[key]
        seen = {section["url"].rstrip("/")} if "url" in section else set()
        for index, url in enumerate(section.get("fallbackUrls", [])):
            if url.rstrip("/") in seen:
                found.append(Problem((key, "fallbackUrls", index), "this URL is already listed",
                                     found=url))
            seen.add(url.rstrip("/"))
    source = doc["source"]
    if "fallbackUrls" in source and source["type"] == "git" and "url" not in source:
        found.append(Problem(("source", "fallbackUrls"), "only with source.url: without it the "
                             "Git URLs follow server.url and server.fallbackUrls"))


def _check_identity(doc: dict[str, Any], api: str, found: list[Problem]) -> None:
    """Combinations of identity, API generation, source and credentials that cannot work
    (each kind in turn: the identity chosen, the server URLs it needs, the credentials)."""
    identity = doc.get("identity", {})
    _check_identity_kind(identity, api, doc["source"]["type"], found)
    _check_identity_urls(identity, doc["server"], found)
    _check_credentials(identity, doc["server"], doc["source"]["type"], found)


def _check_identity_kind(identity: dict[str, Any], api: str, source: str,
                         found: list[Problem]) -> None:
    svid, rc2 = "svid" in identity, "rc2" in identity
    if svid and (api != Shape.RC3 or source != "margo-rest"):
        found.append(Problem(("identity", "svid"), "an SVID is the rc.3 identity: use "
                             "server.api rc.3 with the margo-rest source (the Git source keeps "
                             "its per-device token: libgit2 has no client certificates)",
                             found=f"{api}, {source}"))
    if rc2 and (api != Shape.RC2 or source != "margo-rest"):
        found.append(Problem(("identity", "rc2"), "rc.2 onboarding and request signing need "
                             "server.api rc.2 with the margo-rest source",
                             found=f"{api}, {source}"))
    if svid and rc2:
        found.append(Problem(("identity",), "give either svid (rc.3) or rc2, not both"))
    if svid and "trustBundle" not in identity:
        found.append(Problem(("identity",), "an SVID needs identity.trustBundle: the WFM's "
                             "SVID must chain to it (there is no trust on first use)"))


def _check_identity_urls(identity: dict[str, Any], server: dict[str, Any],
                         found: list[Problem]) -> None:
    """Mutual TLS and a trust bundle both need https:// server URLs."""
    for where, url in _server_urls(server):
        if url.startswith("https://"):
            continue
        if "svid" in identity:
            found.append(Problem(where, "mutual TLS needs an https:// server URL", found=url))
        elif "trustBundle" in identity:
            found.append(Problem(
                ("identity", "trustBundle") if where == ("server", "url") else where,
                "a trust bundle checks the server's certificate, which a plain http:// "
                "server URL does not have", found=url))


def _check_credentials(identity: dict[str, Any], server: dict[str, Any], source: str,
                       found: list[Problem]) -> None:
    """What proves the client: the identity, or else a client id and a bearer token."""
    svid, rc2 = "svid" in identity, "rc2" in identity
    for key in ("trustDomain", "wfmId"):
        if key in identity and not svid:
            found.append(Problem(("identity", key), "only used with identity.svid (it names "
                                 "the WFM's SPIFFE ID)"))
    if (svid or rc2) and "clientId" in server:
        found.append(Problem(("server", "clientId"), "the identity supplies the client id (the "
                             "SVID's SPIFFE ID, or rc.2 onboarding); remove server.clientId"))
    if (svid or rc2) and source != "git" and "tokenFile" in server:
        found.append(Problem(("server", "tokenFile"), "bearer tokens are for development: with "
                             "an identity the REST source sends none; remove server.tokenFile"))
    if not (svid or rc2) or source == "git":
        missing = [key for key in ("clientId", "tokenFile") if key not in server]
        if missing:
            found.append(Problem(("server",), f"{' and '.join(missing)} required: without "
                                 "identity.svid or identity.rc2 the client authenticates with "
                                 "a bearer token (and the Git source always does)",
                                 expected=", ".join(missing)))


def _api_generation(server: dict[str, Any], source: dict[str, Any],
                    found: list[Problem]) -> str:
    """The status API generation the device speaks (`server.api`, else the source's
    default), with a problem when the source cannot work with it."""
    api: str = server.get("api", Shape.OCT_2024.value if source["type"] == "git"
                          else Shape.RC3.value)
    if source["type"] == "git" and api != Shape.OCT_2024:
        found.append(Problem(("server", "api"), "a device with the git source reports status "
                             "through the Oct-2024 API: an rc.3 report must name the "
                             "manifestVersion it adopted, which only the margo-rest source "
                             "has, and an rc.2 identity has no token for the Git hosting",
                             expected=Shape.OCT_2024.value, found=api))
    if source["type"] == "margo-rest" and api == Shape.OCT_2024:
        found.append(Problem(("server", "api"), "the Oct-2024 API has no State Manifest; use "
                             "rc.3 or rc.2 with the margo-rest source", found=api))
    return api


def _check_applicable(source: dict[str, Any], driver: dict[str, Any], caps: dict[str, Any],
                      found: list[Problem]) -> None:
    """Settings that only one kind of source or driver takes, given to another, and more
    than one source of capabilities."""
    for key in ("url", "acceptHistoryRewrite", "fallbackUrls"):
        if key in source and source["type"] != "git":
            found.append(Problem(("source", key), "only the git source takes this setting",
                                 found=source["type"]))
    if len(caps) > 1:
        found.append(Problem(("capabilities",), "give one of 'file', 'host' or 'kubernetes'",
                             found=", ".join(sorted(caps))))
    for key in ("rollbackOnFailure", "storageDriver"):
        if key in driver and driver["type"] != "helm":
            found.append(Problem(("driver", key), "only the helm driver takes this setting",
                                 found=driver["type"]))
    for key in ("compose", "dockerHost", "docker"):
        if key in driver and driver["type"] != "compose":
            found.append(Problem(("driver", key), "only the compose driver takes this setting",
                                 found=driver["type"]))


def parse_config(loaded: LoadedDocument, *, base: Path) -> DeviceConfig:
    """Validate a loaded configuration; raise `DocumentError` with located problems."""
    doc = loaded.value
    problems = [loaded.locate(p, at_key=at_key)
                for p, at_key in explain_schema_errors(_validator(), doc)]
    if problems:
        raise DocumentError(problems)
    found: list[Problem] = []
    server, source, driver = doc["server"], doc["source"], doc["driver"]
    caps = doc.get("capabilities", {})
    api = _api_generation(server, source, found)
    _check_applicable(source, driver, caps, found)
    compose = _compose_cli(driver, base, found)
    credentials = _credentials(doc.get("registries", {}), base, found)
    _check_urls(doc, found)
    _check_identity(doc, api, found)
    schedule = _schedule(doc.get("schedule", {}), found)
    telemetry = _telemetry(doc.get("telemetry"), driver["type"], base, found)
    if "otelCollector" in caps.get("host", {}):
        found.append(Problem(("capabilities", "host", "otelCollector"), "the collector is "
                             "found, not declared: configure telemetry.collector and the "
                             "report says whether it answers"))
    if found:
        raise DocumentError([loaded.locate(p) for p in found])
    data_dir = _path(base, doc["dataDir"])
    url = server["url"].rstrip("/")
    device_id = doc["device"]["id"]
    fallbacks = tuple(u.rstrip("/") for u in server.get("fallbackUrls", []))
    git_url, git_fallbacks = _git_urls(source, (url, *fallbacks), device_id)
    return DeviceConfig(
        file=loaded.file or "<config>", device_id=device_id, server_url=url, api=api,
        client_id=server.get("clientId", ""),
        token_file=_path(base, server["tokenFile"]) if "tokenFile" in server else None,
        timeout=parse_duration(server.get("timeout", "10s")), source=source["type"],
        git_url=git_url, git_depth=source.get("depth", 1) or None, driver=driver["type"],
        output_dir=_path(base, driver.get("outputDir", str(data_dir / "rendered"))),
        kubeconfig=_path(base, driver["kubeconfig"]) if "kubeconfig" in driver else None,
        kube_context=driver.get("kubeContext"),
        storage_driver=driver.get("storageDriver", "secret"),
        docker=driver.get("docker", "docker"), data_dir=data_dir,
        capabilities_file=_path(base, caps["file"]) if "file" in caps else None,
        host_facts=caps.get("host"), kubernetes=_kubernetes(caps.get("kubernetes"), base,
                                                            driver),
        schedule=schedule, identity=_identity(doc.get("identity"), base),
        drift_detection=driver.get("driftDetection", DEFAULT_DRIFT[driver["type"]]),
        rollback_on_failure=bool(driver.get("rollbackOnFailure", False)),
        compose=compose, docker_host=driver.get("dockerHost"),
        registry_credentials=credentials,
        git_accept_history_rewrite=source.get("acceptHistoryRewrite"),
        fallback_urls=fallbacks, git_fallback_urls=git_fallbacks,
        failback=(parse_duration(server["failback"]) if "failback" in server
                  else DEFAULT_FAILBACK_SECONDS), telemetry=telemetry)


def _git_urls(source: dict[str, Any], server_urls: tuple[str, ...],
              device_id: str) -> tuple[str | None, tuple[str, ...]]:
    """The Git source's first URL and its fallbacks: as configured, or the device's
    repository under each server URL (None for the REST source)."""
    if source["type"] != "git":
        return None, ()
    if "url" in source:
        return source["url"], tuple(source.get("fallbackUrls", []))
    derived = tuple(device_repository(base, device_id) for base in server_urls)
    return derived[0], derived[1:]


def device_repository(server_url: str, device_id: str) -> str:
    """The device's own Git repository on a fleet server (`margo serve`)."""
    return f"{server_url}/git/devices/{device_id}.git"


def load_config(path: str | Path) -> DeviceConfig:
    """Read and validate a configuration file. `OSError` propagates (unreadable is not
    invalid); `DocumentError` names file, line and path of every problem."""
    path = Path(path)
    loaded = load_document(path.read_bytes(), file=str(path))
    return parse_config(loaded, base=path.resolve().parent)
