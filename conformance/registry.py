"""The `oras` side of the conformance kit, in Python: what the kit's registry steps run the
`oras` CLI for, spoken directly to an OCI Distribution v2 registry with httpx.

The kit's runner shells out to `oras manifest fetch`, `oras blob fetch`, `oras repo tags` and
a raw `GET /v2/<name>/tags/list`. Reimplementing those four reads keeps the conformance
command free of a Go binary nobody installed. Like `oras`, the fetches verify what they
read: a manifest against the registry's `Docker-Content-Digest` (or the digest it was asked
for), a blob against its digest and size, so a registry serving corrupt bytes fails the step
instead of passing it.

Authentication is what anonymous pulls need: a `WWW-Authenticate: Bearer realm=...`
challenge answered with an anonymous token. Registries on loopback are spoken to over plain
HTTP unless told otherwise (`oras --plain-http` for local test registries).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

import httpx

from margo.digests import DigestError, verify_digest
from reconciler.errors import ApplyError
from reconciler.oci import DOCKER_MANIFEST_V2, OCI_INDEX, OCI_MANIFEST, parse_reference

__all__ = ["RegistryClient", "RegistryError", "RegistryRef"]

_ACCEPT_MANIFESTS = ", ".join([OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST_V2])
_CHALLENGE_PARAM = re.compile(r'([A-Za-z_]+)="([^"]*)"')
_LINK_NEXT = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')
_LOOPBACK_NAMES = {"localhost"}
MAX_TAG_PAGES = 100


class RegistryError(Exception):
    """A registry read failed: no answer, an error status, or bytes that do not verify."""


@dataclass(frozen=True)
class RegistryRef:
    """`host[:port]/name[:tag|@digest]`, as `oras` and REGISTRY_REF write it."""

    host: str
    name: str
    reference: str | None

    @classmethod
    def parse(cls, text: str) -> RegistryRef:
        """Split and check against the OCI grammar (so nothing can be smuggled into a URL)."""
        body = text.strip().removeprefix("oci://")
        reference: str | None = None
        if "@" in body:
            body, reference = body.split("@", 1)
        else:
            slash = body.rfind("/")
            colon = body.rfind(":")
            if colon > slash > 0:
                body, reference = body[:colon], body[colon + 1:]
        try:
            parsed = parse_reference(body, reference or "latest")
        except ApplyError as exc:
            raise RegistryError(f"invalid registry reference {text!r}: {exc.message}") from None
        return cls(parsed.registry, parsed.name, reference)

    @property
    def repository(self) -> str:
        return f"{self.host}/{self.name}"

    def __str__(self) -> str:
        if self.reference is None:
            return self.repository
        separator = "@" if ":" in self.reference else ":"
        return f"{self.repository}{separator}{self.reference}"


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]")
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class RegistryClient:
    """Anonymous reads from OCI registries. `plain_http` None means: plain HTTP for loopback
    hosts only. Close it (or use it as a context manager) to release connections."""

    def __init__(self, *, plain_http: bool | None = None, timeout: float = 30.0) -> None:
        self._plain_http = plain_http
        # oras verifies registry TLS by default; so do we (no verify=False here).
        self._client = httpx.Client(timeout=timeout, follow_redirects=True)
        self._tokens: dict[tuple[str, str], str] = {}

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def base(self, ref: RegistryRef) -> str:
        plain = _is_loopback(ref.host) if self._plain_http is None else self._plain_http
        return f"{'http' if plain else 'https'}://{ref.host}/v2/{ref.name}"

    # --- what the kit runs oras for ---------------------------------------------------------

    def manifest(self, ref: RegistryRef) -> bytes:
        """`oras manifest fetch`: the exact manifest bytes, verified."""
        if ref.reference is None:
            raise RegistryError(f"{ref}: a tag or digest is needed to fetch a manifest")
        response = self.get(ref, f"/manifests/{ref.reference}", accept=_ACCEPT_MANIFESTS)
        self._expect_ok(response, f"manifest {ref}")
        expected = ref.reference if ":" in ref.reference else response.headers.get(
            "Docker-Content-Digest", "")
        if expected:
            self._verify(response.content, expected, f"manifest {ref}")
        return response.content

    def blob(self, ref: RegistryRef, digest: str, size: int | None = None) -> bytes:
        """`oras blob fetch <repo>@<digest>`: the blob, verified against digest and size."""
        response = self.get(ref, f"/blobs/{digest}")
        self._expect_ok(response, f"blob {digest}")
        if size is not None and len(response.content) != size:
            raise RegistryError(f"blob {digest}: {len(response.content)} bytes, the manifest "
                                f"says {size}")
        self._verify(response.content, digest, f"blob {digest}")
        return response.content

    def tags(self, ref: RegistryRef) -> list[str]:
        """`oras repo tags`: every tag, following the registry's `Link` pagination."""
        tags: list[str] = []
        url: str | None = f"{self.base(ref)}/tags/list"
        for _ in range(MAX_TAG_PAGES):
            if url is None:
                return tags
            response = self._get_url(ref, url)
            self._expect_ok(response, f"tags of {ref.repository}")
            try:
                page = response.json().get("tags") or []
            except (ValueError, AttributeError):
                raise RegistryError(f"tags of {ref.repository}: not a JSON object") from None
            tags += [str(t) for t in page]
            url = self._next_page(response)
        raise RegistryError(f"tags of {ref.repository}: more than {MAX_TAG_PAGES} pages")

    def tags_list(self, ref: RegistryRef) -> httpx.Response:
        """The raw `GET /v2/<name>/tags/list` response (the kit checks its exact shape)."""
        return self.get(ref, "/tags/list")

    # --- plumbing ---------------------------------------------------------------------------

    def get(self, ref: RegistryRef, path: str, *, accept: str | None = None) -> httpx.Response:
        return self._get_url(ref, self.base(ref) + path, accept=accept)

    def _get_url(self, ref: RegistryRef, url: str, *, accept: str | None = None) -> httpx.Response:
        """GET once; on a bearer challenge fetch an anonymous token and GET once more."""
        headers = {"Accept": accept} if accept else {}
        scope = f"repository:{ref.name}:pull"
        token = self._tokens.get((ref.host, scope))
        response = self._send(url, headers, token)
        if response.status_code == 401:
            challenge = response.headers.get("WWW-Authenticate", "")
            token = self._anonymous_token(ref, scope, challenge)
            response = self._send(url, headers, token)
        return response

    def _send(self, url: str, headers: dict[str, str], token: str | None) -> httpx.Response:
        if token:
            headers = {**headers, "Authorization": f"Bearer {token}"}
        try:
            return self._client.get(url, headers=headers)
        except httpx.HTTPError as exc:
            raise RegistryError(f"GET {url}: {type(exc).__name__}: {exc}") from None

    def _anonymous_token(self, ref: RegistryRef, scope: str, challenge: str) -> str:
        scheme, _, rest = challenge.strip().partition(" ")
        params = dict(_CHALLENGE_PARAM.findall(rest))
        if scheme.lower() != "bearer" or "realm" not in params:
            raise RegistryError(f"{ref.host} asks for credentials ({challenge or 'no challenge'})"
                                "; the conformance command reads anonymously")
        query = {"scope": params.get("scope", scope)}
        if "service" in params:
            query["service"] = params["service"]
        try:
            response = self._client.get(params["realm"], params=query)
            body: Any = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise RegistryError(f"token from {params['realm']}: {exc}") from None
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
        if response.status_code != 200 or not isinstance(token, str) or not token:
            raise RegistryError(f"token from {params['realm']}: HTTP {response.status_code}")
        self._tokens[(ref.host, scope)] = token
        return token

    def _next_page(self, response: httpx.Response) -> str | None:
        match = _LINK_NEXT.search(response.headers.get("Link", ""))
        return str(response.url.join(match.group(1))) if match else None

    @staticmethod
    def _expect_ok(response: httpx.Response, what: str) -> None:
        if response.status_code != 200:
            raise RegistryError(f"{what}: HTTP {response.status_code} "
                                f"{response.text[:200].strip()}")

    @staticmethod
    def _verify(data: bytes, expected: str, what: str) -> None:
        try:
            verify_digest(data, expected)
        except DigestError as exc:
            raise RegistryError(f"{what}: {exc}") from None
