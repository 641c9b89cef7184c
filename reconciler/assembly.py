"""Build a running device client from its configuration: state store, HTTP client, source,
driver and reporters, owned together and closed together.

One HTTP client carries the device's identity for the REST source, status reports and
capability reports alike: rc.3 mutual TLS with the SVID (`reconciler.identity`), rc.2
signatures after onboarding (`reconciler.signing`), or, for development, a bearer token. The
Git source keeps its per-device token (libgit2 has no client certificates).

With `server.fallbackUrls` that client is a `reconciler.failover.FailoverClient`, and the Git
source, when its URLs are the device's repository under each server URL, shares its
`ServerList`: whichever of them finds the URL in use dead moves both.

The device's encryption key (`reconciler.encryption_key`) is opened, or created on the
first start, right after the data directory's lock: the driver opens sealed values with it,
and every capability report carries its recipient (`reconciler.capabilities.KeyReporting`).

Kept apart from the runner so the cycle logic stays free of construction details, and so
tests and benchmarks assemble exactly what `margo device run` assembles.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from margo.errors import DocumentError
from margo.kinds import Shape
from reconciler.capabilities import (
    CapabilityProvider,
    CapabilityReporter,
    HostProvider,
    KeyReporting,
    StaticProvider,
)
from reconciler.config import DeviceConfig, IdentityConfig, device_repository
from reconciler.datadir import exclusive
from reconciler.delivery import Reporter
from reconciler.drivers.base import Driver
from reconciler.encryption_key import DeviceKey
from reconciler.failover import FailoverClient, ServerList
from reconciler.releases import DEFAULT_DRIFT
from reconciler.runner import CycleObserver, Reconciler, StatusTarget
from reconciler.sources import Source
from reconciler.sources.waiting import WaitingPolls
from reconciler.state import DeviceState

__all__ = ["TokenAuth", "capability_provider", "open_driver", "open_reconciler",
           "profile_types"]

USER_AGENT = "margo-gitops-device/0.1"


class TokenAuth(httpx.Auth):
    """`Authorization: Bearer <token>` read from the token file, re-read when the file
    changes, so a rotated token is used without a restart."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._token = ""

    def token(self) -> str:
        stat = self.path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._token = self.path.read_text(encoding="utf-8").strip()
            self._stamp = stamp
        return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.token()}"
        yield request


def _transport(identity: IdentityConfig) -> httpx.BaseTransport | None:
    """rc.3 mutual TLS with the SVID, or server-only TLS against the configured trust bundle;
    None: httpx's default transport (system CAs, or plain HTTP in development)."""
    if identity.trust_bundle is None:
        return None
    from reconciler.identity import IdentityTransport, ServerTrust, SvidMaterial
    if identity.svid_cert is not None and identity.svid_key is not None:
        return IdentityTransport(SvidMaterial(
            identity.svid_cert, identity.svid_key, identity.trust_bundle,
            trust_domain=identity.trust_domain, wfm_id=identity.wfm_id, tls12=identity.tls12))
    return IdentityTransport(ServerTrust(identity.trust_bundle, tls12=identity.tls12))


def _connect(config: DeviceConfig, stack: ExitStack,
             servers: ServerList) -> tuple[httpx.Client, str]:
    """The HTTP client with the device's identity, and the client id it speaks as: the
    configured one (bearer tokens), our SVID's client segment (rc.3) or the clientId from
    onboarding (rc.2, which needs the server on the first start only).

    Raises `reconciler.identity.IdentityError`, `reconciler.signing.SigningError` or
    `reconciler.signing.OnboardingError` when the identity cannot be used."""
    identity = config.identity or IdentityConfig()
    transport = _transport(identity)
    key = None
    auth: httpx.Auth | None
    if identity.rc2_key is not None:
        from reconciler.signing import SigningAuth, load_device_key
        key = load_device_key(identity.rc2_key, identity.rc2_algorithm)
        auth = SigningAuth(key)
    elif identity.svid_cert is not None:
        auth = None  # the certificate is the credential
    else:
        assert config.token_file is not None  # the configuration requires it
        auth = TokenAuth(config.token_file)
    if transport is not None:
        stack.callback(transport.close)  # also when httpx.Client below is never built
    http = stack.enter_context(FailoverClient(
        config.server_urls, servers=servers, auth=auth, timeout=config.timeout,
        transport=transport,
        headers={"User-Agent": USER_AGENT},
        # Proxies from the environment would bypass the identity transport: never with one.
        trust_env=transport is None))
    client_id = config.client_id
    setup = getattr(transport, "setup", None)
    if setup is not None and setup.client_id:
        client_id = setup.client_id
    if key is not None:
        from reconciler.signing import onboard
        assert identity.rc2_certificate is not None
        client_id = onboard(http, certificate=identity.rc2_certificate, key=key,
                            state_file=config.data_dir / "rc2-client.json")
    return http, client_id


