"""The compile service's debounce: triggers that may be the first of a burst (capability
reports) wait for it to settle; one that is a single event (a push, a webhook's fetch, an
operator's action: `trigger(settle=False)`) compiles at once, and cuts a debounce already
under way short. Real Git and a real fleet source; the debounce is long (30 s) so that a
compile seen within seconds can only have skipped it."""

from __future__ import annotations

import time
from pathlib import Path

from kits.fleetkit import Fleet, app, device, intent

from compiler.compilation import CompileReport
from compiler.snapshot import snapshot_from_documents
from tools.polling import poll_until
from wfm.fleet.compiles import CompileService, SourceConfig

LONG_DEBOUNCE = 30.0


def _service(root: Path, compiled: list[CompileReport | None]) -> CompileService:
    fleet = Fleet(root / "fleet")
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web")
    fleet.devices["edge-0"] = device("edge-0")
    fleet.write()
    return CompileService(
        root / "repos", SourceConfig(fleet.source),
        lambda trusted: snapshot_from_documents(dict(fleet.devices), trusted=trusted),
        compiled.append, debounce=LONG_DEBOUNCE)


def test_a_single_event_compiles_without_the_debounce(tmp_path: Path) -> None:
    compiled: list[CompileReport | None] = []
    service = _service(tmp_path, compiled)
    try:
        service.trigger(settle=False)
        poll_until("a push's compile started without the 30 s debounce",
                   lambda: service.compiles == 1, timeout=10)
        assert service.last_error is None and len(compiled) == 1
    finally:
        service.stop()


def test_a_single_event_cuts_a_settling_burst_short(tmp_path: Path) -> None:
    compiled: list[CompileReport | None] = []
    service = _service(tmp_path, compiled)
    try:
        service.trigger()  # a capability report: waits for more
        time.sleep(0.5)
        assert service.compiles == 0, "a trigger that may start a burst waits the debounce"
        service.trigger(settle=False)
        poll_until("the push ended the debounce the report had started",
                   lambda: service.compiles == 1, timeout=10)
        assert service.wait_idle(timeout=10) and service.compiles == 1  # one compile for both
    finally:
        service.stop()


def test_stopping_ends_a_debounce_without_compiling(tmp_path: Path) -> None:
    compiled: list[CompileReport | None] = []
    service = _service(tmp_path, compiled)
    service.trigger()
    time.sleep(0.2)
    started = time.monotonic()
    service.stop()
    assert time.monotonic() - started < LONG_DEBOUNCE / 2, "stop waited out the debounce"
    assert service.compiles == 0 and compiled == []
