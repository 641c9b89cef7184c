"""Desired state from the Margo REST State Manifest (rc.3 `/api/v1`, rc.2 `/api/v1/clients/<id>`).

The spec's client algorithm, with nothing trusted before it is verified:

1. poll the manifest with the adopted ETag; 304 means unchanged (one request, nothing else).
   When a stored copy of an adopted document is damaged (`Adopted.damaged`), the poll goes
   without `If-None-Match`: "unchanged" would leave the device nothing usable to apply;
2. the manifest's ETag must be the digest of its exact body, its `manifestVersion` must be
   greater than the adopted one (rollback protection; the adopted manifest itself, the very
   same bytes by its ETag, is no rollback), every digest must use a supported algorithm and
   every URL must be a path on this server;
3. documents already adopted are reused by digest; the rest come from the bundle (first sync,
   or when most documents changed) or one by one;
4. every byte is checked against its digest before it is parsed, and every document must be
   a valid ApplicationDeployment whose id is the one the manifest names.

With waiting polls (`reconciler.sources.waiting`), step 1 also asks the server to hold the
conditional poll until the manifest changes (`Prefer: wait=N`); the answer is then read as
any other.

Any failure raises and returns nothing, so the device keeps its previous state: an update
is used whole or not at all. A 404 for a document is never read as a deletion (the server
may have compiled in between); only absence from a verified manifest removes a deployment.
"""

from __future__ import annotations

import tarfile
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from margo import jsonstrict
from margo import models as m
from margo.archive import read_targz
from margo.digests import DigestError, digest_of, parse_digest, verify_digest
from margo.errors import DocumentError
from margo.kinds import Kind
from margo.validation import validate_value
from reconciler.desired import DesiredDeployment, DesiredState, parse_deployment
from reconciler.errors import ErrorCode
from reconciler.http_answers import parse_retry_after, problem_of
from reconciler.sources import Adopted, IntegrityError, SourceError
from reconciler.sources.http_errors import translated
from reconciler.sources.waiting import Interrupted, WaitingPolls

__all__ = ["MANIFEST_MEDIA_TYPE", "MAX_RESPONSE_BYTES", "RestSource"]

MANIFEST_MEDIA_TYPE = "application/vnd.margo.manifest.v1+json"
#: The largest body (after Content-Encoding is removed) accepted for any one response: a
#: misbehaving server must not be able to exhaust the device's memory.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024

_NON_RETRYABLE = {401: ErrorCode.UNAUTHORIZED, 403: ErrorCode.FORBIDDEN}
_THROTTLED = frozenset({429, 503})
#: A waiting poll that ended with one of these got no answer (`WaitingPolls.cut`).
_CUT = frozenset({ErrorCode.UNREACHABLE, "HTTP_502", "HTTP_503", "HTTP_504"})


@dataclass(frozen=True)
class _Response:
    """What a verified-to-be-2xx/304 response leaves us: status, headers, exact body bytes."""

    status: int
    headers: httpx.Headers
    body: bytes


