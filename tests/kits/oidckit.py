"""A real OpenID Connect issuer on loopback, for the operator surface's OIDC tests: it
serves its discovery document (`/.well-known/openid-configuration`) and its keys (a JWK set
of an RSA and an EC P-256 key) over HTTP, and mints tokens signed with them (PyJWT, keys
made with `cryptography`). No identity provider is packaged for this machine; what the
server relies on is exactly these two documents and the token's signature, all real.

    with oidc_issuer() as issuer:
        token = issuer.token(sub="alice", groups=["fleet-ops"])
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from kits.stubserver import serving, url

__all__ = ["AUDIENCE", "Issuer", "oidc_issuer"]

AUDIENCE = "margo-fleet"


@dataclass
class Issuer:
    url: str
    rsa: Any = field(default_factory=lambda: rsa.generate_private_key(65537, 2048))
    ec: Any = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    #: How many times each document was fetched.
    fetched: dict[str, int] = field(default_factory=dict)

    def jwks(self) -> dict[str, Any]:
        keys = [{**json.loads(RSAAlgorithm.to_jwk(self.rsa.public_key())), "kid": "rsa-1",
                 "use": "sig", "alg": "RS256"},
                {**json.loads(ECAlgorithm.to_jwk(self.ec.public_key())), "kid": "ec-1",
                 "use": "sig"}]
        return {"keys": keys}

    def discovery(self) -> dict[str, Any]:
        return {"issuer": self.url, "jwks_uri": f"{self.url}/jwks",
                "id_token_signing_alg_values_supported": ["RS256", "ES256"]}

    def token(self, *, sub: str = "alice", audience: str = AUDIENCE, lifetime: float = 300,
              algorithm: str = "RS256", key: Any = None, kid: str | None = None,
              issued: float | None = None, **claims: Any) -> str:
        """A token of this issuer (or signed with another `key`)."""
        now = time.time() if issued is None else issued
        payload = {"iss": self.url, "sub": sub, "aud": audience, "iat": int(now),
                   "nbf": int(now), "exp": int(now + lifetime), **claims}
        signer = key if key is not None else self.ec if algorithm == "ES256" else self.rsa
        kid = kid or ("ec-1" if algorithm == "ES256" else "rsa-1")
        return jwt.encode(payload, signer, algorithm=algorithm, headers={"kid": kid})


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        issuer: Issuer = self.server.issuer  # type: ignore[attr-defined]
        documents = {"/.well-known/openid-configuration": issuer.discovery,
                     "/jwks": issuer.jwks}
        make = documents.get(self.path)
        if make is None:
            self.send_error(404)
            return
        issuer.fetched[self.path] = issuer.fetched.get(self.path, 0) + 1
        body = json.dumps(make()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def oidc_issuer() -> Iterator[Issuer]:
    """An issuer serving on 127.0.0.1 until the block ends."""
    with serving(_Handler, issuer=None) as server:
        server.issuer = Issuer(url(server))
        yield server.issuer
