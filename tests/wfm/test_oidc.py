"""OIDC bearer tokens for operators (`wfm.identity.oidc`), against a real issuer on loopback
(`kits.oidckit`: discovery document and JWK set over HTTP, tokens signed with RSA and EC
keys): what is accepted, what is refused and why, and a real `margo serve --oidc-issuer`
that lets a mapped group act and refuses an unmapped one with 403."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from kits.oidckit import AUDIENCE, Issuer, oidc_issuer
from kits.serverkit import running_server

from tools.polling import poll_until
from wfm.identity.oidc import OidcSettings, OidcVerifier, parse_role_mapping
from wfm.identity.operators import Operator, Role

ROLES = {"fleet-viewers": Role.VIEWER, "fleet-ops": Role.OPERATOR, "fleet-admins": Role.ADMIN}


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    with oidc_issuer() as running:
        yield running


@pytest.fixture
def verifier(issuer: Issuer) -> OidcVerifier:
    checker = OidcVerifier(OidcSettings(issuer.url, AUDIENCE, ROLES, leeway=5))
    assert checker.read_keys() == 2
    return checker


def test_a_good_token_proves_its_subject_with_the_highest_mapped_role(
        issuer: Issuer, verifier: OidcVerifier) -> None:
    token = issuer.token(sub="alice", groups=["staff", "fleet-viewers", "fleet-ops"])
    assert verifier(token) == Operator("oidc:alice", Role.OPERATOR, "oidc")
    es256 = issuer.token(sub="bob", algorithm="ES256", groups="fleet-admins")
    assert verifier(es256) == Operator("oidc:bob", Role.ADMIN, "oidc")
    # preferred_username is not the name: the subject is what stays the same
    named = issuer.token(sub="u-17", preferred_username="carol", groups=["fleet-viewers"])
    assert verifier(named) == Operator("oidc:u-17", Role.VIEWER, "oidc")


def test_an_unmapped_claim_proves_a_person_with_no_role(issuer: Issuer,
                                                        verifier: OidcVerifier) -> None:
    assert verifier(issuer.token(groups=["staff"])) == Operator("oidc:alice", Role.NONE,
                                                                "oidc")
    assert verifier(issuer.token()) == Operator("oidc:alice", Role.NONE, "oidc")
    other_claim = OidcVerifier(OidcSettings(issuer.url, AUDIENCE, {"ops": Role.OPERATOR},
                                            role_claim="role"))
    other_claim.read_keys()
    assert other_claim(issuer.token(role="ops")).role is Role.OPERATOR  # type: ignore[union-attr]
    assert other_claim(issuer.token(groups=["ops"])).role is Role.NONE  # type: ignore[union-attr]


def test_tokens_that_are_not_the_issuers_for_us_are_refused(issuer: Issuer,
                                                            verifier: OidcVerifier) -> None:
    groups = ["fleet-admins"]
    assert verifier(issuer.token(audience="another-app", groups=groups)) is None
    assert verifier(issuer.token(lifetime=-60, groups=groups)) is None  # expired past leeway
    assert verifier(issuer.token(lifetime=-2, groups=groups)) is not None  # within leeway
    assert verifier(issuer.token(issued=time.time() + 600, groups=groups)) is None  # nbf
    stranger = rsa.generate_private_key(65537, 2048)
    assert verifier(issuer.token(key=stranger, groups=groups)) is None  # wrong key, same kid
    assert verifier(issuer.token(key=stranger, kid="rotated", groups=groups)) is None
    forged_iss = jwt.encode({"iss": "https://evil.example", "sub": "x", "aud": AUDIENCE,
                             "exp": int(time.time()) + 60, "groups": groups},
                            issuer.rsa, algorithm="RS256", headers={"kid": "rsa-1"})
    assert verifier(forged_iss) is None
    assert verifier("not-a-jwt") is None
    assert verifier("a.b.c") is None


def test_alg_none_and_hmac_with_the_public_key_are_refused(issuer: Issuer,
                                                           verifier: OidcVerifier) -> None:
    claims = {"iss": issuer.url, "sub": "mallory", "aud": AUDIENCE,
              "exp": int(time.time()) + 60, "groups": ["fleet-admins"]}

    def part(doc: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()

    unsigned = f"{part({'alg': 'none', 'kid': 'rsa-1'})}.{part(claims)}."
    assert verifier(unsigned) is None
    # HS256 keyed with the RSA public key's JWK modulus text: the classic confusion
    secret = issuer.jwks()["keys"][0]["n"].encode()
    hmac_token = jwt.encode(claims, secret, algorithm="HS256", headers={"kid": "rsa-1"})
    assert verifier(hmac_token) is None
    # the RSA key named, but an ES256 signature: the algorithm must be the key's own
    mixed = issuer.token(algorithm="ES256", kid="rsa-1", groups=["fleet-admins"])
    assert verifier(mixed) is None


def test_settings_refuse_what_would_be_unsafe_or_useless() -> None:
    with pytest.raises(ValueError, match="https"):
        OidcSettings("http://idp.example.com", AUDIENCE, ROLES)
    with pytest.raises(ValueError, match="--oidc-role"):
        OidcSettings("https://idp.example.com", AUDIENCE, {})
    with pytest.raises(ValueError, match="--oidc-audience"):
        OidcSettings("https://idp.example.com", "", ROLES)
    assert parse_role_mapping(["a=b=admin", "ops=operator"]) == {"a=b": Role.ADMIN,
                                                                 "ops": Role.OPERATOR}
    with pytest.raises(ValueError, match="unknown role"):
        parse_role_mapping(["ops=root"])
    with pytest.raises(ValueError, match="VALUE=ROLE"):
        parse_role_mapping(["ops"])


def test_a_server_with_an_oidc_issuer_lets_mapped_groups_act_and_records_them(
        tmp_path: Path, issuer: Issuer) -> None:
    args = ("--oidc-issuer", issuer.url, "--oidc-audience", AUDIENCE,
            "--oidc-role", "fleet-viewers=viewer", "--oidc-role", "fleet-ops=operator",
            "--oidc-role", "fleet-admins=admin")
    with running_server(tmp_path / "data", *args) as base:
        def get(path: str, token: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return httpx.get(base + path, headers=headers, timeout=10)

        viewer = issuer.token(sub="vera", groups=["fleet-viewers"])
        poll_until("the issuer's keys read", lambda: get("/api/fleet/devices", viewer)
                   .status_code == 200, timeout=10)
        assert get("/api/fleet/devices", None).status_code == 401
        assert "WWW-Authenticate" in get("/api/fleet/devices", None).headers
        nobody = get("/api/fleet/devices", issuer.token(sub="nina", groups=["staff"]))
        assert nobody.status_code == 403
        assert nobody.json()["detail"] == ("oidc:nina has no role on this server; this needs "
                                           "the viewer role")
        expired = issuer.token(sub="vera", lifetime=-120, groups=["fleet-viewers"])
        assert get("/api/fleet/devices", expired).status_code == 401
        refused = httpx.post(f"{base}/api/fleet/rollouts/web/pause", timeout=10,
                             headers={"Authorization": f"Bearer {viewer}"})
        assert refused.status_code == 403
        operator = issuer.token(sub="otto", algorithm="ES256", groups=["fleet-ops"])
        acted = httpx.post(f"{base}/api/fleet/rollouts/web/pause", timeout=10,
                           headers={"Authorization": f"Bearer {operator}"})
        assert acted.status_code == 404  # allowed; there is no such rollout
        admin = issuer.token(sub="ada", groups=["fleet-admins"])
        trail = get("/api/fleet/audit", admin).json()["entries"]
        assert [(e["actor"], e["via"], e["role"], e["action"], e["outcome"]) for e in trail] \
            == [("oidc:vera", "oidc", "viewer", "rollout.pause", "refused"),
                ("oidc:otto", "oidc", "operator", "rollout.pause", "failed")]
        assert get("/api/fleet/audit", operator).status_code == 403