def _git_servers(config: DeviceConfig, servers: ServerList) -> ServerList:
    """The server list itself when the Git URLs are the device's repository under each
    server URL (one view of which server answers); a list of their own otherwise."""
    derived = tuple(device_repository(url, config.device_id) for url in config.server_urls)
    if config.git_urls == derived:
        return servers
    return ServerList(config.git_urls, failback=config.failback)


def _source(config: DeviceConfig, http: httpx.Client, client_id: str,
            servers: ServerList, waiting: WaitingPolls | None) -> Source:
    if config.source == "git":
        import pygit2

        from reconciler.sources.git_source import GitSource
        assert config.git_url is not None
        # libgit2 has no per-call timeout; these process-wide ones keep a hung server from
        # blocking the device forever (milliseconds), and bound what each URL tried costs.
        timeout_ms = int(config.timeout * 1000)
        pygit2.settings.server_connect_timeout = timeout_ms
        pygit2.settings.server_timeout = timeout_ms
        return GitSource(config.git_url, cache_dir=config.data_dir / "git",
                         username=client_id, password=config.token(),
                         depth=config.git_depth,
                         accept_history_rewrite=config.git_accept_history_rewrite,
                         fallback_urls=config.git_fallback_urls,
                         servers=_git_servers(config, servers), waiting=waiting,
                         timeout=config.timeout)
    from reconciler.sources.rest_source import RestSource
    prefix = "/api/v1" if config.api == Shape.RC3 else f"/api/v1/clients/{client_id}"
    return RestSource(http, prefix=prefix, device_id=config.device_id, waiting=waiting)


def _source_is_the_server(config: DeviceConfig) -> bool:
    """Whether an answer from the source is an answer from the server status reports go to:
    always for the REST source; for Git only when every URL of its repository is on one of
    the server's URLs (same scheme, host and port), not, say, on a separate Git host that
    may be up while the fleet server is down."""
    if config.source != "git" or config.git_url is None:
        return True

    def origin(url: str) -> tuple[str, str | None, int | None]:
        parts = urlsplit(url)
        return parts.scheme, parts.hostname, parts.port

    ours = {origin(url) for url in config.server_urls}
    return all(origin(url) in ours for url in config.git_urls)


def open_driver(config: DeviceConfig, stack: ExitStack, key: DeviceKey | None = None) -> Driver:
    """The configured driver, closed by `stack` (for tools that read what is installed
    without running a client: `margo device plan`; without `key`, it cannot apply a
    component with sealed values)."""
    driver = _driver(config, stack, key)
    stack.callback(driver.close)
    return driver


def profile_types(config: DeviceConfig) -> tuple[str, ...]:
    """The ApplicationDeployment profile types the configured driver runs, decided here
    for the driver `_driver` builds and for the `supportedDeploymentTypes` a host reports
    (the running client and `margo device capabilities` alike), without starting an
    engine. The render driver renders Compose packages as well as Helm charts."""
    return {"compose": ("compose",), "render": ("helm", "compose")}.get(config.driver,
                                                                         ("helm",))


def _driver(config: DeviceConfig, stack: ExitStack, key: DeviceKey | None) -> Driver:
    """Drivers are imported on demand: a Compose device never loads the Helm engine. What a
    driver borrows (OCI client, chart cache) is closed by `stack` after the driver; `key`
    opens sealed values."""
    drift = config.drift_detection or DEFAULT_DRIFT[config.driver]
    injection = config.telemetry.inject if config.telemetry else None
    if config.driver == "compose":
        from reconciler.drivers.compose import ComposeDriver
        from reconciler.oci import OciClient
        from reconciler.registry_credentials import as_pairs
        oci = stack.enter_context(OciClient(credentials=as_pairs(config.registry_credentials)))
        return ComposeDriver(config.data_dir / "compose", oci, docker=config.docker,
                             compose=config.compose, docker_host=config.docker_host,
                             credentials=config.registry_credentials, drift=drift,
                             injection=injection, key=key)
    from reconciler.charts import ChartCache
    charts = stack.enter_context(ChartCache(config.data_dir / "charts",
                                            credentials=config.registry_credentials))
    if config.driver == "render":
        from reconciler.drivers.render import RenderDriver
        from reconciler.oci import OciClient
        from reconciler.registry_credentials import as_pairs
        packages = None  # the OCI client its Compose packages come through
        if "compose" in profile_types(config):
            packages = stack.enter_context(OciClient(credentials=as_pairs(
                config.registry_credentials)))
        return RenderDriver(config.output_dir, charts, oci=packages, drift=drift,
                            injection=injection, key=key, data_dir=config.data_dir)
    from reconciler.drivers.helm import HelmDriver
    return HelmDriver(charts, kubeconfig=config.kubeconfig, kube_context=config.kube_context,
                      storage_driver=config.storage_driver, drift=drift,
                      rollback_on_failure=config.rollback_on_failure, injection=injection,
                      key=key)


