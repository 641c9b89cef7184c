"""The operator commands: `margo clients add|issue|import|list|retire`, `margo trust rotate`.

Run in-process against a data directory (the same SQLite the server uses); what they mint is
checked with `cryptography` and `margo.spiffe`, and one issued SVID is used against a real
server to show that the files are what `margo serve` accepts.
"""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kits.pkikit import (
    Ca,
    issue_svid,
    make_ca,
    make_lab,
    make_self_signed,
    running_tls_server,
    tls_client,
)
from kits.pkikit import write_pem as write

from margo import spiffe
from margo_cli.main import main as margo


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = margo(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def listing(capsys: pytest.CaptureFixture[str], data: Path) -> dict[str, dict[str, object]]:
    code, out, _ = run(capsys, "clients", "list", "--data", str(data), "--json")
    assert code == 0
    return {row["clientId"]: row for row in json.loads(out)}


def test_issue_mints_a_kit_layout_svid_that_the_server_accepts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lab = make_lab(tmp_path / "pki", "plant.test", "wfm-9")
    ca_dir = tmp_path / "ca"
    lab.ca.write_key(ca_dir)
    data, out = tmp_path / "data", tmp_path / "line-1"
    code, printed, _ = run(capsys, "clients", "issue", "line-1", "--ca", str(ca_dir),
                           "--wfm-id", "wfm-9", "--out", str(out), "--hours", "2",
                           "--data", str(data), "--json")
    assert code == 0
    summary = json.loads(printed)
    assert summary["spiffeId"] == "spiffe://plant.test/margo/wfm/wfm-9/client/line-1"
    cert = x509.load_pem_x509_certificate((out / "svid-cert.pem").read_bytes())
    assert str(spiffe.svid_spiffe_id(cert)) == summary["spiffeId"]
    assert spiffe.verify_svid_chain(cert, [], spiffe.load_trust_bundle(out / "svid-ca.pem"))
    assert stat.S_IMODE((out / "svid-key.pem").stat().st_mode) == 0o600
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert 2 * 3600 <= lifetime.total_seconds() <= 2 * 3600 + 600
    row = listing(capsys, data)["line-1"]
    assert (row["spiffeId"], row["svidSource"], row["retired"]) == (
        summary["spiffeId"], "issued", False)
    # Registered means accepted: no --accept-clients needed.
    svid = (out / "svid-cert.pem", out / "svid-key.pem")
    with running_tls_server(data, lab, ready=svid) as base, \
            tls_client(base, *svid, lab.bundle) as http:
        assert http.get("/api/v1/deployments").status_code == 200
        stranger = lab.client("line-2")
        with tls_client(base, *stranger, lab.bundle) as other:
            assert other.get("/api/v1/deployments").status_code == 403


def test_issue_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca = make_ca("plant.test")
    ca.write_key(tmp_path / "ca")
    base = ["clients", "issue", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "o")]
    code, _, err = run(capsys, *base, "x", "--ca", str(tmp_path / "missing"), "--wfm-id", "w")
    assert code == 2 and "cannot load" in err
    code, _, err = run(capsys, *base, "a/b", "--ca", str(tmp_path / "ca"), "--wfm-id", "w")
    assert code == 2 and "client id" in err
    code, _, err = run(capsys, *base, "x", "--ca", str(tmp_path / "ca"), "--wfm-id", "..")
    assert code == 2 and "wfm id" in err
    plain = make_ca("plant.test")
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    # A CA whose certificate names no trust domain needs --trust-domain.
    anonymous = issue_svid(plain, None, ca_flag=True, common_name="anonymous CA")
    write(plain_dir / "ca.pem", anonymous.cert)
    write(plain_dir / "ca-key.pem", anonymous.key)
    code, _, err = run(capsys, *base, "x", "--ca", str(plain_dir), "--wfm-id", "w")
    assert code == 2 and "--trust-domain" in err
    code, _, _ = run(capsys, *base, "x", "--ca", str(plain_dir), "--wfm-id", "w",
                     "--trust-domain", "other.test")
    assert code == 0


