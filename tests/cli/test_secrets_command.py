"""`margo secrets`: the fleet key's life (keygen, rotate-key, --finish), encrypting a
parameter, and checking the source's secrets, on real files. No plaintext ever appears in
what a command prints."""

from __future__ import annotations

import io
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from compiler.secrets import FleetKey, SecretError, encrypt_secret, new_identity_text
from margo.loading import load_document
from margo_cli.main import main

PASSWORD = "s3cret-Pa55word"
TOKEN = "tok-0123456789abcdef"

INTENT = """\
# The line monitor, with its database password kept secret.
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata:
  name: line-monitor
spec:
  application:
    id: com-example-line-monitor
  parameters:
    # the database
    db-password:
      secret: |
{first}
    greeting: "hello"   # a comment that stays
    api-token:
      secret: |-
{second}
    replicas: 2
"""

PLAIN = """\
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata: {name: plain}   # no secrets here
spec:
  application: {id: com-example-hello-world}
"""


def margo(capsys: pytest.CaptureFixture[str], *args: object,
          stdin: bytes | None = None) -> tuple[int, str, str]:
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    try:
        code = main([str(a) for a in args])
    finally:
        sys.stdin = sys.__stdin__
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err and TOKEN not in out + err
    return code, out, err


def _key(path: Path) -> FleetKey:
    path.write_text(new_identity_text())
    path.chmod(0o600)
    return FleetKey.load(path)


def _block(armored: str, indent: int) -> str:
    return "\n".join(" " * indent + line for line in armored.splitlines())


def _intent(first: str, second: str) -> str:
    return INTENT.format(first=_block(first, 8), second=_block(second, 8))


def _secrets(path: Path) -> dict[str, str]:
    parameters = load_document(path.read_text()).value["spec"]["parameters"]
    return {name: value["secret"] for name, value in parameters.items()
            if isinstance(value, dict)}


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[Path, Path, FleetKey]:
    """A source with one intent holding two secrets (`|` and `|-`) and one without."""
    key = _key(tmp_path / "fleet.key")
    deployments = tmp_path / "source" / "deployments"
    deployments.mkdir(parents=True)
    (deployments / "line-monitor.yaml").write_text(_intent(
        encrypt_secret(PASSWORD, [key.recipient]), encrypt_secret(TOKEN, [key.recipient])))
    (deployments / "plain.yaml").write_text(PLAIN)
    return tmp_path / "source", tmp_path / "fleet.key", key


def _snapshot(*roots: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for root in roots
            for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file()}


def test_keygen_writes_a_private_key_and_never_overwrites_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "keys" / "fleet.key"
    code, out, _err = margo(capsys, "secrets", "keygen", "--out", out_file)
    assert code == 0
    assert stat.S_IMODE(out_file.stat().st_mode) == 0o600
    recipient = out.strip()
    assert recipient.startswith("age1") and FleetKey.load(out_file).recipient == recipient
    assert margo(capsys, "secrets", "recipient", "--key", out_file)[1].strip() == recipient
    before = out_file.read_bytes()
    code, _out, err = margo(capsys, "secrets", "keygen", "--out", out_file)
    assert code == 2 and "exists" in err and out_file.read_bytes() == before
    code, out, _err = margo(capsys, "secrets", "keygen", "--out", out_file, "--force")
    assert code == 0 and out.strip() != recipient


