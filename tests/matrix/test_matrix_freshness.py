"""The read API's freshness (docs/server.md, "Freshness") follows the device in every cell:
`current` once its deployment is installed, and again once a reconfiguration (which leaves
the old `installed` report about other bytes) is installed. rc.2 and Oct-2024 reports carry
no adoptedManifestVersion field: the server attributes them to what the device adopted
(wfm.fleet.attribution; issue 28's first defect, when they never counted)."""

from __future__ import annotations

from collections.abc import Callable

from kits.matrixkit import Cell, MatrixDevice

FEATURE = "freshness"
#: In `make test`: every row on render (freshness follows what a row reports; the lifecycle
#: feature's quick cells cover the engines and the replicas).
QUICK = frozenset({"rc3-render-sqlite", "rc2-render-sqlite", "oct2024-render-sqlite"})


def test_current_once_installed_and_again_after_a_reconfiguration(
        cell: Cell, matrix_device: Callable[..., MatrixDevice]) -> None:
    device = matrix_device()
    device.start()
    device.wait_settled(device.deploy())
    device.wait_freshness("current")

    device.wait_settled(device.reconfigure("Servus"))
    device.wait_freshness("current")
