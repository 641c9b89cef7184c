"""`margo serve`: the fleet server, in development (plain HTTP, bearer tokens) or with the
Margo identity profile (mutual TLS with SPIFFE SVIDs, rc.2 signed requests).

The operator commands for clients and trust bundles are in `identity_command`.
"""

from __future__ import annotations

import argparse
import logging
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wfm.fleet.compiles import SourceConfig

__all__ = ["CLIENT_CERT_MODES", "ONBOARDING_MODES", "identity_settings", "register", "run_serve"]

if TYPE_CHECKING:  # the server's modules load only when it runs: `margo --help` stays fast
    from margo.spiffe import SpiffeId
    from wfm.identity.proofs import IdentitySettings
    from wfm.identity.tls import TlsSettings

CLIENT_CERT_MODES = ("required", "optional", "none")  # wfm.identity.tls.CLIENT_CERT_MODES
ONBOARDING_MODES = ("open", "closed")  # wfm.identity.proofs.ONBOARDING_MODES
#: Seconds an idle keep-alive connection stays open by default: longer than the polling
#: intervals devices commonly use (the client's default is 30 s), as nginx's 75 s. A timeout
#: equal to a device's interval closes connections just as the device reuses them (uvicorn's
#: own default, 5 s, did that to devices polling every 5 s).
DEFAULT_KEEP_ALIVE = 75
#: Connections served at once by default. Every device polling more often than the
#: keep-alive timeout holds a connection between polls, so a fleet of 10,000 such devices
#: holds about 10,000 (with uvicorn's 5 s timeout, polling every 15 s: about 3,500); each
#: idle one costs the server about 9 KiB.
DEFAULT_MAX_CONNECTIONS = 16384
DEFAULT_MAX_DEVICES_PER_CLIENT = 100_000  # wfm.http.device_api.DEFAULT_MAX_DEVICES_PER_CLIENT


def register(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run the Workload Fleet Manager server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--data", default="wfm-data", metavar="DIR",
                       help="state directory: wfm.sqlite and repos/ (default: ./wfm-data)")
    serve.add_argument("--database", metavar="URL",
                       help="postgresql://... : keep everything in PostgreSQL, shared by any "
                            "number of replicas (each with its own --data); default: "
                            "<data>/wfm.sqlite, one server (docs/operations.md)")
    _source_options(serve)
    serve.add_argument("--webhook-secret-file", metavar="FILE",
                       help="file holding the shared secret of POST /hooks/git")
    serve.add_argument("--admin-token-file", metavar="FILE",
                       help="file holding a token of the admin role (operators with other "
                            "roles: margo operators add; docs/operations.md)")
    _observability_options(serve)
    serve.add_argument("--max-devices-per-client", type=int,
                       default=DEFAULT_MAX_DEVICES_PER_CLIENT, metavar="N",
                       help="the most devices one client may register (default "
                            f"{DEFAULT_MAX_DEVICES_PER_CLIENT:,}); a new one beyond is 403")
    serve.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a request body must arrive within SECONDS of its headers, "
                            "else 408 (default 30; Git requests at least 300)")
    serve.add_argument("--header-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a connection must send a request's headers within SECONDS "
                            "(of connecting, or of the request's first byte), else it is "
                            "closed (default 30)")
    serve.add_argument("--keep-alive", type=int, default=DEFAULT_KEEP_ALIVE,
                       metavar="SECONDS",
                       help="close a keep-alive connection idle for SECONDS (default "
                            f"{DEFAULT_KEEP_ALIVE}: longer than devices' polling intervals, "
                            "so their connections are not closed just as they are reused)")
    serve.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       metavar="N",
                       help="connections served at once (idle keep-alive ones count); a "
                            "request on one more is answered 503 and its connection closed "
                            f"(default {DEFAULT_MAX_CONNECTIONS}; keep it below ulimit -n)")
    _waiting_options(serve)
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--new-database", action="store_true",
                       help="start on a new, empty <data>/wfm.sqlite although <data> was used "
                            "before (its database lost): no clients, manifestVersions start "
                            "over (docs/operations.md, 'Damaged state')")
    _identity_options(serve)
    _operator_options(serve)
    _budget_options(serve)
    serve.set_defaults(run=run_serve)


