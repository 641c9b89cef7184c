"""OIDC bearer tokens for operators: an issuer the admin configures (`margo serve
--oidc-issuer URL --oidc-audience AUD --oidc-role VALUE=ROLE`), whose signed JWTs prove a
person, and a claim of theirs (`--oidc-role-claim`, default `groups`) their role.

Verified with PyJWT (`jwt.decode`): the issuer's keys come from its discovery document
(`<issuer>/.well-known/openid-configuration`, whose `issuer` must be the configured one, then
its `jwks_uri`); a token is accepted only when signed RS256 or ES256 by one of them (never
`none`, never an HMAC: a symmetric key is skipped, and the algorithm must be the key's own),
issued by the issuer for the audience, within `exp` and `nbf` give or take `leeway` seconds,
and naming its subject (`sub`). The operator's name is `oidc:<sub>`: the subject is stable
and unique at its issuer, where a display name (`preferred_username`) may change hands. Its
role is the highest of those the claim's values (a string or a list) map to; a token whose
claim maps to none proves a person with no role here (`Role.NONE`, refused 403).

The keys are read by a thread of their own, never on a request: when the verifier starts,
every `refresh_seconds`, and soon after a token names a key the verifier does not hold (an
issuer rotating its keys), at most every `MIN_REFRESH_SECONDS`. Until they are read (or
while the issuer cannot be reached at start) tokens are refused with 401. The issuer must
be `https://`, but for a loopback address (development, tests).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import jwt

from wfm.identity.operators import Operator, Role

__all__ = ["ALGORITHMS", "MIN_REFRESH_SECONDS", "OidcSettings", "OidcVerifier",
           "parse_role_mapping"]

log = logging.getLogger("margo.wfm.oidc")

#: The signatures accepted: asymmetric only, as OIDC issuers sign.
ALGORITHMS = ("RS256", "ES256")
#: The shortest time between two reads of the issuer's keys.
MIN_REFRESH_SECONDS = 10.0


@dataclass(frozen=True)
class OidcSettings:
    """`roles`: claim value -> role."""

    issuer: str
    audience: str
    roles: Mapping[str, Role] = field(default_factory=dict)
    role_claim: str = "groups"
    leeway: float = 30.0
    refresh_seconds: float = 300.0
    timeout: float = 5.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.issuer)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError(f"--oidc-issuer {self.issuer!r}: an https:// URL")
        if parts.scheme == "http" and not _loopback(parts.hostname):
            raise ValueError(f"--oidc-issuer {self.issuer!r}: must be https:// (its keys "
                             "decide who is an admin); http:// only on a loopback address")
        if not self.audience:
            raise ValueError("--oidc-audience is required with --oidc-issuer")
        if not self.roles:
            raise ValueError("--oidc-role VALUE=ROLE is required with --oidc-issuer (at "
                             "least one): without it every OIDC caller has no role")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_role_mapping(items: list[str]) -> dict[str, Role]:
    """`VALUE=ROLE` items (`--oidc-role`) as a mapping; ValueError naming a bad one."""
    roles: dict[str, Role] = {}
    for item in items:
        value, sep, role = item.rpartition("=")
        if not sep or not value:
            raise ValueError(f"--oidc-role {item!r}: VALUE=ROLE, e.g. fleet-admins=admin")
        roles[value] = Role.parse(role)
    return roles


Fetch = Callable[[str], Any]


class OidcVerifier:
    """A token lookup for `OperatorAuth` (None: not a token of this issuer, or not valid).
    `start` reads the keys in the background; `stop` ends that."""

    def __init__(self, settings: OidcSettings, *, fetch: Fetch | None = None) -> None:
        self.settings = settings
        self._fetch = fetch or self._get
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._wake, self._stopped = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    # --- the keys -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="margo-oidc-keys",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped.is_set():
            read_at = time.monotonic()
            self._wake.clear()
            try:
                self.read_keys()
                pause = self.settings.refresh_seconds
            except Exception as exc:  # the thread must outlive an issuer that is away
                log.warning("the OIDC issuer's keys were not read (%s); tried again in "
                            "%.0f s", exc, MIN_REFRESH_SECONDS)
                pause = MIN_REFRESH_SECONDS
            self._wake.wait(pause)  # until the next read is due, or a token asks for one
            self._stopped.wait(max(0.0, read_at + MIN_REFRESH_SECONDS - time.monotonic()))

    def _get(self, url: str) -> Any:
        response = httpx.get(url, timeout=self.settings.timeout, follow_redirects=False)
        response.raise_for_status()
        return response.json()

    def read_keys(self) -> int:
        """Read the issuer's discovery document and keys now; how many keys are usable.
        Raises when the issuer cannot be read or says something else than expected."""
        issuer = self.settings.issuer.rstrip("/")
        discovery = self._fetch(f"{issuer}/.well-known/openid-configuration")
        if not isinstance(discovery, dict) or discovery.get("issuer") != self.settings.issuer:
            raise ValueError(f"the discovery document names issuer "
                             f"{discovery.get('issuer') if isinstance(discovery, dict) else None!r}"
                             f", not {self.settings.issuer!r}")
        document = self._fetch(str(discovery["jwks_uri"]))
        keys: dict[str | None, jwt.PyJWK] = {}
        for data in document.get("keys", []) if isinstance(document, dict) else []:
            if not isinstance(data, dict) or data.get("kty") not in ("RSA", "EC") or \
                    data.get("use", "sig") != "sig":
                continue  # never a symmetric key; only signing keys
            try:
                key = jwt.PyJWK(data)
            except jwt.PyJWTError:
                continue
            if key.algorithm_name in ALGORITHMS:
                keys[data.get("kid")] = key
        if not keys:
            raise ValueError("the issuer publishes no RS256 or ES256 signing key")
        self._keys = keys
        return len(keys)

    def _key(self, header: dict[str, Any]) -> jwt.PyJWK | None:
        keys = self._keys
        key = keys.get(header.get("kid"))
        if key is None and "kid" not in header:
            matching = [k for k in keys.values() if k.algorithm_name == header.get("alg")]
            key = matching[0] if len(matching) == 1 else None
        if key is None:  # a key the issuer published since: read them again soon
            self._wake.set()
        return key

    # --- tokens -------------------------------------------------------------------------

    def __call__(self, token: str) -> Operator | None:
        if token.count(".") != 2:
            return None  # not a JWT: an operator token of the store, say
        try:
            header = jwt.get_unverified_header(token)
            if header.get("alg") not in ALGORITHMS:
                raise jwt.InvalidAlgorithmError(f"algorithm {header.get('alg')!r} is not "
                                                f"accepted ({', '.join(ALGORITHMS)})")
            key = self._key(header)
            if key is None:
                raise jwt.InvalidKeyError("signed by a key the issuer has not published")
            if key.algorithm_name != header["alg"]:
                raise jwt.InvalidAlgorithmError("the algorithm is not the key's")
            claims = jwt.decode(token, key.key, algorithms=[header["alg"]],
                                audience=self.settings.audience, issuer=self.settings.issuer,
                                leeway=self.settings.leeway,
                                options={"require": ["exp", "iss", "aud", "sub"]})
        except jwt.PyJWTError as exc:
            log.info("an OIDC token was refused: %s", exc)
            return None
        return Operator(f"oidc:{claims['sub']}", self.role_of(claims), "oidc")

    def role_of(self, claims: Mapping[str, Any]) -> Role:
        """The highest role the role claim's values map to; `Role.NONE` for none."""
        value = claims.get(self.settings.role_claim)
        values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        roles = [self.settings.roles[v] for v in values
                 if isinstance(v, str) and v in self.settings.roles]
        return max(roles, default=Role.NONE)