def test_encrypt_prints_a_secret_the_fleet_key_opens(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = _key(tmp_path / "fleet.key")
    code, out, _err = margo(capsys, "secrets", "encrypt", "--key", tmp_path / "fleet.key",
                            stdin=f"{PASSWORD}\n".encode())
    assert code == 0 and out.startswith("secret: |\n  -----BEGIN AGE ENCRYPTED FILE-----")
    assert key.decrypt(yaml.safe_load(out)["secret"]) == PASSWORD  # one newline dropped

    code, out, _err = margo(capsys, "secrets", "encrypt", "--recipient", key.recipient,
                            "--name", "db-password", stdin=PASSWORD.encode())
    assert code == 0 and key.decrypt(yaml.safe_load(out)["db-password"]["secret"]) == PASSWORD

    (tmp_path / "token").write_text(f"{TOKEN}\n")
    code, out, _err = margo(capsys, "secrets", "encrypt", "--recipient", key.recipient,
                            "--from-file", tmp_path / "token", "--armor-only")
    assert code == 0 and out.startswith("-----BEGIN AGE ENCRYPTED FILE-----")
    assert key.decrypt(out) == f"{TOKEN}\n"  # a file is taken verbatim

    code, _out, err = margo(capsys, "secrets", "encrypt", "--recipient", key.recipient,
                            stdin=b"\n")
    assert code == 2 and "empty" in err
    code, _out, err = margo(capsys, "secrets", "encrypt", "--recipient", "age1nope",
                            stdin=PASSWORD.encode())
    assert code == 2 and "recipient" in err


def test_encrypt_through_the_installed_command(tmp_path: Path) -> None:
    key = _key(tmp_path / "fleet.key")
    margo_bin = Path(sys.executable).with_name("margo")
    done = subprocess.run([str(margo_bin), "secrets", "encrypt", "--key",
                           str(tmp_path / "fleet.key")], input=f"{PASSWORD}\n",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    assert key.decrypt(yaml.safe_load(done.stdout)["secret"]) == PASSWORD


def test_rotate_key_reencrypts_in_place_and_finish_drops_the_old_key(
        fleet: tuple[Path, Path, FleetKey], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source, key_file, old = fleet
    intent, plain = source / "deployments" / "line-monitor.yaml", source / "deployments" / \
        "plain.yaml"
    plain_before = plain.read_bytes()
    before = _snapshot(source, key_file)
    code, out, _err = margo(capsys, "secrets", "rotate-key", "--key", key_file, "--source",
                            source, "--dry-run")
    assert code == 0 and "would re-encrypt 2 secret(s)" in out
    assert _snapshot(source, key_file) == before

    code, out, err = margo(capsys, "secrets", "rotate-key", "--key", key_file, "--source",
                           source)
    assert code == 0, err
    assert "re-encrypted 2 secret(s)" in out and "--finish" in err
    secrets = _secrets(intent)
    # Every byte but the armored lines is the same: the text rebuilt around the new values.
    assert intent.read_text() == _intent(secrets["db-password"], secrets["api-token"])
    assert plain.read_bytes() == plain_before
    for value in secrets.values():
        with pytest.raises(SecretError):
            old.decrypt(value)
    both = FleetKey.load(key_file)
    assert len(both.identities) == 2 and str(both.identities[1]) == str(old.identities[0])
    new = FleetKey(both.identities[:1])
    assert (new.decrypt(secrets["db-password"]), new.decrypt(secrets["api-token"])) == (
        PASSWORD, TOKEN)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600

    code, out, _err = margo(capsys, "secrets", "rotate-key", "--finish", "--key", key_file,
                            "--source", source)
    assert code == 0 and "dropped 1" in out
    finished = FleetKey.load(key_file)
    assert [str(i) for i in finished.identities] == [str(new.identities[0])]
    assert margo(capsys, "secrets", "check", "--source", source, "--key", key_file)[0] == 0


def test_rotate_key_changes_nothing_when_a_secret_is_for_another_key(
        fleet: tuple[Path, Path, FleetKey], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source, key_file = fleet[:2]
    stranger = _key(tmp_path / "other.key")
    (source / "deployments" / "other.yaml").write_text(PLAIN.replace("name: plain", "name: o")
        + "  parameters:\n    pw:\n      secret: |\n"
        + _block(encrypt_secret(PASSWORD, [stranger.recipient]), 8) + "\n")
    before = _snapshot(source, key_file)
    code, _out, err = margo(capsys, "secrets", "rotate-key", "--key", key_file, "--source",
                            source)
    assert code == 1
    assert f"{source}/deployments/other.yaml:8:" in err and "changed nothing" in err
    assert _snapshot(source, key_file) == before


def test_rotate_key_rewrites_a_quoted_secret_as_a_quoted_one(
        fleet: tuple[Path, Path, FleetKey], capsys: pytest.CaptureFixture[str]) -> None:
    """What a YAML emitter writes (a double-quoted scalar with \\n escapes, here inside a
    flow mapping) is rewritten in the same style, everything else kept."""
    source, key_file, key = fleet
    armored = encrypt_secret(PASSWORD, [key.recipient]).replace("\n", "\\n")
    path = source / "deployments" / "quoted.yaml"
    path.write_text(PLAIN + f'  parameters:\n    pw: {{secret: "{armored}"}}  # kept\n')
    code, _out, err = margo(capsys, "secrets", "rotate-key", "--key", key_file, "--source",
                            source)
    assert code == 0, err
    text = path.read_text()
    assert text.startswith(PLAIN + '  parameters:\n    pw: {secret: "-----BEGIN AGE')
    assert text.endswith('"}  # kept\n') and PASSWORD not in text
    new = FleetKey.load(key_file)
    [(_, value)] = _secrets(path).items()
    assert FleetKey(new.identities[:1]).decrypt(value) == PASSWORD


def test_check_finds_a_damaged_secret_by_line_without_a_key(
        fleet: tuple[Path, Path, FleetKey], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source, key_file = fleet[:2]
    code, out, _err = margo(capsys, "secrets", "check", "--source", source)
    assert code == 0 and "2 secret(s), all well-formed" in out
    assert margo(capsys, "secrets", "check", "--source", source, "--key", key_file)[0] == 0

    intent = source / "deployments" / "line-monitor.yaml"
    lines = intent.read_text().splitlines(keepends=True)
    assert lines[12].strip().startswith("-----BEGIN")
    lines[13] = lines[13].replace(lines[13].strip(), "not*base64!")
    intent.write_text("".join(lines))
    code, _out, err = margo(capsys, "secrets", "check", "--source", source)
    assert code == 1
    assert f"{intent}:12:" in err and "db-password" in err and "base64" in err


def test_check_with_a_key_finds_a_secret_it_does_not_open(
        fleet: tuple[Path, Path, FleetKey], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source = fleet[0]
    other = tmp_path / "other.key"
    _key(other)
    assert margo(capsys, "secrets", "check", "--source", source)[0] == 0
    code, _out, err = margo(capsys, "secrets", "check", "--source", source, "--key", other)
    assert code == 1 and err.count("does not decrypt") == 2
    shutil.rmtree(source / "deployments")
    code, out, _err = margo(capsys, "secrets", "check", "--source", source)
    assert code == 0 and "0 secret(s)" in out
    assert margo(capsys, "secrets", "check", "--source", tmp_path / "missing")[0] == 2