def _observability_options(serve: argparse.ArgumentParser) -> None:
    """What the server tells about the fleet: metrics, traces, freshness."""
    serve.add_argument("--metrics-token-file", metavar="FILE",
                       help="file holding a bearer token that may read GET /metrics (a "
                            "Prometheus scraper's); the operator token may too; with neither "
                            "file, /metrics is open (docs/observability.md)")
    serve.add_argument("--otlp-endpoint", metavar="URL",
                       help="send OpenTelemetry spans of each change (push, compile, each "
                            "device's adoption and report) to this OTLP/HTTP endpoint, e.g. "
                            "http://collector:4318 (default: no tracing)")
    serve.add_argument("--stale-polls", type=float, default=3, metavar="N",
                       help="a device that has not been heard from for N of its polling "
                            "intervals is stale (default 3; 15 minutes until its interval "
                            "is known)")
    serve.add_argument("--metrics-cache-seconds", type=float, default=5.0,
                       metavar="S",
                       help="how long one computation of the fleet's gauges on GET /metrics "
                            "answers scrapes (default 5; it reads the whole fleet: about 30 "
                            "ms of CPU per 1,000 devices)")
    serve.add_argument("--compile-debounce", type=float, default=0.3, metavar="SECONDS",
                       help="how long a compile waits for more of a burst of changes, "
                            "such as a rebooting site's capability reports (default 0.3); "
                            "a push to the hosted source, a webhook's fetch and an "
                            "operator's rollout action never wait it")


#: `margo serve --max-wait` and `--max-waiters` defaults (wfm.fleet.waiters).
DEFAULT_MAX_WAIT = 60
DEFAULT_MAX_WAITERS = 15_000


def _waiting_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "waiting polls", "a device's conditional poll with 'Prefer: wait=N' is held until its "
        "desired state changes or N seconds pass (docs/server.md, 'Waiting polls')")
    group.add_argument("--max-wait", type=float, default=DEFAULT_MAX_WAIT, metavar="SECONDS",
                       help=f"the longest a poll is held (default {DEFAULT_MAX_WAIT}; 0: none "
                            "is held); proxies in front need idle timeouts above it")
    group.add_argument("--max-waiters", type=int, default=DEFAULT_MAX_WAITERS, metavar="N",
                       help="polls held at once; one more is answered at once, as a plain "
                            f"poll (default {DEFAULT_MAX_WAITERS:,}; keep it below "
                            "--max-connections)")


def _source_options(serve: Any) -> None:
    """Where the fleet source comes from, and the key that opens its secrets."""
    serve.add_argument("--source", metavar="SRC", help="fleet source directory or Git repo")
    serve.add_argument("--ref", help="Git ref of the fleet source")
    serve.add_argument("--watch-source", action="store_true",
                       help="recompile when files under --source change (development)")
    serve.add_argument("--source-url", metavar="URL",
                       help="remote fleet source repository, fetched on verified push hooks")
    serve.add_argument("--source-branch", default="main", metavar="BRANCH")
    serve.add_argument("--fleet-key", metavar="FILE",
                       help="the fleet key (an age identity file, mode 600, outside every "
                            "repository) that opens the intents' secrets (docs/secrets.md)")
    serve.add_argument("--host-source", action="store_true",
                       help="host the fleet source at /git/source.git (push with the operator "
                            "token); pushes to --source-branch recompile")


