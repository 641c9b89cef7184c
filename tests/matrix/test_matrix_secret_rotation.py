"""Key rotations in every cell (issue 32): the device's key (`margo device rotate-key`),
then the fleet key (`margo secrets rotate-key`, then `--finish`). Each time the server seals
every value anew, the device reports it installed and the engine keeps running the same
greeting; afterwards a new value encrypted to the new fleet key reaches the engine, and the
plaintexts are still nowhere but the engine (`test_matrix_secrets.leaks`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kits.matrixkit import Cell, MatrixDevice, Workload
from test_matrix_secrets import FIRST, SECOND, leaks, server_data

from compiler.secrets import FleetKey

FEATURE = "rotation"
#: Not in `make test` (its time budget): `make matrix` runs every cell; `make test` has the
#: rotations' parts (tests/cli/test_secrets_command.py, tests/reconciler/
#: test_encryption_key.py and test_sealed_values.py, tests/compiler/test_secret_sealing.py).
QUICK: frozenset[str] = frozenset()


def margo(*args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "margo_cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_device_and_fleet_key_rotations_reseal_and_keep_it_running(
        cell: Cell, matrix_device: Callable[..., MatrixDevice]) -> None:
    """A device key rotated (`margo device rotate-key`), then the fleet key
    (`margo secrets rotate-key`, then `--finish`): each time every value is sealed anew,
    reported installed, and the engine keeps running the same greeting; a new value
    encrypted to the new fleet key reaches it afterwards."""
    device = matrix_device(sensitive=True)
    device.start()
    [first] = device.wait_settled(device.deploy(greeting=FIRST))
    device.wait_workloads([Workload("1.0.0", FIRST)])

    change = device.change()
    out = margo("device", "rotate-key", "--config", str(device.config), cwd=device.home)
    assert FIRST not in out
    [device_rotated] = device.wait_settled(change)
    device.wait_workloads([Workload("1.0.0", FIRST)])

    host = device.host
    key = server_data(device) / "fleet.key"
    change = device.change()
    margo("secrets", "rotate-key", "--key", str(key), "--source", str(host.source),
          cwd=device.home)
    [fleet_rotated] = device.wait_settled(change)
    device.wait_workloads([Workload("1.0.0", FIRST)])
    margo("secrets", "rotate-key", "--finish", "--key", str(key), "--source",
          str(host.source), cwd=device.home)
    host.fleet_key = FleetKey.load(key)  # the store's other devices encrypt to it too

    [reconfigured] = device.wait_settled(device.reconfigure(SECOND))
    device.wait_workloads([Workload("1.0.0", SECOND)])
    digests = {d["digest"] for d in (first, device_rotated, fleet_rotated, reconfigured)}
    assert len(digests) == 4
    assert leaks(device, [FIRST.encode(), SECOND.encode()]) == []
