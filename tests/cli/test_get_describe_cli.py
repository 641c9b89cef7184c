"""`margo get` and `margo describe` against a real server (`conftest.cli_fleet`): every
kind as a table, JSON and YAML; label selectors; an error of many lines that stays one
row; `--watch` until Ctrl-C; a device and an intent described in full."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kits.clikit import CliFleet
from kits.fleetkit import device

from margo_cli.get_command import Printer
from margo_cli.main import main
from margo_cli.resources import KINDS
from margo_cli.selectors import SelectorError, matches, parse_selector
from margo_cli.tables import ELLIPSIS, cell
from tools.polling import poll_until

ROOT = Path(__file__).resolve().parents[2]


def margo(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`margo ARGV` in this process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> list[str]:
    return out.rstrip("\n").split("\n")[1:]


@pytest.mark.parametrize("kind", [k.name for k in KINDS])
def test_every_kind_lists_as_a_table_json_and_yaml(
        cli_fleet: CliFleet, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    code, out, _ = margo(capsys, "get", kind, "-o", "json", *cli_fleet.server())
    assert code == 0
    items = json.loads(out)["items"]
    assert items, f"the fleet has {kind}"
    code, out, _ = margo(capsys, "get", kind, "-o", "yaml", *cli_fleet.server())
    assert code == 0 and yaml.safe_load(out)["items"] == items
    code, out, _ = margo(capsys, "get", kind, *cli_fleet.server())
    headers = next(k.headers for k in KINDS if k.name == kind)
    assert code == 0 and out.split("\n")[0].split() == list(headers)
    assert len(table_rows(out)) == len(items)  # one row each, whatever their messages


def test_tables_say_what_each_kind_is(cli_fleet: CliFleet,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    _, devices, _ = margo(capsys, "get", "devices", "edge-a", "gpu-1", *cli_fleet.server())
    edge, gpu = table_rows(devices)
    assert edge.split()[:5] == ["edge-a", "edge", "rc.3", "device", "1"]
    assert "failed=1" in edge and "web: image pull failed: manifest unknown" + ELLIPSIS in edge
    assert gpu.split()[:5] == ["gpu-1", "edge", "rc.3", "device", "1"]
    _, intents, _ = margo(capsys, "get", "intents", *cli_fleet.server())
    rows = {line.split()[0]: line for line in table_rows(intents)}
    assert "deployments/broken.yaml" in rows["broken"] and "bogus" in rows["broken"]
    assert "label: site In (plant-a)" in rows["gpu"]
    assert rows["web"].split()[1:4] == ["com-example-app", "compose", "all"]
    _, apps, _ = margo(capsys, "get", "app", *cli_fleet.server())  # an alias
    assert table_rows(apps)[0].split()[:5] == ["com-example-app", "com-example-app", "1.0.0",
                                               "compose,", "helm"]
    _, rollouts, _ = margo(capsys, "get", "rollouts", *cli_fleet.server())
    assert table_rows(rollouts)[0].split()[:3] == ["web", "progressing", "1/2"]


def test_a_multiline_error_stays_one_clean_row(cli_fleet: CliFleet,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = margo(capsys, "get", "deployments", "-l", "site=plant-a",
                         *cli_fleet.server())
    assert code == 0
    rows = table_rows(out)
    assert sorted(r.split()[0] for r in rows) == ["edge-a", "gpu-1"]
    failed = next(r for r in rows if r.startswith("edge-a"))
    assert failed.endswith(f"image pull failed: manifest unknown{ELLIPSIS} [E_PULL]")
    assert "\x1b" not in out and "\t" not in out
    raw = json.loads(margo(capsys, "get", "deployments", "-o", "json", *cli_fleet.server())[1])
    assert any(d["error"] and d["error"]["message"].count("\n") == 2 for d in raw["items"])


@pytest.mark.parametrize(("selector", "expected"), [
    ("site=plant-a", ["edge-a", "gpu-1"]),
    ("site==plant-a,tier", ["edge-a"]),
    ("site!=plant-a", ["edge-b"]),
    ("!tier", ["gpu-1"]),
    ("site in (plant-b, plant-c)", ["edge-b"]),
    ("tier=edge,site notin (plant-a)", ["edge-b"]),
    ("nowhere", []),
])
def test_label_selectors_filter_devices(cli_fleet: CliFleet, capsys: pytest.CaptureFixture[str],
                                        selector: str, expected: list[str]) -> None:
    code, out, err = margo(capsys, "get", "devices", "-l", selector, "-o", "json",
                           *cli_fleet.server())
    assert code == 0, err
    found = sorted(d["deviceId"] for d in json.loads(out)["items"])
    assert [d for d in found if d in ("edge-a", "edge-b", "gpu-1")] == expected


def test_selectors_on_deployments_and_intents(cli_fleet: CliFleet,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = margo(capsys, "get", "deployments", "-l", "tier=edge", "-o", "json",
                      *cli_fleet.server())
    assert sorted(d["deviceId"] for d in json.loads(out)["items"]) == ["edge-a", "edge-b"]
    _, out, _ = margo(capsys, "get", "intents", "-l", "team=shop", *cli_fleet.server())
    assert [r.split()[0] for r in table_rows(out)] == ["web"]
    code, out, err = margo(capsys, "get", "apps", "-l", "team", *cli_fleet.server())
    assert code == 0 and out == "" and "no apps found" in err


@pytest.mark.parametrize("argv", [
    ["get", "devices", "-l", "site=(x)"],
    ["get", "devices", "-l", "a b"],
    ["get", "devices", "-l", "site in plant-a"],
    ["get", "devices", "--interval", "0", "--watch"],
    ["get", "devices", "--interval", "nan", "--watch"],
    ["get", "devices", "--interval", "inf", "--watch"],
])
def test_bad_options_are_usage_errors(cli_fleet: CliFleet, capsys: pytest.CaptureFixture[str],
                                      argv: list[str]) -> None:
    code, out, err = margo(capsys, *argv, *cli_fleet.server())
    assert code == 2 and out == "" and err.startswith("margo get: ")


def test_server_refusals_and_absences_are_usage_errors(
        cli_fleet: CliFleet, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = margo(capsys, "get", "devices", "--url", cli_fleet.url)
    assert code == 2 and "401 the operator token is required" in err
    code, _, err = margo(capsys, "describe", "device", "nope", *cli_fleet.server())
    assert code == 2 and "404 no device 'nope'" in err
    code, _, err = margo(capsys, "describe", "intent", "nope", *cli_fleet.server())
    assert code == 2 and "no intent 'nope'" in err
    code, _, err = margo(capsys, "get", "devices", "--url", "http://127.0.0.1:9",
                         "--token-file", str(tmp_path / "missing"))
    assert code == 2 and err.startswith("margo get devices: ")
    with pytest.raises(SystemExit) as exited:
        main(["get", "pods", "--url", cli_fleet.url])
    assert exited.value.code == 2


def test_selector_syntax() -> None:
    parsed = parse_selector("a=1, b!=x,c in (p,q),!d,e")
    assert matches(parsed, {"a": 1, "b": "y", "c": "q", "e": True})
    assert not matches(parsed, {"a": "1", "b": "x", "c": "q", "e": ""})
    assert matches(parse_selector(""), None)
    for bad in ("a=b=c", "in (x)", "a in (", ",", "a notin x"):
        with pytest.raises(SelectorError):
            parse_selector(bad)


def test_cells_are_one_printable_line() -> None:
    assert cell("one\ntwo") == "one" + ELLIPSIS
    assert cell("\x1b[1mbold\x1b[0m\ttab\x07") == "bold tab"
    assert cell("x" * 100, 10) == "x" * 9 + ELLIPSIS
    assert cell(None) == cell("  \n ") == "-"
    assert cell("\x1b]0;title\x07shown\u202e") == "shown"


def _read_lines(process: subprocess.Popen[str], lines: list[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))


@contextlib.contextmanager
def _ctrl_c_reaches_children() -> Iterator[None]:
    """Children started meanwhile take SIGINT as Python's default (KeyboardInterrupt) even
    when this process inherited it ignored, as a background job of a shell without job
    control does (`make test &` in a script): an ignored signal stays ignored across
    `exec`, and Python then never installs its handler; a handled one starts as default."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_watch_prints_a_change_and_stops_cleanly_on_ctrl_c(cli_fleet: CliFleet) -> None:
    with _ctrl_c_reaches_children():
        process = subprocess.Popen(
            [sys.executable, "-m", "margo_cli.main", "get", "devices", "--watch", "--interval",
             "0.2", "-l", "watched", *cli_fleet.server()],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=_read_lines, args=(process, lines), daemon=True)
    reader.start()
    try:
        poll_until("the header", lambda: lines, timeout=20)
        assert lines == ["ID  CLIENT  GENERATION  KIND  DEPLOYMENTS  STATES  FRESHNESS  AGE  "
                         "ERROR"]
        doc = device("watch-1", labels={"watched": "yes"})
        assert cli_fleet.devices.put("/api/v1/capabilities/watch-1", json=doc
                                     ).status_code == 201
        poll_until("the new device's row", lambda: len(lines) > 1, timeout=20)
        assert lines[1].split()[:4] == ["watch-1", "edge", "rc.3", "device"]
    finally:
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:  # never left running after the test
            process.kill()
            process.communicate()
            raise
    assert process.returncode == 0, err
    assert "Traceback" not in err and len(lines) == 2


