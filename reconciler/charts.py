"""Helm charts from OCI registries, cached on disk by manifest digest.

Both Helm drivers (`render` and `helm`) start every install or upgrade here: a component's
`repository` (`oci://host[:port]/path/name`) and `revision` (a version tag such as `1.0.0`,
or a manifest digest `sha256:<hex>`) become a local chart archive, pulled with Helm's own
registry client (helm_python).

Caching rules, and why:
- Files are keyed by the OCI manifest digest, so one content is stored once and a file's
  name says exactly what it holds. A digest revision is content-addressed: when its file is
  on disk the registry is never contacted, even by a new process (a device that restarts
  while offline can still reinstall what it ran).
- A tag is resolved to a digest once per `ChartCache` (one process lifetime) and then
  treated as immutable: later fetches of the same (repository, revision) do not touch the
  registry. A new process resolves the tag again, so a re-pushed tag is noticed at restart.
- The chart is pulled *by the digest just resolved*, never by the tag again, so the file
  always matches the digest in its name even if the tag moves in between.
- Files are written to a temporary directory next to the cache and renamed into place, so
  a crash never leaves a truncated archive under a digest name.
- A file on disk is checked before every use. Its name is the OCI *manifest* digest, which
  the archive's bytes cannot be checked against, so each pull records the archive's own
  sha256 beside it (`<hex>.archive-digest`, written before the archive is renamed into
  place). An archive that no longer matches (a bad sector, an edit behind the client's back)
  is removed and pulled again; if the registry cannot be reached the step fails with
  `PULL_FAILED` saying so, and nothing is installed from the damaged file. An archive from
  before this check (no digest beside it) has its digest recorded on first use.

Plain HTTP is used only for the loopback hosts in `plain_http_hosts` (test and demo
registries); everything else is HTTPS.

Private registries: `credentials` (`reconciler.registry_credentials`) are handed to Helm's
registry client as a Docker `config.json` it reads, written with mode 0600 in a private
0700 folder when the cache first contacts a registry and removed by `close()`.

Credentials the fleet granted to the deployment fetching (`fetch(..., granted=)`,
`reconciler.registry_grants`) are used only when the chart's registry is one the device's
own `credentials` do not name (the device's configuration wins): that fetch then talks to
the registry through a registry client of its own, reading a `config.json` that holds the
grant alone (0600, in a fresh 0700 folder), both gone when the fetch returns. A chart
already cached (by digest, or a tag resolved earlier in this process) is content the device
has: another deployment naming it uses it without pulling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from margo.digests import DigestError, digest_of, verify_digest
from margo.files import write_atomically
from reconciler.errors import ApplyError, ErrorCode
from reconciler.helm_engine import helm
from reconciler.registry_credentials import (
    Pairs,
    RegistryCredential,
    docker_config_text,
    private_docker_config,
)

__all__ = ["DEFAULT_PLAIN_HTTP_HOSTS", "ChartCache", "OciReference", "parse_repository"]

DEFAULT_PLAIN_HTTP_HOSTS = frozenset({"127.0.0.1", "localhost"})

log = logging.getLogger("margo.device")

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")
# OCI distribution tag grammar; Helm stores a SemVer `+` as `_` in tags.
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
_PATH = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*\Z")


@dataclass(frozen=True)
class OciReference:
    """A parsed `oci://host[:port]/path/name` repository."""

    host: str  # host[:port], as written
    path: str  # path/name, without the host

    @property
    def hostname(self) -> str:
        """The host without its port (what `plain_http_hosts` lists)."""
        return self.host.rpartition(":")[0] if re.search(r":\d+$", self.host) else self.host

    def tagged(self, tag: str) -> str:
        """`host/path/name:tag`, the form RegistryClient.resolve takes."""
        return f"{self.host}/{self.path}:{tag}"

    def pinned(self, digest: str) -> str:
        """`oci://host/path/name@sha256:...`, the form helm pull takes for a digest."""
        return f"oci://{self.host}/{self.path}@{digest}"


def parse_repository(repository: str) -> OciReference:
    """Split an `oci://` repository; `ApplyError("UNSUPPORTED_REPOSITORY")` otherwise.

    Only OCI is supported because the Margo component properties name OCI repositories and
    because a digest can pin OCI content exactly (HTTP chart repositories cannot)."""
    if not isinstance(repository, str) or not repository.startswith("oci://"):
        raise ApplyError(ErrorCode.UNSUPPORTED_REPOSITORY,
                         f"chart repository {repository!r} is not an oci:// reference; only OCI "
                         "registries are supported", retryable=False)
    host, _, path = repository.removeprefix("oci://").partition("/")
    if not host or not _PATH.match(path):
        raise ApplyError(ErrorCode.UNSUPPORTED_REPOSITORY,
                         f"chart repository {repository!r} is not of the form "
                         "oci://host[:port]/path/name", retryable=False)
    return OciReference(host, path)


def _check_revision(repository: str, revision: str) -> None:
    if _DIGEST.match(revision) or _TAG.match(revision.replace("+", "_")):
        return
    raise ApplyError(ErrorCode.INVALID_REVISION,
                     f"chart revision {revision!r} of {repository} is neither a version tag nor "
                     "a sha256:<64 hex> digest (an empty revision would let the registry pick "
                     "the version, so it is refused)", retryable=False)


class ChartCache:
    """Pulls charts once, keeps them on disk, and hands out loaded charts.

    Thread-safe: fetches are serialised (a device pulls one chart at a time anyway), loaded
    charts are immutable and shared. `close()` frees the registry clients and every loaded
    chart; the cache directory stays."""

    def __init__(self, cache_dir: Path, *,
                 plain_http_hosts: frozenset[str] = DEFAULT_PLAIN_HTTP_HOSTS,
                 credentials: Sequence[RegistryCredential] = ()) -> None:
        self.cache_dir = Path(cache_dir)
        self.plain_http_hosts = plain_http_hosts
        self._credentials = tuple(credentials)
        self._credentials_dir: Path | None = None
        self._blobs = self.cache_dir / "sha256"
        self._fetched: dict[tuple[str, str], Path] = {}
        self._charts: dict[Path, helm.Chart] = {}
        self._clients: dict[bool, helm.RegistryClient] = {}
        self._fetch_lock = threading.Lock()
        self._load_lock = threading.Lock()

    def fetch(self, repository: str, revision: str, *, granted: Pairs | None = None) -> Path:
        """The local `.tgz` of `repository` at `revision` (a tag or a `sha256:` digest).
        `granted`: the credentials granted to the deployment fetching (`{host: (user,
        password)}`), for this fetch only (see the module docstring).

        Raises `ApplyError`: `UNSUPPORTED_REPOSITORY` / `INVALID_REVISION` (not retryable)
        for references we cannot pull, `PULL_FAILED` (retryable, Helm's message) when the
        registry is down or does not have the chart."""
        reference = parse_repository(repository)
        _check_revision(repository, revision)
        key = (repository, revision)
        with self._fetch_lock, contextlib.ExitStack() as stack:
            known = self._fetched.get(key)
            if known is not None and _intact(known):
                return known
            plain_http = reference.hostname in self.plain_http_hosts
            client = _Lazy(lambda: self._client_for(reference.host, granted, plain_http, stack))
            digest = revision if _DIGEST.match(revision) else self._resolve(
                reference, revision, client())
            target = self._blobs / f"{digest.removeprefix('sha256:')}.tgz"
            damaged = target.is_file() and not _intact(target)
            if damaged or not target.is_file():
                try:
                    self._pull(reference, digest, target, client(), plain_http=plain_http)
                except ApplyError as exc:
                    if damaged:
                        raise ApplyError(exc.code, f"the cached chart {target} was damaged and "
                                         f"has been removed; {exc.message}",
                                         retryable=exc.retryable) from exc
                    raise
            self._fetched[key] = target
            return target

    def load(self, path: Path) -> helm.Chart:
        """The chart in `path`, loaded once and shared (loading costs more than rendering).

        Raises `ApplyError("CHART_INVALID", ...)` (not retryable) for a file Helm cannot
        read as a chart."""
        path = Path(path).resolve()
        with self._load_lock:
            chart = self._charts.get(path)
            if chart is None:
                try:
                    chart = helm.Chart.load(path)
                except helm.HelmError as exc:
                    raise ApplyError(ErrorCode.CHART_INVALID,
                                     f"{path}: {exc}", retryable=False) from exc
                self._charts[path] = chart
            return chart

    def close(self) -> None:
        """Free loaded charts and registry clients (native handles)."""
        with self._load_lock:
            for chart in self._charts.values():
                chart.close()
            self._charts.clear()
        with self._fetch_lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
            if self._credentials_dir is not None:
                shutil.rmtree(self._credentials_dir, ignore_errors=True)
                self._credentials_dir = None

    def __enter__(self) -> ChartCache:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # --- registry access (caller holds _fetch_lock) ------------------------------------

    def _client(self, plain_http: bool) -> helm.RegistryClient:
        client = self._clients.get(plain_http)
        if client is None:
            client = helm.RegistryClient(plain_http=plain_http,
                                         credentials_file=self._credentials_file())
            self._clients[plain_http] = client
        return client

    def _client_for(self, host: str, granted: Pairs | None, plain_http: bool,
                    stack: contextlib.ExitStack) -> helm.RegistryClient:
        """The shared client, or for a host granted to the deployment fetching (and not in
        the device's own credentials) one reading that grant alone, closed and removed with
        its file by `stack` (the end of the fetch)."""
        grant = (granted or {}).get(host)
        if grant is None or any(c.registry == host for c in self._credentials):
            return self._client(plain_http)
        folder = stack.enter_context(private_docker_config(
            (), granted={host: grant}, prefix="margo-helm-registry-"))
        client = helm.RegistryClient(plain_http=plain_http,
                                     credentials_file=folder / "config.json")
        stack.callback(client.close)
        return client

    def _credentials_file(self) -> Path | None:
        """The private config.json with our registry credentials (None without any)."""
        if not self._credentials:
            return None
        if self._credentials_dir is None:
            try:
                text = docker_config_text(self._credentials)
            except OSError as exc:
                raise ApplyError(ErrorCode.PULL_FAILED, str(exc)) from exc
            folder = Path(tempfile.mkdtemp(prefix="margo-helm-registry-"))
            descriptor = os.open(folder / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(text)
            self._credentials_dir = folder
        return self._credentials_dir / "config.json"

    def _resolve(self, reference: OciReference, tag: str, client: helm.RegistryClient) -> str:
        ref = reference.tagged(tag.replace("+", "_"))
        try:
            digest = str(client.resolve(ref)["digest"])
        except helm.HelmError as exc:
            raise ApplyError(ErrorCode.PULL_FAILED, f"cannot resolve oci://{ref}: {exc}") from exc
        if not _DIGEST.match(digest):
            raise ApplyError(ErrorCode.PULL_FAILED,
                             f"registry answered an unusable digest {digest!r} "
                             f"for oci://{ref}")
        return digest

    def _pull(self, reference: OciReference, digest: str, target: Path,
              client: helm.RegistryClient, *, plain_http: bool) -> None:
        ref = reference.pinned(digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".pull-", dir=self.cache_dir))
        try:
            try:
                helm.pull(ref, client=client, destination=staging, plain_http=plain_http)
            except helm.HelmError as exc:
                raise ApplyError(ErrorCode.PULL_FAILED, f"cannot pull {ref}: {exc}") from exc
            archives = sorted(staging.glob("*.tgz"))
            if len(archives) != 1:
                raise ApplyError(ErrorCode.PULL_FAILED, f"pulling {ref} gave {len(archives)} chart "
                                 "archives instead of one")
            # Helm verified the archive against the manifest; remember its digest first, so
            # an archive under the target name always has its digest beside it.
            write_atomically(_digest_file(target), digest_of(archives[0].read_bytes()) + "\n")
            archives[0].replace(target)
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(staging)


class _Lazy:
    """A registry client made on first use (a fetch served from the disk needs none)."""

    def __init__(self, make: Callable[[], helm.RegistryClient]) -> None:
        self._make = make
        self._client: helm.RegistryClient | None = None

    def __call__(self) -> helm.RegistryClient:
        if self._client is None:
            self._client = self._make()
        return self._client


def _digest_file(archive: Path) -> Path:
    """Where the digest of `archive`'s bytes, recorded when it was pulled, is kept."""
    return archive.with_name(archive.name.removesuffix(".tgz") + ".archive-digest")


def _intact(archive: Path) -> bool:
    """Whether a cached archive still has the bytes it was pulled with. A damaged one is
    removed (with its digest), so the caller pulls it again; one cached before digests were
    recorded gets its digest recorded now (it was renamed into place whole)."""
    try:
        data = archive.read_bytes()
    except OSError:
        return False
    recorded = _digest_file(archive)
    try:
        expected = recorded.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        write_atomically(recorded, digest_of(data) + "\n")
        return True
    except (OSError, UnicodeDecodeError):
        expected = ""
    try:
        verify_digest(data, expected)
    except DigestError as exc:
        log.warning("the cached chart %s is damaged (%s); pulling it again", archive, exc)
        for path in (archive, recorded):
            with contextlib.suppress(OSError):
                path.unlink()
        return False
    return True
