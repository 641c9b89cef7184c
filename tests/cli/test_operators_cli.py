"""`margo operators add|list|revoke|rotate` and `margo audit` against a server's store
(docs/operations.md, "Operators and roles", "Audit trail"), in this process, once on a
SQLite data directory and once on a PostgreSQL database: tokens printed once and never
stored, clear refusals (exit 2), and every change in the trail as `local:<OS user>`, the
client commands' and `margo trust rotate` too."""

from __future__ import annotations

import getpass
import json
import time
from pathlib import Path

import pytest
from kits.pkikit import make_ca

from margo_cli.audit_command import parse_since
from margo_cli.main import main as margo
from wfm.fleet.audit import entries
from wfm.identity.operators import Role
from wfm.identity.operatorstore import StoreOperators
from wfm.store.opening import open_database

ME = f"local:{getpass.getuser()}"


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> list[str]:
    """The options naming the store: a data directory, or a PostgreSQL database."""
    if request.param == "sqlite":
        return ["--data", str(tmp_path / "data")]
    return ["--data", str(tmp_path / "data"), "--database", request.getfixturevalue("pg_url")]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = margo(list(args))
    except SystemExit as exc:  # argparse refuses an option value itself
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_operators_add_list_rotate_revoke(target: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "operators", "add", "ada", "--role", "admin", "--json", *target)
    assert code == 0
    ada = json.loads(out)
    assert ada["name"] == "ada" and ada["role"] == "admin" and len(ada["token"]) >= 40
    code, out, _ = run(capsys, "operators", "add", "otto", "--role", "operator", *target)
    assert code == 0 and "shown once" in out
    otto = out.split("token", 1)[1].split()[0]
    code, out, _ = run(capsys, "operators", "list", "--json", *target)
    listed = json.loads(out)
    assert [(o["name"], o["role"], o["revoked"]) for o in listed] == [
        ("ada", "admin", False), ("otto", "operator", False)]
    assert ada["token"] not in out and otto not in out
    code, out, _ = run(capsys, "operators", "list", *target)
    assert code == 0 and out.startswith("ada\tadmin\tactive\tcreated ")

    code, out, _ = run(capsys, "operators", "rotate", "otto", "--json", *target)
    assert code == 0
    rotated = json.loads(out)["token"]
    db = open_database(target[-1] if "--database" in target else tmp_path / "data" /
                       "wfm.sqlite")
    try:
        lookup = StoreOperators(db)
        assert lookup(otto) is None  # the old token proves nothing any more
        found = lookup(rotated)
        assert found is not None and found.name == "otto" and found.role is Role.OPERATOR
        assert run(capsys, "operators", "revoke", "otto", *target)[0] == 0
        assert StoreOperators(db)(rotated) is None
        assert StoreOperators(db).registered()
        trail = entries(db)
    finally:
        db.close()
    assert [(e.actor, e.via, e.action, e.target, e.detail) for e in trail] == [
        (ME, "local", "operator.add", "ada", "role admin"),
        (ME, "local", "operator.add", "otto", "role operator"),
        (ME, "local", "operator.rotate", "otto", None),
        (ME, "local", "operator.revoke", "otto", None)]
    code, out, _ = run(capsys, "operators", "list", *target)
    assert "otto\toperator\trevoked " in out


def test_operators_refuse_bad_input_with_exit_2(target: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "operators", "add", "vera", "--role", "viewer", *target)[0] == 0
    cases = {
        ("add", "bob", "--role", "root"): "unknown role 'root': choose viewer, operator or "
                                          "admin",
        ("add", "vera", "--role", "admin"): "operator 'vera' exists (role viewer); names are "
                                            "not reused",
        ("add", "oidc:x", "--role", "admin"): "names with ':' are the server's own",
        ("add", "", "--role", "admin"): "operator name ''",
        ("add", "anonymous", "--role", "viewer"): "'anonymous' is the server's own",
        ("rotate", "nobody"): "no operator 'nobody'",
        ("revoke", "nobody"): "no operator 'nobody'",
    }
    for args, message in cases.items():
        code, out, err = run(capsys, "operators", *args, *target)
        assert code == 2 and message in err, (args, err)
        assert out == ""
    assert run(capsys, "operators", "revoke", "vera", *target)[0] == 0
    code, _, err = run(capsys, "operators", "revoke", "vera", *target)
    assert code == 2 and "operator 'vera' is revoked" in err
    code, _, err = run(capsys, "operators", "add", "vera", "--role", "viewer", *target)
    assert code == 2 and "exists (revoked)" in err


def test_margo_audit_filters_and_exports_json_lines(target: list[str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    assert run(capsys, "clients", "add", "edge", *target)[0] == 0
    assert run(capsys, "clients", "retire", "edge", *target)[0] == 0
    bundle = make_ca("plant.test").write(tmp_path / "ca.pem")
    assert run(capsys, "trust", "rotate", "--bundle", str(bundle), *target)[0] == 0
    assert run(capsys, "operators", "add", "ada", "--role", "admin", *target)[0] == 0

    code, out, _ = run(capsys, "audit", "--jsonl", *target)
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(e["actor"], e["action"], e["target"], e["outcome"]) for e in lines] == [
        (ME, "client.add", "edge", "ok"), (ME, "client.retire", "edge", "ok"),
        (ME, "trust.rotate", str(tmp_path / "data" / "trust" / "bundle.pem"), "ok"),
        (ME, "operator.add", "ada", "ok")]
    assert all(e["at"].endswith("Z") and e["id"] for e in lines)
    code, out, _ = run(capsys, "audit", "--json", "--limit", "1", *target)
    assert [e["action"] for e in json.loads(out)] == ["operator.add"]
    assert run(capsys, "audit", "--jsonl", "--actor", "someone-else", *target)[1] == ""
    assert run(capsys, "audit", "--jsonl", "--since", "1h", *target)[1].count("\n") == 4
    assert run(capsys, "audit", "--jsonl", "--since", "2999-01-01", *target)[1] == ""
    code, out, _ = run(capsys, "audit", *target)
    assert out.splitlines()[0].split("\t")[1:6] == [ME, "admin", "client.add", "edge", "ok"]
    for bad in (["--since", "yesterday"], ["--limit", "0"]):
        code, _, err = run(capsys, "audit", *bad, *target)
        assert code == 2 and "margo audit" in err


def test_since_takes_ages_and_iso_times() -> None:
    now = 1_800_000_000.0
    assert parse_since("90s", now) == now - 90
    assert parse_since("30m", now) == now - 1800
    assert parse_since("1h", now) == now - 3600
    assert parse_since("7d", now) == now - 7 * 86400
    assert parse_since("2w", now) == now - 14 * 86400
    assert parse_since("2026-12-05T10:00:00Z") == parse_since("2026-12-05T10:00:00") \
        == parse_since("2026-12-05T11:00:00+01:00")
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_since("soon")
    assert time.time() - parse_since("0s") < 5
