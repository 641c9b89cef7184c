"""The kit's 10 application-registry (`oras`) steps, run by our Python stand-in for `oras`
against a real OCI registry (Debian docker-registry on loopback) holding the kit's
application package (`margo-ctt-package`) pushed in the Margo layout: artifactType
application/vnd.margo.app.v1+json, the empty config, one layer per file with its Margo media
type. Broken packages and broken registries make exactly the steps about them fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from kits.conformancekit import A1_SUITE, ORAS_CHECKS, PACKAGE_DIR, push_margo_package, report_line

from conformance.registry import RegistryClient, RegistryError, RegistryRef
from conformance.runner import CertDir, Runner, RunnerOptions, Suite, load_suite


def oras_suite(path: Path) -> Suite:
    scenarios = [s for s in load_suite(path).scenarios
                 if all(step.get("oras") for step in s["steps"])]
    assert sum(len(s["steps"]) for s in scenarios) == 10
    return Suite(path.name, scenarios)


def run(suite: Suite, ref: str | None, tmp_path: Path, *,
        summary: bool = False) -> dict[str, tuple[str, str]]:
    with Runner("https://wfm.invalid", CertDir.load(tmp_path),
                RunnerOptions(registry_ref=ref)) as runner:
        report = runner.run_suite(suite)
    if summary:
        report_line(report, f"registry steps of {suite.name}")
    return {r.step: (r.verdict, r.reason) for r in report.results}


@pytest.mark.parametrize("path", [A1_SUITE, ORAS_CHECKS], ids=lambda p: p.stem)
def test_every_registry_step_passes(path: Path, package_ref: str, tmp_path: Path) -> None:
    verdicts = run(oras_suite(path), package_ref, tmp_path, summary=True)
    assert {v for v, _ in verdicts.values()} == {"PASS"}, verdicts


def test_the_package_is_in_the_margo_layout(package_ref: str) -> None:
    """What the steps inspected: five layers, the description first, Margo media types."""
    with RegistryClient() as registry:
        ref = RegistryRef.parse(package_ref)
        manifest = json.loads(registry.manifest(ref))
        for layer in manifest["layers"]:
            registry.blob(ref, layer["digest"], layer["size"])
    assert manifest["artifactType"] == "application/vnd.margo.app.v1+json"
    assert manifest["config"] == {"mediaType": "application/vnd.oci.empty.v1+json",
                                  "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21f"
                                            "e77e8310c060f61caaff8a", "size": 2}
    assert [layer["mediaType"] for layer in manifest["layers"]] == [
        "application/vnd.margo.app.description.v1+yaml",
        "application/vnd.margo.app.icon.v1+png",
        "application/vnd.margo.app.descriptionFile.v1+markdown",
        "application/vnd.margo.app.licenseFile.v1+plain",
        "application/vnd.margo.app.releaseNotes.v1+markdown"]
    assert manifest["annotations"]["org.opencontainers.image.title"] == "Hello World"


def test_a_package_not_in_the_margo_layout_fails_the_layout_steps(kit_registry: str,
                                                                  tmp_path: Path) -> None:
    push_margo_package(kit_registry, "broken/layout", "1.0", PACKAGE_DIR,
                       media_types={"margo.yaml": "application/vnd.margo.app.other.v1+yaml",
                                    "resources/license.txt": "application/octet-stream"},
                       config=(b'{"os":"linux"}', "application/vnd.oci.image.config.v1+json"),
                       artifact_type="application/vnd.example.other+json")
    verdicts = run(oras_suite(ORAS_CHECKS), f"{kit_registry}/broken/layout:1.0", tmp_path)
    failed = {step for step, (verdict, _) in verdicts.items() if verdict == "FAIL"}
    assert failed == {"ar-012-artifact-type", "ar-009-empty-config",
                      "ar-002-application-description-present",
                      "ar-004-011-resource-media-types"}
    assert "resources/license.txt: 'application/octet-stream'" in verdicts[
        "ar-004-011-resource-media-types"][1]


def test_a_blob_the_registry_lost_fails_the_blob_steps(kit_registry: str,
                                                       tmp_path: Path) -> None:
    push_margo_package(kit_registry, "broken/blobs", "1.0", PACKAGE_DIR)
    with RegistryClient() as registry:
        manifest = json.loads(registry.manifest(RegistryRef.parse(
            f"{kit_registry}/broken/blobs:1.0")))
    lost = manifest["layers"][1]["digest"]
    gone = httpx.delete(f"http://{kit_registry}/v2/broken/blobs/blobs/{lost}")
    assert gone.status_code == 202
    verdicts = run(oras_suite(ORAS_CHECKS), f"{kit_registry}/broken/blobs:1.0", tmp_path)
    failed = {step for step, (verdict, _) in verdicts.items() if verdict == "FAIL"}
    assert failed == {"ar-005-blobs-pullable", "ar-008-registry-api-surface"}
    assert lost in verdicts["ar-005-blobs-pullable"][1]


def test_a_missing_package_fails_and_no_reference_skips(kit_registry: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REGISTRY_REF", raising=False)
    verdicts = run(oras_suite(ORAS_CHECKS), f"{kit_registry}/no/such-app:1.0", tmp_path)
    assert verdicts["ar-006-manifest-pullable"][0] == "FAIL"
    assert "HTTP 404" in verdicts["ar-006-manifest-pullable"][1]
    assert {v for v, _ in run(oras_suite(ORAS_CHECKS), None, tmp_path).values()} == {"SKIP"}


def test_registry_ref_comes_from_the_environment(package_ref: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The kit's REGISTRY_REF, as the kit's runner reads it."""
    monkeypatch.setenv("REGISTRY_REF", package_ref)
    assert {v for v, _ in run(oras_suite(ORAS_CHECKS), None, tmp_path).values()} == {"PASS"}


@pytest.mark.parametrize(("text", "host", "name", "reference"), [
    ("127.0.0.1:5000/margo-ctt/hello-world:1.0", "127.0.0.1:5000", "margo-ctt/hello-world",
     "1.0"),
    ("harbor.machine:8443/library/app", "harbor.machine:8443", "library/app", None),
    ("oci://r.example/a/b@sha256:" + "a" * 64, "r.example", "a/b", "sha256:" + "a" * 64),
])
def test_registry_references(text: str, host: str, name: str, reference: str | None) -> None:
    ref = RegistryRef.parse(text)
    assert (ref.host, ref.name, ref.reference) == (host, name, reference)
    assert str(ref) == text.removeprefix("oci://")


@pytest.mark.parametrize("text", ["r.example/UPPER:1", "r.example/a:bad tag",
                                  "r.example/a@sha256:xyz", "no-repository"])
def test_malformed_registry_references_are_refused(text: str) -> None:
    with pytest.raises(RegistryError, match="invalid registry reference"):
        RegistryRef.parse(text)