def _operator_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "operators", "who may read and change the fleet through the read API, the dashboard, "
        "/metrics and the hosted source: --admin-token-file, `margo operators`, and OIDC "
        "(docs/operations.md, 'Operators and roles')")
    group.add_argument("--oidc-issuer", metavar="URL",
                       help="accept bearer JWTs of this OpenID Connect issuer (https://; "
                            "its keys come from its discovery document)")
    group.add_argument("--oidc-audience", metavar="AUD",
                       help="the audience (aud) the issuer's tokens must name")
    group.add_argument("--oidc-role-claim", default="groups", metavar="CLAIM",
                       help="the claim (a string or a list) that maps to a role "
                            "(default: groups)")
    group.add_argument("--oidc-role", action="append", default=[], metavar="VALUE=ROLE",
                       help="a claim value and the role it gives: viewer, operator or admin "
                            "(repeatable; the highest matching role counts; none: 403)")
    group.add_argument("--audit-retention-days", type=float, default=365, metavar="DAYS",
                       help="keep audit trail entries this many days (default 365)")


def _oidc(args: argparse.Namespace) -> Any:
    """The OIDC settings of the options (None without --oidc-issuer), with the other
    operator options checked."""
    from wfm.identity.oidc import OidcSettings, parse_role_mapping

    if args.audit_retention_days <= 0:
        raise ValueError("--audit-retention-days must be positive")
    if args.oidc_issuer is None:
        if args.oidc_audience or args.oidc_role:
            raise ValueError("--oidc-audience and --oidc-role need --oidc-issuer")
        return None
    return OidcSettings(args.oidc_issuer, args.oidc_audience or "",
                        parse_role_mapping(args.oidc_role), role_claim=args.oidc_role_claim)


#: `margo serve --budget-*` defaults, MiB (wfm.admission.budgets.BudgetSettings).
BUDGET_DEFAULTS = {"webhook": 64, "anonymous": 16, "device": 128, "push": 128, "git": 128,
                   "per-address": 32}
_BUDGET_HELP = {
    "webhook": "POST /hooks/git bodies (GitHub's largest is 25)",
    "anonymous": "onboarding, OAuth token and other unauthenticated device API bodies",
    "device": "authenticated device API bodies (capability and status reports)",
    "push": "pushes to the hosted source (--host-source)",
    "git": "device Git requests",
}


def _budget_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "request body budgets", "MiB of request bodies held at once; past a budget a body is "
        "refused before it is read (503, or 429 for one address, with Retry-After); see "
        "docs/operations.md")
    for name, what in _BUDGET_HELP.items():
        group.add_argument(f"--budget-{name}", type=int, default=BUDGET_DEFAULTS[name],
                           metavar="MIB", help=f"{what} (default {BUDGET_DEFAULTS[name]})")
    group.add_argument("--budget-per-address", type=int,
                       default=BUDGET_DEFAULTS["per-address"], metavar="MIB",
                       help="bodies from one client address, over all routes; one body alone "
                            "is always admitted; 0: no limit (behind a proxy every client "
                            f"has its address) (default {BUDGET_DEFAULTS['per-address']})")


