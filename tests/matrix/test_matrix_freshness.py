"""The read API's freshness (docs/server.md, "Freshness") follows the device in every cell:
`current` once its deployment is installed, and again once a reconfiguration (which leaves
the old `installed` report about other bytes) is installed.

Known to fail today for rows whose reports carry no adoptedManifestVersion (rc.2, Oct-2024
with Git): see `KNOWN_DEFECTS` in kits/matrixkit.py."""

from __future__ import annotations

from collections.abc import Callable

from kits.matrixkit import Cell, MatrixDevice

FEATURE = "freshness"


def test_current_once_installed_and_again_after_a_reconfiguration(
        cell: Cell, matrix_device: Callable[..., MatrixDevice]) -> None:
    device = matrix_device()
    device.start()
    device.wait_settled(device.deploy())
    device.wait_freshness("current")

    device.wait_settled(device.reconfigure("Servus"))
    device.wait_freshness("current")
