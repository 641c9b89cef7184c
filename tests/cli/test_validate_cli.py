"""`margo validate`: the exact output and exit codes other tools rely on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tests" / "fixtures" / "spec-examples"


def margo(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "margo_cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, input=stdin, check=False, timeout=60)


def test_all_valid_exits_zero() -> None:
    result = margo("validate", *map(str, sorted((EXAMPLES / "valid").iterdir())))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "valid ApplicationDescription (rc.3 shape)" in result.stdout


def test_any_invalid_exits_one_with_one_located_line_per_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: margo.org/v1-alpha1\nkind: ApplicationDescription\n"
                   "id: Bad_Id\nmetadata:\n  name: x\n")
    result = margo("validate", str(EXAMPLES / "valid" / "gateway-directed.yaml"), str(bad))
    assert result.returncode == 1
    lines = [line for line in result.stdout.splitlines() if line.startswith(str(bad))]
    assert any(f"{bad}:3:5: $.id: expected an id of lower-case letters" in line
               for line in lines)
    assert any(f"{bad}:4:1: $.metadata: missing required field 'version'" in line
               for line in lines)
    assert any("missing required field 'deploymentProfiles'" in line for line in lines)


def test_unreadable_input_exits_two(tmp_path: Path) -> None:
    result = margo("validate", str(tmp_path / "missing.yaml"),
                   str(EXAMPLES / "valid" / "gateway-directed.yaml"))
    assert result.returncode == 2
    assert "missing.yaml: cannot read" in result.stderr
    directory = margo("validate", str(tmp_path))
    assert directory.returncode == 2


def test_json_output(tmp_path: Path) -> None:
    bad = tmp_path / "caps.json"
    text = json.dumps({"properties": {"id": "d", "vendor": "v", "modelNumber": "m",
                                      "serialNumber": "s", "memory": 5}})
    bad.write_text(text)
    result = margo("validate", "--json", str(EXAMPLES / "invalid" / "DesiredState-004.yaml"),
                   str(bad), str(EXAMPLES / "valid" / "ProblemDetail-001.yaml"))
    assert result.returncode == 1
    reports = json.loads(result.stdout)
    assert [r["valid"] for r in reports] == [False, False, True]
    assert reports[0]["kind"] == "ApplicationDeployment"
    assert reports[0]["errors"][0]["path"] == "$.id"
    assert reports[1]["errors"][0] == {
        "file": str(bad), "line": 1, "column": text.index("5}") + 1, "path": "$.properties.memory",
        "message": "expected a string, found an integer (5)", "expected": "a string",
        "found": "5"}
    assert set(reports[2]) == {"path", "kind", "shape", "valid", "errors"}


def test_hostile_input_is_a_clean_error(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    bomb.write_text("\n".join(lines))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)))
    result = margo("validate", str(bomb), str(binary))
    assert result.returncode == 1
    assert "alias bomb" in result.stdout and "not valid UTF-8" in result.stdout
    assert "Traceback" not in result.stderr


FLEET = ROOT / "examples" / "fleet"


def test_an_intent_is_validated_as_the_compiler_loads_it(tmp_path: Path) -> None:
    """`margo validate deployments/X.yaml` checks a DeploymentIntent (not as an
    ApplicationDeployment): its schema, expressions and the shape of its secrets."""
    valid = margo("validate", str(FLEET / "deployments" / "ha-web.yaml"))
    assert valid.returncode == 0, valid.stdout + valid.stderr
    assert valid.stdout == f"{FLEET / 'deployments' / 'ha-web.yaml'}: valid DeploymentIntent\n"
    bad = tmp_path / "web.yaml"
    bad.write_text((FLEET / "deployments" / "ha-web.yaml").read_text()
                   .replace("message: \"Hello from {{ device.id }}\"",
                            "message: {secret: not an age file}\n    other: \"{{ nope( }}\""))
    result = margo("validate", str(bad))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith(f"{bad}:20:") and "$.spec.parameters.message.secret:" in lines[0]
    assert lines[1].startswith(f"{bad}:21:") and "$.spec.parameters.other: invalid " \
        "expression" in lines[1]
    assert "ApplicationDeployment" not in result.stdout


def test_a_fleet_source_directory_is_validated_as_the_compiler_reads_it(
        tmp_path: Path) -> None:
    """`margo validate DIR` on a fleet source: every application and intent file, with the
    problems the compiler and the push check find, including literal parameter values that
    break the application's configuration rules (expressions and secrets are per device)."""
    fleet = tmp_path / "fleet"
    shutil.copytree(FLEET, fleet)
    result = margo("validate", str(fleet))
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(result.stdout.splitlines()) == 8
    assert f"{fleet}/deployments/ha-web.yaml: valid DeploymentIntent" in result.stdout
    intent = fleet / "deployments" / "ha-web.yaml"
    text = intent.read_text()
    replicas = text[text.index("    replicas: >-"):text.index("    message:")]
    intent.write_text(text.replace(replicas, "    replicas: 99\n"))
    (fleet / "deployments" / "typo.yaml").write_text(
        (FLEET / "deployments" / "hello-everywhere.yaml").read_text())
    result = margo("validate", str(fleet))
    assert result.returncode == 1
    problems = [line for line in result.stdout.splitlines() if ": valid " not in line]
    assert problems == [
        f"{intent}:17:15: $.spec.parameters.replicas: expected an integer between 1 and 10, "
        "found 99",
        f"{fleet}/deployments/typo.yaml:6:9: $.metadata.name: the intent in typo.yaml must "
        "be named 'typo'"], result.stdout
    # The one file, inside its source: the same check, the same line.
    one = margo("validate", str(intent))
    assert one.returncode == 1 and one.stdout.splitlines() == problems[:1]
    as_json = json.loads(margo("validate", "--json", str(fleet)).stdout)
    assert {(r["path"], r["kind"], r["valid"]) for r in as_json if not r["valid"]} == {
        (str(intent), "DeploymentIntent", False),
        (f"{fleet}/deployments/typo.yaml", "DeploymentIntent", False)}


def test_any_directory_of_documents_is_validated_file_by_file(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(EXAMPLES / "valid", docs / "valid")
    (docs / ".git").mkdir()
    (docs / ".git" / "config.yaml").write_text("not: a margo document\n")
    (docs / "README.md").write_text("ignored")
    result = margo("validate", str(docs))
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(result.stdout.splitlines()) == len(list((EXAMPLES / "valid").iterdir()))
    (docs / "nested").mkdir()
    (docs / "nested" / "bad.yaml").write_text("kind: ApplicationDescription\n")
    result = margo("validate", str(docs))
    assert result.returncode == 1
    assert f"{docs}/nested/bad.yaml:1:1: $:" in result.stdout
    empty = margo("validate", str(tmp_path / "nothing"), str(docs))
    assert empty.returncode == 2