class RestSource:
    """The device's view of the REST State Manifest, as a `Source`.

    `client` is built and owned by the caller (base URL, credentials, timeouts, TLS), who
    may share it (status reports use the same one) and closes it. `prefix` is `/api/v1`
    (rc.3) or `/api/v1/clients/<clientId>` (rc.2).

    The manifest is per client, not per device: a client fronting several devices (a
    gateway) sees all their deployments. With `device_id` set, only deployments whose
    `metadata.deviceId` is that device (or absent, as in older shapes) are kept; without it
    every deployment is kept. With `waiting`, conditional polls ask to be held
    (`reconciler.sources.waiting`).
    """

    name = "margo-rest"

    def __init__(self, client: httpx.Client, *, prefix: str = "/api/v1",
                 device_id: str | None = None, waiting: WaitingPolls | None = None) -> None:
        self._client = client
        self._prefix = prefix.rstrip("/")
        self._device_id = device_id
        self._waiting = waiting

    # --- the Source protocol -----------------------------------------------------------------

    def fetch(self, adopted: Adopted) -> DesiredState | None:
        """The verified new desired state, or None when the manifest is unchanged (304).

        Raises `IntegrityError` for anything that must not be used and `SourceError` for
        everything else (never an httpx exception)."""
        headers = {"Accept": MANIFEST_MEDIA_TYPE}
        if adopted.etag and not adopted.damaged:
            headers["If-None-Match"] = adopted.etag
        try:
            response = self._poll(headers)
        except Interrupted:
            return None  # the client is stopping: nothing changed
        if response.status == 304:
            if adopted.damaged:  # we did not ask for this: never "unchanged" while damaged
                raise SourceError(ErrorCode.BAD_RESPONSE, "the manifest: HTTP 304 to a request "
                                  "without If-None-Match")
            return None
        etag = _verified_etag(response)
        if etag == adopted.etag and not adopted.damaged:
            return None  # the adopted manifest, byte for byte (a server ignoring If-None-Match)
        manifest = _parse_manifest(response.body)
        _check_manifest(manifest, adopted, etag)
        documents = self._documents(manifest, adopted)
        deployments = [_parse_document(ref, documents[ref.digest])
                       for ref in manifest.deployments]
        kept = tuple(d for d in deployments if self._wanted(d))
        return DesiredState(source=self.name, version=str(manifest.manifest_version),
                            manifest_version=manifest.manifest_version, etag=etag,
                            deployments=kept)

    def close(self) -> None:
        """Nothing to release: the HTTP client belongs to the caller."""

    def __enter__(self) -> RestSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- documents ---------------------------------------------------------------------------

    def _wanted(self, deployment: DesiredDeployment) -> bool:
        """A deployment for this device (see the class docstring)."""
        return (self._device_id is None or deployment.device_id is None
                or deployment.device_id == self._device_id)

    def _documents(self, manifest: m.StateManifest, adopted: Adopted) -> dict[str, bytes]:
        """The exact bytes of every listed document, by digest: adopted ones reused (after
        re-checking their digest, so a corrupted local copy is fetched again), the others
        from the bundle or one request each, whichever the manifest makes cheaper."""
        documents: dict[str, bytes] = {}
        missing: dict[str, m.DeploymentRef] = {}
        for ref in manifest.deployments:
            known = adopted.documents.get(ref.digest)
            if known is not None and digest_of(known) == ref.digest:
                documents[ref.digest] = known
            else:
                missing.setdefault(ref.digest, ref)
        if not missing:
            return documents
        if manifest.bundle is not None and _bundle_is_cheaper(adopted, len(missing), manifest):
            documents.update(self._from_bundle(manifest.bundle, manifest.deployments))
            return documents
        for ref in missing.values():
            response = self._get(ref.url, f"deployment {ref.deployment_id}")
            _verify(response.body, ref.digest, f"deployment {ref.deployment_id} ({ref.url})")
            documents[ref.digest] = response.body
        return documents

    def _from_bundle(self, bundle: m.BundleRef,
                     listed: Iterable[m.DeploymentRef]) -> dict[str, bytes]:
        """The bundle's members by digest. Members are matched to the manifest by digest,
        never by file name (the spec leaves names open), and must be exactly the listed
        set: a missing or an extra document means the bundle is not this manifest's."""
        response = self._get(bundle.url, "the bundle")
        _verify(response.body, bundle.digest, f"the bundle ({bundle.url})")
        try:
            members = read_targz(response.body)
        except (ValueError, tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            raise IntegrityError(ErrorCode.INVALID_BUNDLE, f"the bundle {bundle.url} cannot be "
                                 f"read safely: {exc}") from None
        by_digest = {digest_of(data): data for data in members.values()}
        wanted = {ref.digest for ref in listed}
        unlisted = sorted(name for name, data in members.items()
                          if digest_of(data) not in wanted)
        if unlisted:
            raise IntegrityError(ErrorCode.INVALID_BUNDLE,
                                 f"the bundle {bundle.url} holds documents "
                                 f"the manifest does not list: {', '.join(unlisted)}")
        absent = sorted(ref.deployment_id for ref in listed if ref.digest not in by_digest)
        if absent:
            raise IntegrityError(ErrorCode.INVALID_BUNDLE, f"the bundle {bundle.url} lacks listed "
                                 f"deployments: {', '.join(absent)}")
        return by_digest

    # --- HTTP --------------------------------------------------------------------------------

    def _poll(self, headers: dict[str, str]) -> _Response:
        """The manifest poll: held by the server when it is conditional and waiting polls
        are on (`reconciler.sources.waiting`)."""
        url = f"{self._prefix}/deployments"
        waiting = self._waiting
        if waiting is None or "If-None-Match" not in headers or not waiting.wait():
            return self._get(url, "the manifest", headers, not_modified_ok=True)
        held = {**headers, **waiting.headers()}
        timeout = waiting.timeout(self._client.timeout)
        try:
            response = waiting.run(lambda: self._get(url, "the manifest", held,
                                                     not_modified_ok=True, timeout=timeout))
        except SourceError as exc:
            if exc.code in _CUT:
                waiting.cut()
            raise
        waiting.answered(response.headers, moved=response.status == 200 and
                         response.headers.get("etag") != headers["If-None-Match"])
        return response

    def _get(self, url: str, what: str, headers: Mapping[str, str] | None = None, *,
             not_modified_ok: bool = False,
             timeout: httpx.Timeout | None = None) -> _Response:
        """GET one resource; every failure becomes a `SourceError` saying what it was for.
        `timeout`: this request's own (a held poll's read timeout is longer)."""
        with translated(what), self._client.stream(
                "GET", url, headers=headers,
                timeout=timeout or self._client.timeout) as response:
            if response.status_code == 200 or (
                    not_modified_ok and response.status_code == 304):
                body = _read_capped(response, what)
                return _Response(response.status_code, response.headers, body)
            response.read()
            raise _http_error(response, what)


# --- manifest checks (pure) ----------------------------------------------------------------


def _read_capped(response: httpx.Response, what: str) -> bytes:
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise SourceError(ErrorCode.TOO_LARGE, f"{what} is larger than {MAX_RESPONSE_BYTES} "
                              "bytes", retryable=False)
        chunks.append(chunk)
    return b"".join(chunks)


def _verified_etag(response: _Response) -> str:
    """The manifest's ETag as sent (quotes included), after checking that it is the digest
    of the exact body: it is what the next poll sends back, so it must name these bytes."""
    etag: str | None = response.headers.get("etag")
    if etag is None:
        raise IntegrityError(ErrorCode.DIGEST_MISMATCH, "the manifest came without an ETag; its "
                             "digest cannot be checked")
    quoted = etag.strip()
    if len(quoted) < 2 or not (quoted.startswith('"') and quoted.endswith('"')):
        raise IntegrityError(ErrorCode.DIGEST_MISMATCH, f"the manifest's ETag {etag!r} is not a "
                             "strong quoted digest")
    _verify(response.body, quoted[1:-1], "the manifest")
    return etag


def _verify(data: bytes, digest: str, what: str) -> None:
    """Exact bytes against their digest: an unusable digest and a mismatch are told apart
    because the first is the server's configuration and the second an attack or damage."""
    try:
        parse_digest(digest)
    except DigestError as exc:
        raise IntegrityError(ErrorCode.UNSUPPORTED_DIGEST, f"{what}: {exc}") from None
    try:
        verify_digest(data, digest)
    except DigestError as exc:
        raise IntegrityError(ErrorCode.DIGEST_MISMATCH, f"{what}: {exc}") from None


def _parse_manifest(body: bytes) -> m.StateManifest:
    try:
        doc = jsonstrict.loads(body)  # the server's parser: no NaN, 1e999, duplicate keys
    except jsonstrict.JsonRefused as exc:
        raise IntegrityError(ErrorCode.INVALID_MANIFEST,
                             f"the manifest is not JSON: {exc}") from None
    try:
        manifest: m.StateManifest = validate_value(doc, expect=Kind.STATE_MANIFEST,
                                                   file="manifest")
    except DocumentError as exc:
        raise IntegrityError(ErrorCode.INVALID_MANIFEST,
                             f"the manifest is invalid:\n{exc}") from None
    return manifest


def _check_manifest(manifest: m.StateManifest, adopted: Adopted, etag: str) -> None:
    """Rollback, digest algorithms and URLs: what must hold before anything the manifest
    names is fetched. The adopted manifest itself (same version, and the same bytes by its
    ETag) passes: it is what a device with damaged local copies fetches again."""
    stored = adopted.manifest_version
    readopted = manifest.manifest_version == stored and etag == adopted.etag
    if stored is not None and manifest.manifest_version <= stored and not readopted:
        raise IntegrityError(ErrorCode.ROLLBACK,
                             f"manifestVersion {manifest.manifest_version} is not "
                             f"newer than the adopted {stored}; refusing a replayed or "
                             "rolled-back manifest")
    # Validation (margo.semantics) already refuses unsupported digest algorithms, URLs that
    # are not the content addresses and duplicate ids; digests and URLs are checked again
    # here because following an absolute URL would send the credentials elsewhere.
    refs: list[tuple[str, str, str]] = [(f"deployment {r.deployment_id}", r.digest, r.url)
                                        for r in manifest.deployments]
    if manifest.bundle is not None:
        refs.append(("the bundle", manifest.bundle.digest, manifest.bundle.url))
    for what, digest, url in refs:
        try:
            parse_digest(digest)
        except DigestError as exc:
            raise IntegrityError(ErrorCode.INVALID_MANIFEST, f"{what}: {exc}") from None
        _check_relative(url, what)


def _check_relative(url: str, what: str) -> None:
    """Manifest URLs are paths on the server that sent the manifest, never anywhere else
    (the credentials would follow an absolute URL)."""
    parts = urlsplit(url)
    if (not url.startswith("/") or url.startswith("//") or "\\" in url or parts.scheme
            or parts.netloc):
        raise IntegrityError(ErrorCode.INVALID_MANIFEST, f"{what}: URL {url!r} is not a relative "
                             "path on this server")


def _bundle_is_cheaper(adopted: Adopted, missing: int, manifest: m.StateManifest) -> bool:
    """The bundle on the first sync, or when more than half of the deployments (and at
    least two) must be fetched; otherwise individual documents, which moves fewer bytes."""
    if adopted.version is None:
        return True
    return missing >= 2 and 2 * missing > len(manifest.deployments)


def _parse_document(ref: m.DeploymentRef, data: bytes) -> DesiredDeployment:
    try:
        deployment = parse_deployment(data, file=ref.url)
    except DocumentError as exc:
        raise IntegrityError(ErrorCode.INVALID_DOCUMENT, f"deployment {ref.deployment_id} is not a "
                             f"valid ApplicationDeployment:\n{exc}") from None
    except ValueError as exc:
        raise IntegrityError(ErrorCode.INVALID_DOCUMENT, f"deployment {ref.deployment_id}: {exc}") \
            from None
    if deployment.deployment_id != ref.deployment_id:
        raise IntegrityError(ErrorCode.INVALID_DOCUMENT, f"{ref.url}: the document's id "
                             f"{deployment.deployment_id!r} is not the manifest's deploymentId "
                             f"{ref.deployment_id!r}")
    return deployment


# --- HTTP errors ---------------------------------------------------------------------------


def _http_error(response: httpx.Response, what: str) -> SourceError:
    """A `SourceError` for a non-2xx answer, using the RFC 9457 problem when there is one:
    `detail` goes into the message and `retryable: false` is honoured."""
    status = response.status_code
    problem = problem_of(response)
    detail = problem.get("detail") or problem.get("title") or response.reason_phrase
    message = f"{what}: HTTP {status}: {detail}"
    if status in _NON_RETRYABLE:
        return SourceError(_NON_RETRYABLE[status], message, retryable=False)
    if status == 404:
        # Never a deletion: the manifest may name a state the server has moved past.
        # The problem's `retryable: false` is not honoured here: a fresh manifest will name
        # what the server holds now, so the next poll can succeed.
        return SourceError(ErrorCode.NOT_FOUND, f"{message} (not a deletion; retrying later)")
    retry_after = parse_retry_after(response.headers.get("retry-after"), time.time())
    if retry_after is None and isinstance(problem.get("retryAfterSeconds"), int | float):
        retry_after = float(problem["retryAfterSeconds"])
    default = status in _THROTTLED or status >= 500 or status == 408
    retryable = problem["retryable"] if isinstance(problem.get("retryable"), bool) else default
    return SourceError(f"HTTP_{status}", message, retryable=retryable, retry_after=retry_after)
