"""A small OCI Distribution v2 client for the artifacts a device pulls that are not Helm charts.

Compose components are packaged as OCI artifacts (spec section 1, "Compose Archive"): a
manifest whose single layer is a tar.gz. The device MUST verify the OCI digest before it
extracts anything, so this client never returns bytes it has not verified:

* the manifest's bytes against the reference when the reference is a digest, otherwise
  against the registry's `Docker-Content-Digest` header (a consistency check: the registry
  is the only source of truth for a tag);
* the layer blob's bytes against the digest and size the manifest names (the Exact Bytes
  Rule: sha256 over the bytes after HTTP `Content-Encoding` is removed).

Sizes are enforced while streaming, so a hostile registry cannot make the device buffer
more than `max_bytes`. Errors are `ApplyError`s with stable codes:

* `PULL_FAILED` (retryable): the network, the registry (404, 5xx) or authentication failed;
  also (not retryable) a malformed repository/reference or an artifact over the size limit;
* `DIGEST_MISMATCH` (not retryable): bytes do not hash to the digest they must have;
* `INVALID_PACKAGE` (not retryable): the manifest is not a single-archive artifact;
* `PUSH_FAILED`: an upload (used by tests and the demo) failed.

Authentication: anonymous or credentialed bearer tokens (`WWW-Authenticate: Bearer realm=`)
and HTTP basic auth, from optional per-registry credentials. Hosts listed in
`plain_http_hosts` are spoken to over plain HTTP (loopback registries in tests and demos).
A pull may add credentials the fleet granted to one deployment (`granted`,
`reconciler.registry_grants`): used for that call only, with tokens and headers of their own
that the call drops, and never for a host the client's own credentials name (the device's
configuration wins).

Verified blobs are cached for the life of the client, keyed by (repository, blob digest):
content-addressed, so a cached entry can never be stale, while tags are re-resolved on every
pull (a tag may be moved).
"""

from __future__ import annotations

import base64
import json
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from margo.digests import DigestError, digest_of, parse_digest, verify_digest
from reconciler.errors import ApplyError, ErrorCode

__all__ = [
    "COMPOSE_ARTIFACT_TYPE",
    "COMPOSE_LAYER_MEDIA_TYPE",
    "DOCKER_MANIFEST_V2",
    "EMPTY_CONFIG_MEDIA_TYPE",
    "OCI_INDEX",
    "OCI_MANIFEST",
    "Artifact",
    "Descriptor",
    "OciClient",
    "OciReference",
    "parse_reference",
]

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
EMPTY_CONFIG_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
# The Margo media types of a Compose Archive (compose-oci SUP, application-registry.md).
COMPOSE_ARTIFACT_TYPE = "application/vnd.org.margo.component.compose+json"
COMPOSE_LAYER_MEDIA_TYPE = "application/vnd.org.margo.component.compose.tar+gzip"

MIB = 1024 * 1024
DEFAULT_MAX_BYTES = 64 * MIB
MAX_MANIFEST_BYTES = 4 * MIB  # the OCI distribution spec's recommended manifest limit
DEFAULT_CACHE_BYTES = 256 * MIB
_ERROR_BODY_LIMIT = 64 * 1024

# Indexes are accepted only to say precisely why they cannot be used (see `pull`).
_ACCEPT_MANIFESTS = ", ".join([OCI_MANIFEST, DOCKER_MANIFEST_V2, OCI_INDEX,
                               DOCKER_MANIFEST_LIST])
_SINGLE_IMAGE_MANIFESTS = frozenset({OCI_MANIFEST, DOCKER_MANIFEST_V2})
_EMPTY_CONFIG = b"{}"
# The OCI distribution spec's grammar for repository names and tags.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_NAME = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HOST = re.compile(r"[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](?::[0-9]{1,5})?")
_CHALLENGE_PARAM = re.compile(r'([A-Za-z_]+)="([^"]*)"')
_DOCKER_HUB_ALIASES = {"docker.io": "registry-1.docker.io",
                       "index.docker.io": "registry-1.docker.io"}


@dataclass(frozen=True)
class Descriptor:
    """What a registry says about one piece of content (OCI descriptor essentials)."""

    digest: str
    media_type: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class OciReference:
    """`oci://host/name` plus a tag or digest, checked against the OCI grammar (so no URL
    syntax can be smuggled into the request path)."""

    registry: str  # host[:port] as written
    name: str
    reference: str

    @property
    def is_digest(self) -> bool:
        return ":" in self.reference

    @property
    def repository(self) -> str:
        return f"oci://{self.registry}/{self.name}"


