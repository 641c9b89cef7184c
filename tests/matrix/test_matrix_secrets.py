"""Secrets in every cell (issue 32): the application's greeting is a sensitive parameter, the
intent gives it encrypted to the fleet key, the server seals it to the device's own key, and
the real engine runs with the plaintext. Then a byte-level search for the plaintext finds
nothing anywhere else: not in the server's data directories and logs (SQLite), not in any
table of the PostgreSQL database (replicas), not in any Git object of any repository (every
branch and bundle the devices were served comes from those), not in the device's data
directory or its log. Only the engine holds it, and the render driver's output (that
driver's product, written owner-only; docs/device.md "Sealed values")."""

from __future__ import annotations

import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
from kits.matrixkit import Cell, MatrixDevice, Workload
from kits.matrixparts import PRIVATE_PASSWORD, PRIVATE_USER
from kits.pgkit import database_for

from compiler.secrets import encrypt_secret

FEATURE = "secrets"
#: In `make test`: rc.2's signed requests through the replicas, their PostgreSQL searched
#: (`make matrix` runs every cell; the engines' own sealed-value and grant tests,
#: tests/reconciler/test_sealed_values.py and test_registry_grants.py, run in `make test`).
QUICK = frozenset({"rc2-render-replicas"})
FIRST, SECOND = "Hush-7f3a9c1e-first", "Hush-52be0d44-second"


def files_under(root: Path, *, skip: Path | None = None) -> Iterator[Path]:
    for path in root.rglob("*"):
        if skip is not None and path.is_relative_to(skip):
            continue
        if path.is_file() and not path.is_symlink():
            yield path


def git_objects(root: Path) -> Iterator[tuple[Path, bytes]]:
    """Every object of every Git repository under `root`, decompressed (loose and packed
    objects are zlib-compressed and deltified: only Git itself reads them back)."""
    for head in root.rglob("HEAD"):
        repository = head.parent
        if not (repository / "objects").is_dir():
            continue
        names = subprocess.run(["git", "-C", str(repository), "cat-file",
                                "--batch-all-objects", "--batch-check=%(objectname)"],
                               check=True, capture_output=True).stdout
        yield repository, subprocess.run(["git", "-C", str(repository), "cat-file", "--batch"],
                                         input=names, check=True, capture_output=True).stdout


def database_rows(url: str) -> Iterator[tuple[str, bytes]]:
    """Every row of every table of the server's PostgreSQL database, as text."""
    with psycopg.connect(url, autocommit=True) as conn:
        tables = [row[0] for row in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")]
        for table in tables:
            rows = conn.execute(f'SELECT t::text FROM "{table}" t').fetchall()
            yield table, "\n".join(row[0] for row in rows).encode()


def leaks(device: MatrixDevice, secrets: list[bytes]) -> list[str]:
    """Where any of `secrets` is found outside the engine (and the render output)."""
    found: list[str] = []
    places: list[tuple[str, bytes]] = []
    workdir = server_data(device)  # data, replicas' data, server logs, fleet source
    places += [(str(p), p.read_bytes()) for p in files_under(workdir)]
    places += [(f"git objects of {r}", data) for r, data in git_objects(workdir)]
    if device.host.store == "replicas":
        places += [(f"PostgreSQL table {t}", data)
                   for t, data in database_rows(database_for(workdir / "data"))]
    rendered = device.home / "rendered"
    places += [(str(p), p.read_bytes()) for p in files_under(device.home, skip=rendered)]
    for where, data in places:
        found += [f"{where}: {secret.decode()}" for secret in secrets if secret in data]
    return found


def test_a_sensitive_parameter_reaches_only_the_engine(
        cell: Cell, matrix_device: Callable[..., MatrixDevice]) -> None:
    device = matrix_device(sensitive=True)
    device.start()

    [deployed] = device.wait_settled(device.deploy(greeting=FIRST))
    device.wait_workloads([Workload("1.0.0", FIRST)])

    [reconfigured] = device.wait_settled(device.reconfigure(SECOND))
    device.wait_workloads([Workload("1.0.0", SECOND)])
    assert deployed["deploymentId"] == reconfigured["deploymentId"]

    assert leaks(device, [FIRST.encode(), SECOND.encode()]) == []
    # The search reads what it claims to: the envelopes are in the Git objects it read.
    assert server_data(device) and any(b"margo-sealed:v1:" in data
                                       for _, data in git_objects(server_data(device)))
    if cell.driver == "render":  # the product holds the plaintext, for its owner only
        holding = [p for p in files_under(device.home / "rendered")
                   if SECOND.encode() in p.read_bytes()]
        assert holding and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in holding)


def server_data(device: MatrixDevice) -> Path:
    assert device.host.server.data_dir is not None
    return device.host.server.data_dir.parent



def test_a_granted_credential_pulls_from_a_private_registry(
        cell: Cell, matrix_device: Callable[..., MatrixDevice]) -> None:
    """The application's chart or Compose package is in a registry that refuses anonymous
    pulls: without a grant the deployment fails to pull; with the intent's
    `registryCredentials` (the password an age secret to the fleet key) the device pulls
    it and runs it, and the password is nowhere but in the registry's own files."""
    device = matrix_device("grant", private=True)
    device.start()
    [refused] = device.wait_settled(device.deploy(greeting="Hello"), state="failed")
    assert "PULL_FAILED" in str(refused), refused

    grant = {"registry": device.parts.private_registry(), "username": PRIVATE_USER,
             "password": {"secret": encrypt_secret(PRIVATE_PASSWORD,
                                                   [device.host.fleet_key.recipient])}}
    # An Oct-2024 document has no place for grants (issue 33: the device would get a
    # located problem instead); the Git row's device, our client, reads rc.3 documents.
    forced = {"outputShape": "rc.3"} if cell.row.api == "oct-2024" else {}
    device.wait_settled(device.deploy(greeting="Hello", registryCredentials=[grant],
                                      **forced))
    device.wait_workloads([Workload("1.0.0", "Hello")])
    assert leaks(device, [PRIVATE_PASSWORD.encode()]) == []
