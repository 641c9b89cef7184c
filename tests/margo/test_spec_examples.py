"""The official Margo examples: every valid one validates, every invalid one is rejected
with the reason its comment (or file name) gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from margo.kinds import Kind, Shape
from margo.validation import validate_file

SPEC_EXAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "spec-examples"
VALID = sorted((SPEC_EXAMPLES / "valid").iterdir())
INVALID = sorted((SPEC_EXAMPLES / "invalid").iterdir())

EXPECTED_VALID = {
    "ApplicationDeployment-001.yaml": (Kind.APPLICATION_DEPLOYMENT, Shape.OCT_2024),
    "ApplicationDeployment-compose.yaml": (Kind.APPLICATION_DEPLOYMENT, Shape.RC2),
    "ApplicationDeployment-helm.yaml": (Kind.APPLICATION_DEPLOYMENT, Shape.RC2),
    "ApplicationDescription-001.yaml": (Kind.APPLICATION_DESCRIPTION, Shape.RC3),
    "ApplicationDescription-002.yaml": (Kind.APPLICATION_DESCRIPTION, Shape.RC2),
    "ApplicationDescription-helm_only.yaml": (Kind.APPLICATION_DESCRIPTION, Shape.RC2),
    "DeploymentStatusManifest-001.json": (Kind.DEPLOYMENT_STATUS, Shape.RC2),
    "DesiredState-001.yaml": (Kind.APPLICATION_DEPLOYMENT, Shape.RC2),
    "DesiredState-002.yaml": (Kind.APPLICATION_DEPLOYMENT, Shape.RC2),
    "DesiredStateManifest-001.json": (Kind.STATE_MANIFEST, Shape.RC3),
    "DeviceCapabilitiesManifest-001.json": (Kind.DEVICE_CAPABILITIES, Shape.OCT_2024),
    "ProblemDetail-001.yaml": (Kind.PROBLEM_DETAIL, Shape.RC3),
    "gateway-autonomous.yaml": (Kind.APPLICATION_DEPLOYMENT, Shape.RC3),
    "gateway-directed.yaml": (Kind.APPLICATION_DEPLOYMENT, Shape.RC3),
}

# file -> (JSON path of the problem, a fragment of its message)
EXPECTED_INVALID = {
    "ApplicationDeployment-003.yaml": ("$.metadata.annotations.applicationId", "at most 200"),
    "ApplicationDescription-001.yaml": ("$.kind", "found 'ApplicationSpecification'"),
    "ApplicationDescription-002.yaml": ("$.id", "lower-case letters, digits and dashes"),
    "DeploymentStatusManifest-001.json": ("$.kind", "found 'WrongKind'"),
    "DeploymentStatusManifest-002.json": ("$.status.state", "found 'running'"),
    "DeploymentStatusManifest-003.json": ("$", "missing required field 'deploymentId'"),
    "DesiredState-001.yaml": ("$.kind", "found 'SomethingErroneous'"),
    "DesiredState-002.yaml": ("$.metadata.annotations.applicationId", "lower-case letters"),
    "DesiredState-003.yaml": ("$.metadata.annotations.applicationId", "at most 200"),
    "DesiredState-004.yaml": ("$.id", "expected a UUID"),
    "DesiredStateManifest-001.json": ("$.manifestVersion", "less than the minimum of 1"),
    "DesiredStateManifest-002.json": ("$.bundle.mediaType",
                                      "expected 'application/vnd.margo.bundle.v1+tar+gzip'"),
    "DesiredStateManifest-003.json": ("$.bundle.digest", "'invalid-digest'"),
    "DesiredStateManifest-004.json": ("$", "missing required field 'bundle'"),
    "DeviceCapabilitiesManifest-001.json": ("$.properties.roles[0]", "found 'Non existing role'"),
    "DeviceCapabilitiesManifest-002.json": ("$.properties", "missing required field 'vendor'"),
    "DeviceCapabilitiesManifest-003.json": ("$.properties.resources.cpu.architectures[0]",
                                            "found 'riscv'"),
    "ProblemDetail-001.yaml": ("$", "missing required field 'status'"),
}


def test_every_example_file_is_covered() -> None:
    assert {p.name for p in VALID} == set(EXPECTED_VALID)
    assert {p.name for p in INVALID} == set(EXPECTED_INVALID)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_examples_validate(path: Path) -> None:
    report = validate_file(str(path))
    assert report.problems == []
    assert (report.kind, report.shape) == EXPECTED_VALID[path.name]
    assert report.model is not None


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_are_rejected_with_a_reason(path: Path) -> None:
    report = validate_file(str(path))
    assert not report.valid
    json_path, fragment = EXPECTED_INVALID[path.name]
    matching = [p for p in report.problems if p.json_path == json_path and fragment in p.message]
    assert matching, [p.format() for p in report.problems]
    problem = matching[0]
    assert problem.file == str(path) and problem.line and problem.column