@dataclass(frozen=True)
class Artifact:
    """A pulled, verified single-archive artifact."""

    repository: str
    reference: str
    manifest: Descriptor  # digest of the exact manifest bytes
    artifact_type: str
    layer: Descriptor
    data: bytes  # the layer blob, verified against `layer.digest`


def parse_reference(repository: str, reference: str) -> OciReference:
    """Split `oci://host[:port]/name` (the scheme is optional) and check both parts.

    Raises `ApplyError("PULL_FAILED", retryable=False)`: a malformed coordinate will not get
    better by retrying."""
    text = repository.removeprefix("oci://")
    host, _, name = text.partition("/")
    if not _HOST.fullmatch(host) or not _NAME.fullmatch(name):
        raise ApplyError(ErrorCode.PULL_FAILED, f"invalid OCI repository {repository!r}: expected "
                         "oci://<host>[:<port>]/<lower-case path>", retryable=False)
    if ":" in reference:
        try:
            parse_digest(reference)
        except DigestError as exc:
            raise ApplyError(ErrorCode.PULL_FAILED, f"invalid OCI digest reference: {exc}",
                             retryable=False) from None
    elif not _TAG.fullmatch(reference):
        raise ApplyError(ErrorCode.PULL_FAILED, f"invalid OCI tag {reference!r}", retryable=False)
    return OciReference(host, name, reference)


def _pull_failed(message: str, *, retryable: bool = True) -> ApplyError:
    return ApplyError(ErrorCode.PULL_FAILED, message, retryable=retryable)


def _http_problem(response: httpx.Response, what: str) -> ApplyError:
    """A registry answered with an error status: say what, with the registry's own words
    (its `errors` list, read from at most the first 64 KiB of the streamed body)."""
    detail = ""
    try:
        body = b""
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > _ERROR_BODY_LIMIT:
                break
        errors = json.loads(body[:_ERROR_BODY_LIMIT]).get("errors", [])
        detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
    except (ValueError, AttributeError, TypeError, httpx.HTTPError):
        pass
    return _pull_failed(f"{what}: HTTP {response.status_code}" + (f" ({detail})" if detail else ""))


@dataclass
class _Auth:
    """Credentials by registry, and the Authorization header that last worked per
    (registry, scope): tokens are reused until the registry challenges again (an expired
    token), then renewed."""

    credentials: Mapping[str, tuple[str, str]]
    authorizations: dict[tuple[str, str], str] = field(default_factory=dict)


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), dict(_CHALLENGE_PARAM.findall(rest))