def _identity_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "identity", "mutual TLS with SPIFFE X.509-SVIDs (rc.3), signed requests (rc.2), "
        "tokens (development); see docs/identity.md")
    group.add_argument("--tls-cert", metavar="FILE",
                       help="the WFM's SVID (PEM, leaf then intermediates): serve HTTPS")
    group.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert")
    group.add_argument("--trust-bundle", metavar="FILE",
                       help="client trust anchors (PEM or SPIFFE bundle JSON), re-read when "
                            "the file changes (default: <data>/trust/bundle.pem if present)")
    group.add_argument("--trust-domain", metavar="TD",
                       help="SPIFFE trust domain (default: from the --tls-cert SVID)")
    group.add_argument("--wfm-id", metavar="ID",
                       help="this WFM's id in SPIFFE IDs (default: from the --tls-cert SVID)")
    group.add_argument("--accept-clients", action="append", default=[], metavar="IDS",
                       help="client ids accepted besides the registered ones (comma-separated, "
                            "repeatable), or '*' for the whole .../client/* namespace")
    group.add_argument("--client-cert", choices=CLIENT_CERT_MODES, default="required",
                       help="with --trust-bundle: 'required' refuses a TLS handshake without "
                            "a client certificate; 'optional' lets rc.2, token and dashboard "
                            "callers in on the same port (the rc.3 API still needs an SVID)")
    group.add_argument("--tls12", action="store_true",
                       help="also accept TLS 1.2 (the RFC 9325 fallback; default TLS 1.3 only)")
    group.add_argument("--trusted-proxy", action="append", default=[], metavar="ADDR",
                       help="address or network of a TLS-terminating proxy whose RFC 9440 "
                            "Client-Cert header is honoured (repeatable); stripped from others")
    group.add_argument("--bearer-tokens", choices=("on", "off"),
                       help="accept bearer tokens (default: on without TLS, i.e. development, "
                            "off with --tls-cert)")
    group.add_argument("--signature-window", type=float, default=300.0, metavar="SECONDS",
                       help="how old an rc.2 signature's 'created' may be (default 300)")
    group.add_argument("--onboarding", choices=ONBOARDING_MODES, default="open",
                       help="rc.2 onboarding of keys the operator did not import (default open)")