def _collector_probe(config: DeviceConfig) -> Callable[[], bool] | bool:
    """`otelCollector` of a host: whether the configured collector answers, probed in the
    background (False when none is configured: there is nothing to find it by)."""
    if config.telemetry is None:
        return False
    from reconciler.telemetry.probe import CollectorWatch
    return CollectorWatch(config.telemetry)


def _telemetry(config: DeviceConfig, stack: ExitStack) -> CycleObserver | None:
    """The client's own metrics and logs (`reconciler.telemetry.export`, which loads the
    OpenTelemetry SDK), or None when no collector is configured or export is off."""
    if config.telemetry is None or not config.telemetry.export:
        return None
    from reconciler.telemetry.export import DeviceTelemetry
    return stack.enter_context(DeviceTelemetry(config.telemetry, device_id=config.device_id))


def capability_provider(config: DeviceConfig,
                        key: DeviceKey | None = None) -> CapabilityProvider | None:
    """The configured provider (None: no capability reports); with `key`, its documents
    carry the device's encryption key (`KeyReporting`)."""
    provider = _provider(config)
    if provider is None or key is None:
        return provider
    return KeyReporting(provider, key.recipient)


def _provider(config: DeviceConfig) -> CapabilityProvider | None:
    if config.capabilities_file is not None:
        return StaticProvider(config.capabilities_file)
    if config.kubernetes is not None:
        from reconciler.kubernetes.provider import KubernetesProvider
        return KubernetesProvider(config.device_id, **config.kubernetes)
    if config.host_facts is None:
        return None
    facts = config.host_facts
    return HostProvider(
        config.device_id, vendor=facts.get("vendor", "unknown"),
        model_number=facts.get("modelNumber", "unknown"),
        serial_number=facts.get("serialNumber", "unknown"),
        deployment_types=list(profile_types(config)),
        otel_collector=_collector_probe(config),
        labels=facts.get("labels"), storage_path=config.data_dir)


@contextmanager
def open_reconciler(config: DeviceConfig) -> Iterator[Reconciler]:
    """Everything a device client needs, opened in order and closed in reverse."""
    with ExitStack() as stack:
        stack.enter_context(exclusive(config.data_dir))
        observer = _telemetry(config, stack)
        state = stack.enter_context(DeviceState(config.data_dir / "device-state.sqlite"))
        key = DeviceKey.open(config.encryption_key)
        servers = ServerList(config.server_urls, failback=config.failback)
        http, client_id = _connect(config, stack, servers)
        # Waiting polls (schedule.wait; off with "0s"): the source asks, the loop paces.
        waiting = WaitingPolls(config.schedule.wait) if config.schedule.wait > 0 else None
        source = _source(config, http, client_id, servers, waiting)
        stack.callback(source.close)
        driver = _driver(config, stack, key)
        stack.callback(driver.close)
        reporter = Reporter(http, state)
        provider = capability_provider(config, key)
        capabilities = CapabilityReporter(http, state, generation=config.api,
                                          device_id=config.device_id,
                                          client_id=client_id)

        def deliver() -> tuple[int, int]:
            result = reporter.deliver()
            return result.delivered, result.remaining

        def report_capabilities() -> str | None:
            """None when reported (or unchanged); otherwise what went wrong, for the cycle's
            result. A broken capabilities file must not stop the device converging."""
            if provider is None:
                return None
            try:
                outcome = capabilities.report(provider.gather())
            except (DocumentError, OSError, ValueError) as exc:
                return str(exc)
            if outcome.kind == "delivered":
                reporter.resume()  # the server is back: queued reports need not wait
            return None if outcome.ok else f"{outcome.kind}: {outcome.status} {outcome.detail}"

        def server_answered() -> None:
            reporter.resume()

        yield Reconciler(state=state, source=source, driver=driver,
                         target=StatusTarget(config.api, config.device_id, client_id),
                         deliver=deliver, report_capabilities=report_capabilities,
                         schedule=config.schedule,
                         server_answered=server_answered if _source_is_the_server(config)
                         else None,
                         injection=config.telemetry.inject if config.telemetry else None,
                         observer=observer, waiting=waiting)
