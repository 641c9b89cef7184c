"""`margo clients` and `margo trust`: the operator's side of client identities.

Margo leaves provisioning to the operator (digest section 6a: mint an SVID, install it, add
the client to the WFM's policy). These commands do that against the server's data directory,
safely while the server runs (SQLite WAL; the server re-reads the policy within seconds):

- `clients add ID`: a development token (Preview Release 1 bearer tokens).
- `clients issue ID --ca DIR --wfm-id W`: mint a client X.509-SVID with a lab CA (`ca.pem` +
  `ca-key.pem`, e.g. the kit's `fixtures/miaf/`), write it in the conformance kit's layout
  (`svid-cert.pem`, `svid-key.pem`, `svid-ca.pem`) and register the client.
- `clients import ID --cert FILE`: register a certificate minted elsewhere: an SVID (its
  SPIFFE ID must name this client id) or an rc.2 device certificate (its key is pre-approved,
  so onboarding works even with `--onboarding closed`).
- `clients list [--json]`, `clients retire ID`.
- `trust rotate --bundle FILE`: check and atomically install a new trust bundle; the server
  notices the changed file at the next handshake, no restart.

Each change is recorded in the server's audit trail as `local:<OS user>`
(`margo_cli.datastore.audited`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from margo.files import write_atomically
from margo_cli.datastore import audited, data_options, opened_store
from margo_cli.usage import UsageError

__all__ = ["register"]


def register(commands: Any) -> None:
    clients = commands.add_parser("clients", help="register, issue, import, list and retire "
                                                  "device clients")
    verbs = clients.add_subparsers(dest="verb", metavar="VERB", required=True)
    add = verbs.add_parser("add", help="register a client with a development token")
    add.add_argument("client_id", metavar="CLIENT_ID")
    add.add_argument("--reactivate", action="store_true",
                     help="accept a retired client again (with a new token)")
    data_options(add)
    add.add_argument("--json", action="store_true")
    add.set_defaults(run=run_clients_add)

    issue = verbs.add_parser("issue", help="mint a client SVID with a lab CA and register it")
    issue.add_argument("client_id", metavar="CLIENT_ID")
    issue.add_argument("--ca", required=True, metavar="DIR", help="holds ca.pem and ca-key.pem")
    issue.add_argument("--wfm-id", required=True, metavar="ID")
    issue.add_argument("--trust-domain", metavar="TD",
                       help="default: the spiffe://<td> URI SAN of the CA certificate")
    issue.add_argument("--out", metavar="DIR", help="where to write svid-cert.pem, "
                       "svid-key.pem and svid-ca.pem (default: ./<client id>-svid)")
    issue.add_argument("--hours", type=float, default=24 * 30,
                       help="validity (default 720 h: labs; production SVIDs live hours)")
    issue.add_argument("--key-type", choices=("ec-p256", "ec-p384"), default="ec-p256")
    data_options(issue)
    issue.add_argument("--json", action="store_true")
    issue.set_defaults(run=run_clients_issue)

    imported = verbs.add_parser("import", help="register an SVID or rc.2 device certificate")
    imported.add_argument("client_id", metavar="CLIENT_ID")
    imported.add_argument("--cert", required=True, metavar="FILE")
    imported.add_argument("--trust-domain", metavar="TD", help="require this trust domain")
    imported.add_argument("--wfm-id", metavar="ID", help="require this WFM id")
    data_options(imported)
    imported.set_defaults(run=run_clients_import)

    listing = verbs.add_parser("list", help="every client and what proves it")
    data_options(listing)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(run=run_clients_list)

    retire = verbs.add_parser("retire", help="refuse a client's requests from now on")
    retire.add_argument("client_id", metavar="CLIENT_ID")
    data_options(retire)
    retire.set_defaults(run=run_clients_retire)

    trust = commands.add_parser("trust", help="manage the server's client trust bundle")
    trust_verbs = trust.add_subparsers(dest="verb", metavar="VERB", required=True)
    rotate = trust_verbs.add_parser("rotate", help="install a new trust bundle (replacing, "
                                                   "not merging, the anchors)")
    rotate.add_argument("--bundle", required=True, metavar="FILE",
                        help="PEM certificates or a SPIFFE bundle (JWK set)")
    data_options(rotate)
    rotate.add_argument("--target", metavar="FILE",
                        help="the file `margo serve --trust-bundle` reads "
                             "(default: <data>/trust/bundle.pem)")
    rotate.add_argument("--force", action="store_true",
                        help="accept a spiffe_sequence lower than the installed bundle's")
    rotate.set_defaults(run=run_trust_rotate)


def _fail(message: str) -> int:
    raise UsageError(f"margo: {message}")


class _Registry:
    """The client registry of the store a command names; `audited` records a change in the
    audit trail."""

    def __init__(self, db: Any):
        from wfm.identity.clients import ClientRegistry

        self.db = db
        self.clients = ClientRegistry(db)

    def audited(self, action: str, target: str, detail: str | None = None) -> None:
        audited(self.db, action, target, detail)


@contextmanager
def _registry(args: argparse.Namespace) -> Iterator[_Registry]:
    with opened_store(args) as db:
        yield _Registry(db)


# --- clients add / retire / list -------------------------------------------------------


def _check_client_id(verb: str, client_id: str) -> None:
    """The server refuses such client ids where they enter (`margo.identifiers`): so does
    the command that would register one, before anything is written."""
    from margo.identifiers import CLIENT_ID

    problem = CLIENT_ID.problem(client_id)
    if problem is not None:
        _fail(f"clients {verb}: {problem}")


def run_clients_add(args: argparse.Namespace) -> int:
    from wfm.identity.clients import ClientRetired

    _check_client_id("add", args.client_id)
    with _registry(args) as registry:
        try:
            client_id, token = registry.clients.add(args.client_id,
                                                    reactivate=args.reactivate)
        except ClientRetired as exc:
            return _fail(f"clients add: {exc}")
        registry.audited("client.add", client_id, "a new token" + (
            " (reactivated)" if args.reactivate else ""))
    if args.json:
        print(json.dumps({"clientId": client_id, "token": token}))
    else:
        print(f"client {client_id}\ntoken  {token}\n(send it as 'Authorization: Bearer <token>'; "
              "for Git, as the password of user <client id>)")
    return 0


def run_clients_retire(args: argparse.Namespace) -> int:
    with _registry(args) as registry:
        if not registry.clients.retire(args.client_id):
            return _fail(f"clients: no client {args.client_id!r}")
        registry.audited("client.retire", args.client_id)
    return 0


def run_clients_list(args: argparse.Namespace) -> int:
    with _registry(args) as registry:
        rows = registry.clients.describe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        proofs = [p for p, present in (("svid", row["spiffeId"]), ("token", row["token"]),
                                       ("rc.2 key", row["signingKeys"])) if present]
        expiry = ""
        if row["svidNotAfter"]:
            expiry = " until " + dt.datetime.fromtimestamp(row["svidNotAfter"], dt.UTC).strftime(
                "%Y-%m-%dT%H:%M:%SZ")
        state = "retired" if row["retired"] else "active"
        print(f"{row['clientId']}\t{state}\t{', '.join(proofs) or 'policy'}"
              f"{' ' + row['spiffeId'] if row['spiffeId'] else ''}{expiry}")
    return 0


# --- clients issue / import --------------------------------------------------------------


def _trust_domain_of(ca_cert: Any) -> str | None:
    from cryptography import x509

    try:
        san = ca_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith("spiffe://"):
            return str(uri[len("spiffe://"):].split("/")[0])
    return None


def mint_svid(ca_cert: Any, ca_key: Any, spiffe_id: str, *, hours: float,
              key_type: str = "ec-p256") -> tuple[Any, Any]:
    """(key, certificate) of a client X.509-SVID: one spiffe URI SAN, not a CA, digital
    signature only, clientAuth (+serverAuth, as the kit's SVIDs), issued by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    curve = ec.SECP384R1() if key_type == "ec-p384" else ec.SECP256R1()
    key = ec.generate_private_key(curve)
    now = dt.datetime.now(dt.UTC)
    signing_hash = (hashes.SHA384() if isinstance(ca_key, ec.EllipticCurvePrivateKey)
                    and ca_key.curve.key_size > 256 else hashes.SHA256())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        spiffe_id.rsplit("/", 1)[-1])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=hours))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH,
                                                  ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(spiffe_id)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, signing_hash))
    return key, cert