def test_describe_device_in_full(cli_fleet: CliFleet,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = margo(capsys, "describe", "device", "edge-a", *cli_fleet.server())
    assert code == 0
    assert "labels:             site=plant-a, tier=edge" in out
    assert "cpus:             4 cores in 1 CPU(s) (amd64)" in out
    assert "deployment types: compose" in out
    # the whole error, every line, cleaned
    assert ("    error [E_PULL]:\n      image pull failed: manifest unknown\n"
            "        pulling web 3/5\n       compose: exit status 1\n") in out
    assert "\x1b" not in out
    assert ("  gpu: not eligible (application com-example-app 1.0.0)\n    - profile "
            "com-example-app-helm: the device does not support helm deployments") in out
    assert "  web: eligible" in out and "  broken: frozen\n    - deployments/broken" in out
    assert "rollouts:\n  web: progressing, wave " in out and "reported on previous bytes" in out
    assert "history:\n  " in out
    code, out, _ = margo(capsys, "describe", "device", "gpu-1", "-o", "json",
                         *cli_fleet.server())
    detail = json.loads(out)
    assert detail["deviceId"] == "gpu-1" and isinstance(detail["rollouts"], list)


def test_describe_intent(cli_fleet: CliFleet, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = margo(capsys, "describe", "intent", "gpu", *cli_fleet.server())
    assert code == 0
    assert "targets:            label: site In (plant-a)" in out
    assert "    gpu-1: eligible" in out and "intent gpu: 1 eligible" in out
    code, out, _ = margo(capsys, "describe", "intent", "web", *cli_fleet.server())
    assert "rollout:\n  web: progressing" in out and "labels:             team=shop" in out
    code, out, _ = margo(capsys, "describe", "intent", "broken", *cli_fleet.server())
    assert code == 0 and "problems:\n  deployments/broken.yaml:" in out


def test_status_still_shows_the_fleet_with_one_line_errors(
        cli_fleet: CliFleet, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = margo(capsys, "status", *cli_fleet.server())
    assert code == 0 and "edge-a: web: image pull failed: manifest unknown" + ELLIPSIS in out
    code, out, _ = margo(capsys, "status", "--device", "gpu-1", *cli_fleet.server())
    assert code == 0 and "gpu: eligible" in out


def _device_item(state: str, reported: float) -> dict[str, object]:
    return {"deviceId": "d1", "clientId": "c", "shape": "rc.3", "deployments": 1,
            "states": {state: 1}, "freshness": {"state": "current"}, "reportedAt": reported,
            "labels": {}, "errors": []}


def test_a_watch_prints_events_and_ignores_rows_that_only_aged(
        capsys: pytest.CaptureFixture[str]) -> None:
    devices = next(k for k in KINDS if k.name == "devices")
    for output in ("json", "table"):
        printer = Printer(devices, output, watching=True)
        printer.first({})
        printer.changes({"d1": _device_item("pending", 1.0)})
        printer.changes({"d1": _device_item("pending", 2.0)})  # only AGE moved
        printer.changes({"d1": _device_item("installed", 2.0)})
        printer.changes({})
        lines = capsys.readouterr().out.splitlines()
        if output == "json":
            events = [json.loads(line) for line in lines]
            assert [e["event"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
            assert events[1]["object"]["states"] == {"installed": 1}
        else:
            assert [line.split()[0] for line in lines] == ["ID", "d1", "d1", "d1"]
            assert "installed=1" in lines[2] and lines[3].split()[1] == "<deleted>"