def test_import_svids_and_rc2_certificates(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    lab = make_lab(tmp_path / "pki")
    data = tmp_path / "data"
    cert, _ = lab.client("cam-3")
    code, out, _ = run(capsys, "clients", "import", "cam-3", "--cert", str(cert), "--data",
                       str(data), "--trust-domain", lab.trust_domain, "--wfm-id", lab.wfm_id)
    assert code == 0 and "imported spiffe://" in out
    assert listing(capsys, data)["cam-3"]["svidSource"] == "imported"
    refusals = {
        "names client 'cam-3', not 'cam-4'": ("cam-4", cert, ()),
        "names WFM": ("cam-3", cert, ("--wfm-id", "other")),
        "trust domain": ("cam-3", cert, ("--trust-domain", "other.test")),
        "not a Margo client ID": ("cam-3", lab.wfm_cert, ()),
        "cA=true": ("cam-3", lab.client("cam-3", "ca-flag", ca_flag=True)[0], ()),
    }
    for message, (client, path, extra) in refusals.items():
        code, _, err = run(capsys, "clients", "import", client, "--cert", str(path), "--data",
                           str(data), *extra)
        assert code == 2 and message in err, (message, err)
    junk = tmp_path / "junk.pem"
    junk.write_text("nothing")
    assert run(capsys, "clients", "import", "x", "--cert", str(junk), "--data", str(data))[0] == 2

    _, device = make_self_signed()
    device_pem = write(tmp_path / "device.pem", device)
    code, out, _ = run(capsys, "clients", "import", "press-1", "--cert", str(device_pem),
                       "--data", str(data))
    assert code == 0 and "rc.2 key" in out
    assert listing(capsys, data)["press-1"]["signingKeys"] == 1
    code, _, err = run(capsys, "clients", "import", "press-2", "--cert", str(device_pem),
                       "--data", str(data))
    assert code == 2 and "already belongs to client 'press-1'" in err
    _, ed = make_self_signed("ed25519")
    code, _, err = run(capsys, "clients", "import", "press-3", "--cert",
                       str(write(tmp_path / "ed.pem", ed)), "--data", str(data))
    assert code == 2 and "rc.2 algorithm" in err


def test_add_list_and_retire(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    code, out, _ = run(capsys, "clients", "add", "dev-1", "--data", str(data), "--json")
    assert code == 0 and json.loads(out)["clientId"] == "dev-1"
    code, out, _ = run(capsys, "clients", "add", "dev-2", "--data", str(data))
    assert code == 0 and "token" in out
    assert run(capsys, "clients", "retire", "dev-2", "--data", str(data))[0] == 0
    code, _, err = run(capsys, "clients", "retire", "nobody", "--data", str(data))
    assert code == 2 and "no client 'nobody'" in err
    code, out, _ = run(capsys, "clients", "list", "--data", str(data))
    lines = dict(line.split("\t", 1) for line in out.splitlines())
    assert lines["dev-1"].startswith("active\ttoken")
    assert lines["dev-2"].startswith("retired")
    rows = listing(capsys, data)
    assert rows["dev-1"]["token"] and rows["dev-2"]["retired"]
    # adding a retired client again does not silently undo the retirement (issue 29, 5)
    code, out, err = run(capsys, "clients", "add", "dev-2", "--data", str(data))
    assert code == 2 and "client 'dev-2' is retired" in err and "--reactivate" in err
    assert listing(capsys, data)["dev-2"]["retired"]
    code, out, _ = run(capsys, "clients", "add", "dev-2", "--reactivate", "--data", str(data))
    assert code == 0 and not listing(capsys, data)["dev-2"]["retired"]
    # an id the server would refuse where it enters is refused here too, nothing written
    for bad in ("a" * 129, "..", "dev 3", "dév"):
        code, _, err = run(capsys, "clients", "add", bad, "--data", str(data))
        assert code == 2 and "clients add: a client id" in err, err
    assert set(listing(capsys, data)) == {"dev-1", "dev-2"}
    # a damaged database: refused with what to do, no traceback, nothing written
    (data / "wfm.sqlite").write_bytes(b"")
    for name in ("-wal", "-shm"):
        (data / f"wfm.sqlite{name}").unlink(missing_ok=True)
    code, _, err = run(capsys, "clients", "add", "dev-3", "--data", str(data))
    assert code == 2 and "the server's database is empty (0 bytes)" in err, err
    assert (data / "wfm.sqlite").stat().st_size == 0


def test_trust_rotate_checks_and_installs_atomically(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    first, second = make_ca("plant.test"), make_ca("plant.test")
    target = data / "trust" / "bundle.pem"

    def jwks(ca: Ca, sequence: int) -> Path:
        der = ca.cert.public_bytes(serialization.Encoding.DER)
        path = tmp_path / f"bundle-{sequence}.json"
        path.write_text(json.dumps({"spiffe_sequence": sequence, "keys": [
            {"use": "x509-svid", "kty": "EC", "x5c": [base64.b64encode(der).decode()]}]}))
        return path

    rotate = ["trust", "rotate", "--data", str(data), "--bundle"]
    code, out, _ = run(capsys, *rotate, str(first.write(tmp_path / "first.pem")))
    assert code == 0 and "1 anchor(s)" in out
    assert spiffe.load_trust_bundle(target) == [first.cert]
    assert run(capsys, *rotate, str(jwks(second, 5)))[0] == 0
    assert spiffe.load_trust_bundle(target) == [second.cert]
    code, _, err = run(capsys, *rotate, str(jwks(first, 4)))
    assert code == 2 and "regressed" in err
    assert spiffe.load_trust_bundle(target) == [second.cert]  # untouched
    assert run(capsys, *rotate, str(jwks(first, 4)), "--force")[0] == 0
    for bad in (b"", b'{"keys": []}', b"junk"):
        (tmp_path / "bad").write_bytes(bad)
        code, _, err = run(capsys, *rotate, str(tmp_path / "bad"))
        assert code == 2 and "trust rotate" in err
    assert spiffe.load_trust_bundle(target) == [first.cert]
    elsewhere = tmp_path / "custom" / "anchors.pem"
    assert run(capsys, *rotate, str(second.write(tmp_path / "s.pem")), "--target",
               str(elsewhere))[0] == 0
    assert spiffe.load_trust_bundle(elsewhere) == [second.cert]
    assert not list(target.parent.glob(".bundle-*"))  # no temporary left behind