def _write_private(path: Path, data: bytes) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def run_clients_issue(args: argparse.Namespace) -> int:
    _check_client_id("issue", args.client_id)
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from margo.spiffe import SpiffeIdError, client_id

    ca_dir = Path(args.ca)
    try:
        ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((ca_dir / "ca-key.pem").read_bytes(), None)
    except (OSError, ValueError, TypeError) as exc:
        return _fail(f"clients issue: cannot load {ca_dir}/ca.pem and ca-key.pem: {exc}")
    trust_domain = args.trust_domain or _trust_domain_of(ca_cert)
    if not trust_domain:
        return _fail("clients issue: the CA names no spiffe:// trust domain; pass "
                     "--trust-domain")
    try:
        spiffe = str(client_id(trust_domain, args.wfm_id, args.client_id))
    except SpiffeIdError as exc:
        return _fail(f"clients issue: {exc}")
    key, cert = mint_svid(ca_cert, ca_key, spiffe, hours=args.hours, key_type=args.key_type)
    out = Path(args.out or f"{args.client_id}-svid")
    out.mkdir(parents=True, exist_ok=True)
    pem = cert.public_bytes(serialization.Encoding.PEM)
    chain = b"" if ca_cert.issuer == ca_cert.subject else ca_cert.public_bytes(
        serialization.Encoding.PEM)  # an intermediate CA travels with the leaf
    (out / "svid-cert.pem").write_bytes(pem + chain)
    _write_private(out / "svid-key.pem", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (out / "svid-ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    with _registry(args) as registry:
        registry.clients.register_identity(
            args.client_id, spiffe_id=spiffe, certificate=pem.decode(),
            not_after=cert.not_valid_after_utc.timestamp(), source="issued")
        registry.audited("client.issue", args.client_id, spiffe)
    summary = {"clientId": args.client_id, "spiffeId": spiffe,
               "notAfter": cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
               "files": {name: str(out / name)
                         for name in ("svid-cert.pem", "svid-key.pem", "svid-ca.pem")}}
    print(json.dumps(summary) if args.json else
          f"issued {spiffe} (until {summary['notAfter']}) into {out}/")
    return 0


def run_clients_import(args: argparse.Namespace) -> int:
    _check_client_id("import", args.client_id)
    from cryptography import x509

    try:
        data = Path(args.cert).read_bytes()
        cert = x509.load_pem_x509_certificates(data)[0]
    except (OSError, ValueError) as exc:
        return _fail(f"clients import: cannot read a PEM certificate from {args.cert}: {exc}")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        has_uri = bool(san.get_values_for_type(x509.UniformResourceIdentifier))
    except x509.ExtensionNotFound:
        has_uri = False
    if has_uri:
        return _import_svid(args, cert)
    return _import_rc2_key(args, data)


def _import_svid(args: argparse.Namespace, cert: Any) -> int:
    from cryptography.hazmat.primitives import serialization

    from margo.spiffe import SpiffeIdError, SvidError, client_id_of, svid_spiffe_id

    try:
        spiffe = svid_spiffe_id(cert)
        segments = spiffe.segments
        wfm = args.wfm_id or (segments[2] if len(segments) == 5 else "")
        named = client_id_of(spiffe, trust_domain=args.trust_domain or spiffe.trust_domain,
                             wfm=wfm)
    except (SvidError, SpiffeIdError) as exc:
        return _fail(f"clients import: not a Margo client SVID: {exc}")
    if named != args.client_id:
        return _fail(f"clients import: the SVID names client {named!r}, not {args.client_id!r}")
    with _registry(args) as registry:
        registry.clients.register_identity(
            args.client_id, spiffe_id=str(spiffe),
            certificate=cert.public_bytes(serialization.Encoding.PEM).decode(),
            not_after=cert.not_valid_after_utc.timestamp(), source="imported")
        registry.audited("client.import", args.client_id, str(spiffe))
    print(f"imported {spiffe}")
    return 0


def _import_rc2_key(args: argparse.Namespace, data: bytes) -> int:
    from wfm.identity.signatures import OnboardingError, onboarding_key

    try:
        key = onboarding_key({"certificate": data.decode("ascii", "replace")})
    except OnboardingError as exc:
        return _fail(f"clients import: {exc.detail}")
    with _registry(args) as registry:
        bound = registry.clients.add_key(args.client_id, key_id=key.key_id,
                                         public_key=key.public_key_pem,
                                         certificate=key.certificate_pem)
        if bound != args.client_id:
            return _fail(f"clients import: this key already belongs to client {bound!r}")
        registry.audited("client.import", args.client_id, f"rc.2 key {key.key_id}")
    print(f"imported the rc.2 key {key.key_id} for {args.client_id}")
    return 0


# --- trust rotate ------------------------------------------------------------------------


def _sequence(data: bytes) -> int | None:
    """spiffe_sequence of a JWK-set bundle (None for PEM or when absent)."""
    if not data.lstrip().startswith(b"{"):
        return None
    try:
        value = json.loads(data).get("spiffe_sequence")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def run_trust_rotate(args: argparse.Namespace) -> int:
    from margo.spiffe import TrustBundleError, parse_trust_bundle

    try:
        data = Path(args.bundle).read_bytes()
        anchors = parse_trust_bundle(data)
    except (OSError, TrustBundleError) as exc:
        return _fail(f"trust rotate: {exc}")
    target = Path(args.target) if args.target else Path(args.data) / "trust" / "bundle.pem"
    old = target.read_bytes() if target.exists() else b""
    new_sequence, old_sequence = _sequence(data), _sequence(old)
    if (new_sequence is not None and old_sequence is not None
            and new_sequence < old_sequence and not args.force):
        return _fail(f"trust rotate: spiffe_sequence {new_sequence} is lower than the installed "
                     f"{old_sequence} (a regressed bundle); --force to install it anyway")
    # Atomic replacement: the server reads either the old or the new bundle, never half.
    write_atomically(target, data)
    with opened_store(args) as db:
        audited(db, "trust.rotate", str(target), f"{len(anchors)} anchor(s)" + (
            f", spiffe_sequence {new_sequence}" if new_sequence is not None else ""))
    print(f"installed {len(anchors)} anchor(s) into {target}")
    return 0