class OciClient:
    """OCI Distribution v2 pulls (and pushes, for tests and demos) over httpx.

    `credentials` maps a registry (`host[:port]`) to (username, password); `transport` is
    an httpx transport, for callers that need their own network stack. Close the client
    (or use it as a context manager) to release its connections."""

    def __init__(self, *, plain_http_hosts: frozenset[str] = frozenset({"127.0.0.1", "localhost"}),
                 timeout: float = 30.0,
                 credentials: Mapping[str, tuple[str, str]] | None = None,
                 transport: httpx.BaseTransport | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._plain_http_hosts = plain_http_hosts
        self._auth = _Auth(dict(credentials or {}))
        self._client = httpx.Client(timeout=timeout, transport=transport)
        self._cache: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._cache_limit = cache_bytes
        self._cache_size = 0

    def __enter__(self) -> OciClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------------ public API

    def resolve(self, repository: str, reference: str) -> Descriptor:
        """The manifest descriptor a tag or digest currently names (HEAD, then GET when the
        registry does not say the digest)."""
        ref = parse_reference(repository, reference)
        url = self._url(ref, f"manifests/{ref.reference}")
        with self._request("HEAD", url, ref, headers={"Accept": _ACCEPT_MANIFESTS}) as response:
            if response.status_code != 200:
                raise _http_problem(response, f"resolve {ref.repository}:{ref.reference}")
            digest = response.headers.get("Docker-Content-Digest", "")
            media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
            size = int(response.headers.get("Content-Length", "0") or 0)
        if not digest:
            return self._manifest(ref, self._auth)[1]
        self._check_digest_syntax(digest, "the registry's Docker-Content-Digest")
        if ref.is_digest and digest != ref.reference:
            raise ApplyError(ErrorCode.DIGEST_MISMATCH,
                             f"{ref.repository}@{ref.reference}: the registry "
                             f"reports digest {digest}", retryable=False)
        return Descriptor(digest, media_type, size)

    def fetch_artifact(self, repository: str, reference: str, *,
                       max_bytes: int = DEFAULT_MAX_BYTES,
                       granted: Mapping[str, tuple[str, str]] | None = None) -> bytes:
        """The verified archive of a single-archive artifact (see `pull`)."""
        return self.pull(repository, reference, max_bytes=max_bytes, granted=granted).data

    def pull(self, repository: str, reference: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
             granted: Mapping[str, tuple[str, str]] | None = None) -> Artifact:
        """Fetch the manifest, pick its archive layer, fetch and verify the blob.

        The archive layer is the only layer, or else the only layer whose media type is a
        tar+gzip; anything else (an index, a multi-file `docker compose publish` artifact)
        is `INVALID_PACKAGE`. `granted`: credentials granted to the deployment pulling
        (`{host: (user, password)}`), for this call only (see the module docstring)."""
        ref = parse_reference(repository, reference)
        auth = self._auth_for(ref.registry, granted)
        body, manifest = self._manifest(ref, auth)
        layer = self._archive_layer(ref, body, manifest.media_type)
        if layer.size > max_bytes:
            raise _pull_failed(f"{ref.repository}:{ref.reference}: the archive is {layer.size} "
                               f"bytes, over the limit of {max_bytes}", retryable=False)
        data = self._blob(ref, layer, auth)
        return Artifact(repository=ref.repository, reference=ref.reference, manifest=manifest,
                        artifact_type=str(body.get("artifactType") or ""), layer=layer, data=data)

    def push_artifact(self, repository: str, reference: str, data: bytes, *,
                      media_type: str = COMPOSE_LAYER_MEDIA_TYPE,
                      artifact_type: str = COMPOSE_ARTIFACT_TYPE,
                      annotations: Mapping[str, str] | None = None,
                      layer_annotations: Mapping[str, str] | None = None) -> str:
        """Upload `data` as the single layer of an OCI artifact tagged `reference`; return
        the manifest digest. Compose archives get the layer annotations the spec requires
        (`org.margo.component.type`, `org.margo.component.version` = the tag) unless
        `layer_annotations` is given. Monolithic uploads (POST, then PUT with the digest)."""
        ref = parse_reference(repository, reference)
        if layer_annotations is None and media_type == COMPOSE_LAYER_MEDIA_TYPE:
            layer_annotations = {"org.margo.component.type": "compose"}
            if not ref.is_digest:
                layer_annotations["org.margo.component.version"] = ref.reference
        layer: dict[str, Any] = {"mediaType": media_type, "digest": digest_of(data),
                                 "size": len(data)}
        if layer_annotations:
            layer["annotations"] = dict(layer_annotations)
        manifest: dict[str, Any] = {
            "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
            "config": {"mediaType": EMPTY_CONFIG_MEDIA_TYPE, "digest": digest_of(_EMPTY_CONFIG),
                       "size": len(_EMPTY_CONFIG)},
            "layers": [layer]}
        if annotations:
            manifest["annotations"] = dict(annotations)
        self._upload_blob(ref, _EMPTY_CONFIG)
        self._upload_blob(ref, data)
        body = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
        url = self._url(ref, f"manifests/{ref.reference}")
        with self._request("PUT", url, ref, push=True, content=body,
                           headers={"Content-Type": OCI_MANIFEST}) as response:
            if response.status_code != 201:
                raise self._push_failed(response, "manifest upload")
        return digest_of(body)

    # ------------------------------------------------------------------ manifests

    def _manifest(self, ref: OciReference, auth: _Auth) -> tuple[dict[str, Any], Descriptor]:
        url = self._url(ref, f"manifests/{ref.reference}")
        what = f"manifest {ref.repository}:{ref.reference}"
        with self._request("GET", url, ref, headers={"Accept": _ACCEPT_MANIFESTS},
                           auth=auth) as response:
            if response.status_code != 200:
                raise _http_problem(response, f"fetch {what}")
            raw = self._read_limited(response, MAX_MANIFEST_BYTES, what)
            header_digest = response.headers.get("Docker-Content-Digest", "")
            content_type = response.headers.get("Content-Type", "").split(";")[0].strip()
        expected = ref.reference if ref.is_digest else header_digest
        if expected:
            self._verify(raw, expected, what)
        try:
            body = json.loads(raw)
        except ValueError:
            raise ApplyError(ErrorCode.INVALID_PACKAGE,
                             f"{what} is not JSON", retryable=False) from None
        if not isinstance(body, dict):
            raise ApplyError(ErrorCode.INVALID_PACKAGE,
                             f"{what} is not a JSON object", retryable=False)
        media_type = str(body.get("mediaType") or content_type)
        return body, Descriptor(digest_of(raw), media_type, len(raw))

    def _archive_layer(self, ref: OciReference, body: dict[str, Any],
                       media_type: str) -> Descriptor:
        what = f"{ref.repository}:{ref.reference}"
        if media_type not in _SINGLE_IMAGE_MANIFESTS:
            kind = media_type or "manifest without a media type"
            raise ApplyError(ErrorCode.INVALID_PACKAGE,
                             f"{what} is a {kind}, not a single-artifact "
                             "image manifest", retryable=False)
        layers = body.get("layers")
        if not isinstance(layers, list) or not layers:
            raise ApplyError(ErrorCode.INVALID_PACKAGE, f"{what} has no layers", retryable=False)
        candidates = layers if len(layers) == 1 else [
            layer for layer in layers if isinstance(layer, dict)
            and str(layer.get("mediaType", "")).endswith(("tar+gzip", "tar.gzip"))]
        if len(candidates) != 1:
            raise ApplyError(ErrorCode.INVALID_PACKAGE, f"{what} has {len(layers)} layers and "
                             f"{len(candidates)} tar+gzip archives; expected exactly one archive",
                             retryable=False)
        layer = candidates[0]
        digest, size = (layer.get("digest"), layer.get("size")) if isinstance(layer, dict) else (
            None, None)
        if not isinstance(digest, str) or not isinstance(size, int) or isinstance(size, bool) \
                or size < 0:
            raise ApplyError(ErrorCode.INVALID_PACKAGE,
                             f"{what}: the archive layer needs a digest and "
                             "a non-negative size", retryable=False)
        self._check_digest_syntax(digest, f"{what}: the archive layer digest")
        annotations = layer.get("annotations")
        return Descriptor(digest, str(layer.get("mediaType", "")), size,
                          dict(annotations) if isinstance(annotations, dict) else {})

    # ------------------------------------------------------------------ blobs

    def _blob(self, ref: OciReference, layer: Descriptor, auth: _Auth) -> bytes:
        key = (f"{ref.registry}/{ref.name}", layer.digest)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        url = self._url(ref, f"blobs/{layer.digest}")
        what = f"blob {layer.digest} of {ref.repository}"
        with self._request("GET", url, ref, auth=auth) as response:
            if response.status_code != 200:
                raise _http_problem(response, f"fetch {what}")
            data = self._read_limited(response, layer.size, what, mismatch=True)
        if len(data) != layer.size:
            raise ApplyError(ErrorCode.DIGEST_MISMATCH, f"{what}: received {len(data)} bytes, the "
                             f"manifest says {layer.size}", retryable=False)
        self._verify(data, layer.digest, what)
        self._remember(key, data)
        return data

    def _remember(self, key: tuple[str, str], data: bytes) -> None:
        if len(data) > self._cache_limit:
            return
        self._cache[key] = data
        self._cache_size += len(data)
        while self._cache_size > self._cache_limit:
            _, evicted = self._cache.popitem(last=False)
            self._cache_size -= len(evicted)

    def _upload_blob(self, ref: OciReference, data: bytes) -> None:
        digest = digest_of(data)
        with self._request("HEAD", self._url(ref, f"blobs/{digest}"), ref, push=True) as response:
            if response.status_code == 200:
                return  # already there: content-addressed, nothing to do
        with self._request("POST", self._url(ref, "blobs/uploads/"), ref, push=True) as response:
            if response.status_code != 202 or "Location" not in response.headers:
                raise self._push_failed(response, "blob upload start")
            location = response.url.join(response.headers["Location"])
        target = location.copy_merge_params({"digest": digest})
        with self._request("PUT", target, ref, push=True, content=data,
                           headers={"Content-Type": "application/octet-stream"}) as response:
            if response.status_code != 201:
                raise self._push_failed(response, f"blob upload {digest}")

    @staticmethod
    def _push_failed(response: httpx.Response, what: str) -> ApplyError:
        problem = _http_problem(response, what)
        return ApplyError(ErrorCode.PUSH_FAILED, problem.message)

    # ------------------------------------------------------------------ plumbing

    def _auth_for(self, registry: str, granted: Mapping[str, tuple[str, str]] | None) -> _Auth:
        """The client's own credentials, or, when `granted` names `registry` and the client's
        own do not, that grant with tokens of its own (dropped after the call)."""
        if not granted or registry not in granted or registry in self._auth.credentials:
            return self._auth
        return _Auth({registry: granted[registry]})

    def _url(self, ref: OciReference, path: str) -> httpx.URL:
        registry = _DOCKER_HUB_ALIASES.get(ref.registry, ref.registry)
        hostname = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
        plain = registry in self._plain_http_hosts or hostname in self._plain_http_hosts
        return httpx.URL(f"{'http' if plain else 'https'}://{registry}/v2/{ref.name}/{path}")

    @contextmanager
    def _request(self, method: str, url: httpx.URL, ref: OciReference, *, push: bool = False,
                 headers: Mapping[str, str] | None = None, content: bytes | None = None,
                 auth: _Auth | None = None) -> Iterator[httpx.Response]:
        """Send once; on a 401 challenge authenticate (with `auth`, by default the client's
        own credentials) and send once more. Streams the body (callers read it within
        limits); network failures become `PULL_FAILED`."""
        auth = auth or self._auth
        scope = f"repository:{ref.name}:{'pull,push' if push else 'pull'}"
        response = self._send(method, url, headers, content,
                              auth.authorizations.get((ref.registry, scope)))
        try:
            if response.status_code == 401:
                challenge = response.headers.get("WWW-Authenticate", "")
                response.close()
                authorization = self._authorize(ref, scope, challenge, auth)
                response = self._send(method, url, headers, content, authorization)
            if response.status_code == 401:
                raise _pull_failed(f"{ref.registry} refused our credentials for {ref.name}")
            yield response
        finally:
            response.close()

    def _send(self, method: str, url: httpx.URL, headers: Mapping[str, str] | None,
              content: bytes | None, authorization: str | None) -> httpx.Response:
        all_headers = dict(headers or {})
        if authorization:
            all_headers["Authorization"] = authorization
        request = self._client.build_request(method, url, headers=all_headers, content=content)
        try:
            return self._client.send(request, stream=True, follow_redirects=True)
        except httpx.HTTPError as exc:
            raise _pull_failed(f"{method} {url}: {type(exc).__name__}: {exc}") from exc

    def _authorize(self, ref: OciReference, scope: str, challenge: str, auth: _Auth) -> str:
        """The Authorization header a 401 challenge asks for (bearer token or basic),
        remembered in `auth`."""
        scheme, params = _parse_challenge(challenge)
        credentials = auth.credentials.get(ref.registry)
        if scheme == "basic":
            if credentials is None:
                raise _pull_failed(f"{ref.registry} requires credentials, none are configured "
                               "or granted")
            user, password = credentials
            header = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
            auth.authorizations[(ref.registry, scope)] = header
            return header
        if scheme != "bearer" or "realm" not in params:
            raise _pull_failed(f"{ref.registry} asks for unsupported authentication "
                               f"{challenge!r}")
        query = {"scope": params.get("scope", scope)}
        if "service" in params:
            query["service"] = params["service"]
        basic = httpx.BasicAuth(*credentials) if credentials else None
        try:
            response = self._client.get(params["realm"], params=query, auth=basic)
        except httpx.HTTPError as exc:
            raise _pull_failed(f"token request to {params['realm']}: {exc}") from exc
        if response.status_code != 200:
            raise _http_problem(response, f"token request to {params['realm']}")
        try:
            body = response.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise _pull_failed(f"the token service {params['realm']} returned no token")
        auth.authorizations[(ref.registry, scope)] = f"Bearer {token}"
        return f"Bearer {token}"

    @staticmethod
    def _read_limited(response: httpx.Response, limit: int, what: str, *,
                      mismatch: bool = False) -> bytes:
        """Read a streamed body, stopping as soon as it exceeds `limit` bytes. Over the
        descriptor's size it is a `DIGEST_MISMATCH` (`mismatch`), else `PULL_FAILED`."""
        chunks: list[bytes] = []
        received = 0
        try:
            for chunk in response.iter_bytes():
                received += len(chunk)
                if received > limit:
                    if mismatch:
                        raise ApplyError(ErrorCode.DIGEST_MISMATCH, f"{what}: more bytes than the "
                                         f"{limit} its descriptor declares", retryable=False)
                    raise _pull_failed(f"{what}: larger than {limit} bytes", retryable=False)
                chunks.append(chunk)
        except httpx.HTTPError as exc:
            raise _pull_failed(f"{what}: {type(exc).__name__}: {exc}") from exc
        return b"".join(chunks)

    @staticmethod
    def _verify(data: bytes, expected: str, what: str) -> None:
        try:
            verify_digest(data, expected)
        except DigestError as exc:
            raise ApplyError(ErrorCode.DIGEST_MISMATCH, f"{what}: {exc}", retryable=False) from None

    @staticmethod
    def _check_digest_syntax(digest: str, what: str) -> None:
        try:
            parse_digest(digest)
        except DigestError as exc:
            raise ApplyError(ErrorCode.INVALID_PACKAGE, f"{what}: {exc}", retryable=False) from None