def run_serve(args: argparse.Namespace) -> int:
    from wfm.admission.bodylimit import head_deadline_protocol
    from wfm.identity.tls import ServerContexts, TlsHttpProtocol
    from wfm.server.app import ServerConfig, create_app
    from wfm.server.datalock import DataDirBusy, DataDirLock
    from wfm.server.onewrite import one_write_protocol
    from wfm.server.serving import serve
    from wfm.server.wire import wire_protocol

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_limits(args)
    source = SourceConfig(Path(args.source).resolve() if args.source else None, args.ref,
                          fleet_key=_fleet_key(args.fleet_key))
    data = Path(args.data).resolve()
    try:
        tls, identity = identity_settings(args, data)
        contexts = ServerContexts(tls) if tls is not None else None
        oidc = _oidc(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        raise SystemExit(f"margo serve: {exc}") from None
    used = () if args.database or args.new_database else _used_before(data)
    lock = DataDirLock(data)
    try:
        lock.acquire(listening=f"{args.host}:{args.port}")
    except DataDirBusy as exc:
        raise SystemExit(f"margo serve: {exc}") from None
    if not args.database:
        _check_database(data / "wfm.sqlite", used)
    app = create_app(ServerConfig(
        data, source, source_url=args.source_url,
        source_branch=args.source_branch, watch_source=args.watch_source,
        host_source=args.host_source,
        webhook_secret=_secret(args.webhook_secret_file),
        admin_token=_secret(args.admin_token_file), identity=identity, data_lock=lock,
        database_url=_database(args.database), stale_polls=args.stale_polls,
        metrics_cache_seconds=args.metrics_cache_seconds,
        max_devices_per_client=args.max_devices_per_client,
        body_timeout=args.body_timeout, budgets=_budgets(args),
        metrics_token=_secret(args.metrics_token_file), otlp_endpoint=_otlp(args.otlp_endpoint),
        oidc=oidc, audit_retention_days=args.audit_retention_days,
        max_wait=args.max_wait, max_waiters=args.max_waiters,
        debounce=args.compile_debounce))
    transport: dict[str, Any] = {}
    if contexts is not None:
        transport = {"http": TlsHttpProtocol, "ssl_context_factory": contexts.uvicorn_factory()}
    # A deadline for a request's head (wfm.admission.bodylimit), a waiting device's renewal
    # answered below the request cycle (wfm.server.wire), an answer's head and body in one
    # write (wfm.server.onewrite).
    protocol = head_deadline_protocol(transport.get("http"), args.header_timeout)
    if protocol is not None:
        transport["http"] = one_write_protocol(wire_protocol(protocol))
    # uvicorn answers 503 to a request once connections (this one included) or requests
    # in flight reach its limit: one more than ours lets exactly N connections be served.
    # Held waiting polls are answered first when it stops (wfm.server.serving).
    serve(app, release=app.state.waiters.close, host=args.host, port=args.port,
          log_level=args.log_level, proxy_headers=False, server_header=False,
          limit_concurrency=args.max_connections + 1, timeout_keep_alive=args.keep_alive,
          **transport)
    return 0


def _check_limits(args: argparse.Namespace) -> None:
    """The numeric options, before anything starts."""
    if args.max_devices_per_client < 1:
        raise SystemExit("margo serve: --max-devices-per-client must be at least 1")
    if not 0 <= args.max_wait <= 3600 or args.max_waiters < 0:
        raise SystemExit("margo serve: --max-wait must be 0 to 3600 seconds and "
                         "--max-waiters at least 0")
    if args.max_connections < 1:
        raise SystemExit("margo serve: --max-connections must be at least 1")
    if args.keep_alive < 1:
        raise SystemExit("margo serve: --keep-alive must be at least 1 second")
    if not 0 <= args.metrics_cache_seconds <= 3600:  # (NaN is neither)
        raise SystemExit("margo serve: --metrics-cache-seconds must be 0 to 3600 seconds")
    if not 0 <= args.compile_debounce <= 600:
        raise SystemExit("margo serve: --compile-debounce must be 0 to 600 seconds")


def identity_settings(args: argparse.Namespace,
                      data: Path) -> tuple[TlsSettings | None, IdentitySettings]:
    """TLS and identity settings from the options, checked against each other: the trust
    domain and WFM id default to those of the WFM's own SVID and must agree with it."""
    from wfm.identity.proofs import IdentitySettings
    from wfm.identity.tls import TlsSettings

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    bundle = Path(args.trust_bundle) if args.trust_bundle else data / "trust" / "bundle.pem"
    trust_bundle = bundle if args.trust_bundle or bundle.exists() else None
    trust_domain, wfm = args.trust_domain, args.wfm_id
    tls = None
    if args.tls_cert:
        own = _own_svid(Path(args.tls_cert))
        if own is not None:
            trust_domain, wfm = _agree(own, trust_domain, wfm)
        tls = TlsSettings(Path(args.tls_cert), Path(args.tls_key), trust_bundle,
                          args.client_cert, args.tls12)
    accept = tuple(i.strip() for item in args.accept_clients for i in item.split(",")
                   if i.strip())
    if (accept or args.trusted_proxy) and not (trust_domain and wfm):
        raise ValueError("--accept-clients and --trusted-proxy need --trust-domain and "
                         "--wfm-id (or a --tls-cert SVID that names them)")
    if args.trusted_proxy and trust_bundle is None:
        raise ValueError("--trusted-proxy needs --trust-bundle to verify forwarded certificates")
    if args.signature_window <= 0:
        raise ValueError("--signature-window must be positive")
    tokens = (args.bearer_tokens == "on") if args.bearer_tokens else tls is None
    identity = IdentitySettings(
        trust_domain=trust_domain, wfm_id=wfm, accept_clients=accept,
        trusted_proxies=tuple(args.trusted_proxy), trust_bundle=trust_bundle,
        bearer_tokens=tokens, signature_window=args.signature_window,
        onboarding=args.onboarding)
    return tls, identity


def _own_svid(path: Path) -> SpiffeId | None:
    """The SPIFFE ID of the WFM's certificate, None when it is not an SVID (allowed: plain
    server TLS, but then devices following MIAF will refuse it; a warning says so)."""
    from cryptography import x509

    from margo.spiffe import SvidError, svid_spiffe_id

    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as exc:
        raise ValueError(f"{path}: not a PEM certificate ({exc})") from None
    try:
        return svid_spiffe_id(cert)
    except SvidError as exc:
        logging.getLogger("margo.wfm").warning("%s is not a WFM SVID (%s); MIAF devices will "
                                               "refuse this server", path, exc)
        return None


def _agree(own: SpiffeId, trust_domain: str | None, wfm: str | None) -> tuple[str, str]:
    segments = own.segments
    if len(segments) != 3 or segments[:2] != ("margo", "wfm"):
        raise ValueError(f"the --tls-cert SVID {own} is not a WFM ID "
                         "(spiffe://<td>/margo/wfm/<wfm-id>)")
    if trust_domain not in (None, own.trust_domain) or wfm not in (None, segments[2]):
        raise ValueError(f"the --tls-cert SVID is {own}, not spiffe://{trust_domain or '*'}"
                         f"/margo/wfm/{wfm or '*'}")
    return own.trust_domain, segments[2]


#: What a data directory holds once a server ran on it (beside `wfm.sqlite`).
_SERVED_MARKS = ("serve.lock", "repos/fleet-state.git", "repos/compiler-state.sqlite", "ca",
                 "hosted-source.git", "source.git")


def _used_before(data: Path) -> tuple[str, ...]:
    """What in `data` shows a server ran there: its database cannot be missing by design."""
    return tuple(mark for mark in _SERVED_MARKS if (data / mark).exists())


def _check_database(path: Path, used_before: tuple[str, ...]) -> None:
    """Refuse to start on a damaged or lost SQLite database (`wfm.store.sqlitedb.check_sqlite_file`)
    with what happened and what to do, before anything else opens it."""
    from wfm.store.sqlitedb import DatabaseDamaged, check_sqlite_file

    try:
        check_sqlite_file(path, used_before=used_before)
    except DatabaseDamaged as exc:
        raise SystemExit(f"margo serve: {exc}") from None


def _database(url: str | None) -> str | None:
    from wfm.store.opening import is_url

    if url is not None and not is_url(url):
        raise SystemExit(f"margo serve: --database must be a postgresql:// URL (SQLite is "
                         f"the default, in --data), found {url!r}")
    if url is not None:
        from wfm.store.pgdb import url_problem  # psycopg only where PostgreSQL is used

        problem = url_problem(url)
        if problem is not None:
            raise SystemExit(f"margo serve: --database is not a usable PostgreSQL URL: "
                             f"{problem}")
    return url


def _otlp(url: str | None) -> str | None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise SystemExit(f"margo serve: --otlp-endpoint must be an http:// or https:// URL "
                         f"(OTLP/HTTP, e.g. http://127.0.0.1:4318), found {url!r}")
    return url


def _budgets(args: argparse.Namespace) -> Any:
    """The `--budget-*` options as `wfm.admission.budgets.BudgetSettings` (in bytes)."""
    from wfm.admission.budgets import MIB, BudgetSettings

    try:
        return BudgetSettings(
            webhook=args.budget_webhook * MIB, anonymous=args.budget_anonymous * MIB,
            device=args.budget_device * MIB, push=args.budget_push * MIB,
            git=args.budget_git * MIB, per_address=args.budget_per_address * MIB)
    except ValueError as exc:
        raise SystemExit(f"margo serve: {exc} (--budget-* are MiB)") from None


def _fleet_key(path: str | None) -> Path | None:
    """The fleet key's path, checked now so a missing or unsafe key stops the start."""
    if path is None:
        return None
    from compiler.secrets import FleetKey, SecretError
    resolved = Path(path).resolve()
    try:
        FleetKey.load(resolved)
    except (OSError, SecretError) as exc:
        raise SystemExit(f"margo serve: --fleet-key: {exc}") from None
    return resolved


def _secret(path: str | None) -> str | None:
    """Secrets come from files (never the command line, which other users can read)."""
    if path is None:
        return None
    value = Path(path).read_text(encoding="utf-8").strip()
    if not value:
        raise SystemExit(f"margo serve: {path} is empty")
    return value
