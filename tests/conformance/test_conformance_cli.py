"""`margo conformance wfm`: its output (one line per step, then the summary, or one JSON
document) and exit codes (0 all passed, 1 a step failed or was skipped, 2 unusable input),
against a scripted WFM on loopback. The kit's real suites through the same command are in
test_wfm_kit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.conformancekit import RecordingServer

from margo_cli.main import main as margo_main


@pytest.fixture
def wfm() -> Iterator[RecordingServer]:
    with RecordingServer() as server:
        server.json("GET /api/v1/deployments", 200, {"manifestVersion": 1})
        yield server


def suite_file(tmp_path: Path, *steps: dict[str, Any]) -> Path:
    path = tmp_path / "suite.json"
    path.write_text(json.dumps([{"id": "scn", "steps": list(steps)}]))
    return path


GOOD = {"id": "good", "method": "GET", "endpoint": "/api/v1/deployments", "mtls": True,
        "expected_status": 200,
        "validations": [{"field": "manifestVersion", "operation": "equals", "value": 1}]}
BAD = {**GOOD, "id": "bad", "expected_status": 201}
ORAS = {"id": "registry", "oras": {"cmd": "manifest"}, "expected_status": 200}


def conformance(capsys: pytest.CaptureFixture[str], base: str, suite: Path, certs: Path,
                *extra: str) -> tuple[int, str, str]:
    code = margo_main(["conformance", "wfm", "--base-url", base, "--suite", str(suite),
                       "--cert-dir", str(certs), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_all_passing_exits_0(wfm: RecordingServer, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = conformance(capsys, wfm.base, suite_file(tmp_path, GOOD), tmp_path)
    assert code == 0
    assert out.splitlines() == ["PASS scn/good: HTTP 200",
                                "suite.json: 1 steps run, 1 passed, 0 failed, 0 skipped"]


def test_a_failure_or_a_skip_exits_1(wfm: RecordingServer, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REGISTRY_REF", raising=False)
    code, out, _ = conformance(capsys, wfm.base, suite_file(tmp_path, GOOD, BAD), tmp_path)
    assert code == 1
    assert out.splitlines()[1] == "FAIL scn/bad: expected HTTP 201, got HTTP 200 " \
                                  '({"manifestVersion": 1})'
    code, out, _ = conformance(capsys, wfm.base, suite_file(tmp_path, GOOD, ORAS), tmp_path)
    assert code == 1
    assert out.splitlines()[1].startswith("SKIP scn/registry: oras step without a registry")
    assert out.splitlines()[2].endswith("2 steps run, 1 passed, 0 failed, 1 skipped")


def test_json_output(wfm: RecordingServer, tmp_path: Path,
                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = conformance(capsys, wfm.base, suite_file(tmp_path, GOOD, BAD), tmp_path,
                               "--json")
    report = json.loads(out)
    assert code == 1
    assert report["baseUrl"] == wfm.base and report["passed"] is False
    assert report["summary"] == {"steps": 2, "passed": 1, "failed": 1, "skipped": 0}
    assert report["scenarios"] == {"scn": {"steps": 2, "passed": 1}}
    assert report["results"][1] | {"reason": ""} == {
        "scenario": "scn", "step": "bad", "name": "", "verdict": "FAIL", "reason": "",
        "method": "GET", "endpoint": "/api/v1/deployments", "expected": 201, "actual": 200,
        "crIds": []}


def test_groups_narrow_the_suite(wfm: RecordingServer, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    group = tmp_path / "groups" / "only-good" / "group.json"
    group.parent.mkdir(parents=True)
    group.write_text(json.dumps({"name": "only-good", "testCases": ["good"]}))
    code, out, _ = conformance(capsys, wfm.base, suite_file(tmp_path, GOOD, BAD), tmp_path,
                               "--group", "only-good")
    assert code == 0 and out.splitlines()[-1].startswith("only-good: 1 steps run, 1 passed")


@pytest.mark.parametrize(("change", "message"), [
    ({"suite": "missing.json"}, "cannot read the suite"),
    ({"cert_dir": "missing"}, "is not a directory"),
    ({"base": "wfm.example:8443"}, "--base-url must be an http(s) URL"),
    ({"group": "nope"}, "no group 'nope'"),
])
def test_unusable_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                change: dict[str, str], message: str) -> None:
    suite = tmp_path / change.get("suite", "suite.json")
    if "suite" not in change:
        suite_file(tmp_path, GOOD)
    extra = ["--group", change["group"]] if "group" in change else []
    code, out, err = conformance(capsys, change.get("base", "http://127.0.0.1:9"), suite,
                                 tmp_path / change.get("cert_dir", ""), *extra)
    assert code == 2 and out == ""
    assert err.startswith("margo conformance: ") and message in err
