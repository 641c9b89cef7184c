"""`margo match`: single and batch forms, exit codes and JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "examples" / "fleet" / "apps"
CAPS = ROOT / "examples" / "capabilities"


def margo(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "margo_cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, input=stdin, check=False, timeout=120)


def test_eligible_device_exits_zero() -> None:
    result = margo("match", "--capabilities", str(CAPS / "k8s-cluster-gpu.json"),
                   "--constraints", str(APPS / "com-example-gpu-inference" / "margo.yaml"))
    assert (result.returncode, result.stdout) == (0, "eligible\n")


def test_ineligible_device_lists_every_failing_clause_as_json() -> None:
    result = margo("match", "--json", "--capabilities", str(CAPS / "compose-box-arm64.json"),
                   "--constraints", str(APPS / "com-example-gpu-inference" / "margo.yaml"))
    assert result.returncode == 1
    answer = json.loads(result.stdout)
    assert answer["eligible"] is False
    keys = {(f["stage"], f["key"]) for f in answer["failures"]}
    assert {("capacity", "cpu.architectures"), ("capacity", "memory"),
            ("capacity", "storage"), ("eligibility", "/peripherals"),
            ("eligibility", "/supportedDeploymentTypes")} <= keys
    memory = next(f for f in answer["failures"] if f["key"] == "memory")
    assert (memory["operator"], memory["required"], memory["actual"]) == (">=", "8Gi", "3.5Gi")
    assert {"stage", "key", "operator", "required", "actual"} <= set(memory)


def test_profile_selection_and_bare_constraints(tmp_path: Path) -> None:
    compose = margo("match", "--capabilities", str(CAPS / "compose-box-amd64.json"),
                    "--constraints", str(APPS / "com-example-hello-world" / "margo.yaml"),
                    "--profile", "hello-world-compose")
    assert compose.returncode == 0
    missing = margo("match", "--capabilities", str(CAPS / "compose-box-amd64.json"),
                    "--constraints", str(APPS / "com-example-hello-world" / "margo.yaml"),
                    "--profile", "nope")
    assert missing.returncode == 2 and "no deployment profile 'nope'" in missing.stderr
    bare = tmp_path / "constraints.yaml"
    bare.write_text("eligibilityRules:\n  - labelSelector:\n      matchExpressions:\n"
                    "      - {key: example.com/site, operator: In, values: [plant-b]}\n")
    assert margo("match", "--capabilities", str(CAPS / "compose-box-amd64.json"),
                 "--constraints", str(bare)).returncode == 0
    assert margo("match", "--capabilities", str(CAPS / "k8s-cluster-gpu.json"),
                 "--constraints", str(bare)).returncode == 1


def test_bad_input_exits_two(tmp_path: Path) -> None:
    malformed = tmp_path / "constraints.yaml"
    malformed.write_text("eligibilityRules:\n  - propertySelector:\n      matchExpressions:\n"
                         "      - {key: /cpus, operator: Gt, values: [1, 2]}\n")
    result = margo("match", "--capabilities", str(CAPS / "compose-box-amd64.json"),
                   "--constraints", str(malformed))
    assert result.returncode == 2
    assert f"{malformed}:4:" in result.stderr
    bad_caps = tmp_path / "caps.json"
    bad_caps.write_text('{"properties": {"id": "x"}}')
    result = margo("match", "--capabilities", str(bad_caps), "--constraints", str(malformed))
    assert result.returncode == 2 and "missing required field 'vendor'" in result.stderr
    assert margo("match", "--capabilities", str(bad_caps)).returncode == 2


def test_batch_answers_every_line_in_order() -> None:
    caps = json.loads((CAPS / "k8s-cluster-gpu.json").read_text())
    small = json.loads((CAPS / "compose-box-arm64.json").read_text())
    gpu = {"eligibilityRules": [{"propertySelector": {"matchExpressions": [
        {"key": "/peripherals", "operator": "ContainsAll", "itemSelector": {
            "matchExpressions": [{"key": "/type", "operator": "In", "values": ["gpu"]}]}}]}}]}
    lines = [
        json.dumps({"capabilities": caps, "deviceConstraints": gpu}),
        json.dumps({"capabilities": small, "deviceConstraints": gpu}),
        "not json",
        json.dumps({"capabilities": {"properties": {}}, "deviceConstraints": gpu}),
        json.dumps({"capabilities": caps, "deviceConstraints": {"eligibilityRules": [{}]}}),
        "",
        json.dumps({"capabilities": caps}),
    ]
    result = margo("match", "--batch", "-", stdin="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    out = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(out) == 6
    assert out[0] == {"eligible": True, "failures": []}
    assert out[1]["eligible"] is False and out[1]["failures"][0]["key"] == "/peripherals"
    assert "invalid JSON" in out[2]["error"]
    assert "missing required field 'id'" in out[3]["error"]
    assert "eligibilityRules[0]" in out[4]["error"]
    assert out[5] == {"eligible": True, "failures": []}


def test_batch_of_thousands_of_lines(tmp_path: Path) -> None:
    caps = json.loads((CAPS / "k8s-single-amd64.json").read_text())
    constraints = {"capacityRequirements": {"cpu": {"cores": 4}, "memory": "16Gi"}}
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"capabilities": caps, "deviceConstraints": constraints})
                             + "\n" for _ in range(5000)))
    start = time.monotonic()
    result = margo("match", "--batch", str(batch))
    elapsed = time.monotonic() - start
    assert result.returncode == 0
    assert result.stdout.count('{"eligible": true') == 5000
    print(f"5000 batch lines in {elapsed:.2f}s")
