"""Waiting polls over mutual TLS (issue 34): the rc.3 identity the standard prescribes, an
SVID on each side, through every layer the real `margo serve --tls-cert` stacks on uvicorn
(the TLS protocol that reads the client's certificate, the request-head deadline, the
closing notice, one write per answer) and the real `margo device run` with its SVID
(`identity.svid`, no token). tests/reconciler/test_waiting_polls.py runs the same over
plain HTTP with bearer tokens; the matrix's waiting feature (tests/matrix/
test_matrix_waiting.py) over each row, driver and store.

The device polls every `INTERVAL` seconds, far longer than the test: once the server holds
its poll, a push reaches it only through that held poll, and must be rendered within
`PROMPTLY` seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.chartkit import publish_example_charts
from kits.fleetserver import write_fleet
from kits.metricskit import held_polls, renewals
from kits.pkikit import Lab, make_lab, running_tls_server, tls_client

from tools.devices import engine_environment, intent
from tools.fleetserver import ROOT, capabilities
from tools.polling import poll_until
from tools.processes import stop

DEVICE = "mtls-waiting-device"
#: The device's polling interval: no scheduled cycle comes within the test.
INTERVAL = "3600s"
#: Seconds a push may take to reach the device through its held poll and be rendered.
PROMPTLY = 30.0


@pytest.fixture
def lab(tmp_path: Path) -> Lab:
    return make_lab(tmp_path / "pki")


@pytest.fixture
def fleet(registry: str, tmp_path: Path) -> Path:
    publish_example_charts(registry)
    return write_fleet(tmp_path / "fleet", registry=registry, intents={})


def write_device(home: Path, lab: Lab, base: str, wait: str) -> Path:
    """The device's directory: its SVID, the trust bundle, capabilities and configuration
    (rc.3, margo-rest source, render driver, waiting polls of `wait`)."""
    home.mkdir(parents=True)
    cert, key = lab.client(DEVICE)
    shutil.copy(cert, home / "svid.pem")
    shutil.copy(key, home / "svid-key.pem")
    shutil.copy(lab.bundle, home / "bundle.pem")
    (home / "capabilities.json").write_text(json.dumps(
        capabilities("k8s-single-amd64", DEVICE)))
    config = home / "device.yaml"
    config.write_text(json.dumps({
        "device": {"id": DEVICE},
        "server": {"url": base, "api": "rc.3", "timeout": "10s"},
        "source": {"type": "margo-rest"},
        "driver": {"type": "render", "outputDir": "rendered"},
        "dataDir": "data",
        "identity": {"svid": {"cert": "svid.pem", "key": "svid-key.pem"},
                     "trustBundle": "bundle.pem"},
        "capabilities": {"file": "capabilities.json"},
        "schedule": {"interval": INTERVAL, "wait": wait},
    }))
    return config


@pytest.fixture
def device_run(lab: Lab, fleet: Path, tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """`margo serve` over mTLS on the fleet and `margo device run` with its SVID, waiting
    60 s at a time: (the server's base URL, the device's rendered folder, its log)."""
    with device_running(lab, fleet, tmp_path, "60s") as running:
        yield running


@contextlib.contextmanager
def device_running(lab: Lab, fleet: Path, tmp_path: Path,
                   wait: str) -> Iterator[tuple[str, Path, Path]]:
    """`device_run`, the device's polls waiting `wait` at a time."""
    cert, key = lab.client("readiness")
    with running_tls_server(tmp_path / "data", lab, "--accept-clients", "*", "--source",
                            str(fleet), "--watch-source", ready=(cert, key)) as base:
        home = tmp_path / DEVICE
        config = write_device(home, lab, base, wait)
        log_path = home / "device.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "margo_cli.main", "device", "run", "--config",
                 str(config), "--log-level", "info"], cwd=ROOT, stdout=log, stderr=log,
                env=engine_environment())
            try:
                yield base, home / "rendered", log_path
            finally:
                stop(process, timeout=60)


def rendered_text(folder: Path) -> str:
    """Everything the render driver wrote, as one text."""
    return "".join(p.read_text(errors="replace") for p in sorted(folder.rglob("*"))
                   if p.is_file()) if folder.exists() else ""


def held(base: str, lab: Lab) -> int:
    """The polls the server holds (asked over mutual TLS, as an observer client)."""
    cert, key = lab.client("observer")
    with tls_client(base, cert, key, lab.bundle) as http:
        return held_polls(http)


def renewed_unparsed(base: str, lab: Lab) -> float:
    """The renewals the server matched by their bytes (`wfm.server.wire`)."""
    cert, key = lab.client("observer")
    with tls_client(base, cert, key, lab.bundle) as http:
        return renewals(http, "bytes")


def edit_intent(fleet: Path, greeting: str) -> None:
    path = fleet / "deployments" / f"{DEVICE}.yaml"
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(intent(DEVICE, greeting=greeting))
    os.replace(temporary, path)


def test_a_device_with_its_svid_learns_of_each_push_through_its_held_poll(
        device_run: tuple[str, Path, Path], fleet: Path, lab: Lab) -> None:
    base, rendered, log = device_run
    for greeting in ("Hello from mTLS", "Bonjour from mTLS"):
        poll_until("the device's poll held", lambda: held(base, lab) >= 1,
                   timeout=PROMPTLY, describe=lambda: log.read_text()[-2000:])
        edit_intent(fleet, greeting)
        poll_until(f"{greeting!r} rendered", lambda g=greeting: g in rendered_text(rendered),
                   timeout=PROMPTLY, describe=lambda: log.read_text()[-2000:])
    text = log.read_text()
    assert "Traceback" not in text and "stopped holding polls" not in text, text


def test_a_device_with_its_svid_has_its_renewals_matched_unparsed(
        lab: Lab, fleet: Path, tmp_path: Path) -> None:
    """Through the TLS layer too, the device's poll after a 304 arrives whole, byte for
    byte the one before, and is held again without being parsed (`wfm.server.wire`)."""
    edit_intent(fleet, "Hello from mTLS")
    with device_running(lab, fleet, tmp_path, "1s") as (base, rendered, log):
        poll_until("rendered", lambda: "Hello from mTLS" in rendered_text(rendered),
                   timeout=PROMPTLY, describe=lambda: log.read_text()[-2000:])
        before = renewed_unparsed(base, lab)
        poll_until("three renewals matched by their bytes",
                   lambda: renewed_unparsed(base, lab) >= before + 3, timeout=30,
                   describe=lambda: log.read_text()[-2000:])
    text = log.read_text()
    assert "Traceback" not in text and "stopped holding polls" not in text, text
