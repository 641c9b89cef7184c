"""The official conformance kit's rc.3 WFM suite against `margo serve` (HTTP steps).

Each scenario runs as a fresh client, as the kit does. The multi-component scenario needs an
operator to assign a two-component deployment: the fleet source here does that with an
application and an intent targeting `multi-component-test-device`.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kit import run_scenario

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "wfm"))
from serverkit import ROOT, add_client, running_server

from margo.canonical import canonical_yaml

SUITE = ROOT / "tests" / "fixtures" / "conformance" / "wfm-supplier.json"
SCENARIOS = json.loads(SUITE.read_text())

MULTI_COMPONENT_APP = {
    "apiVersion": "margo.org/v1-alpha1", "kind": "ApplicationDescription",
    "id": "cts-multi-component-app",
    "metadata": {"name": "CTS multi-component", "version": "1.0.0",
                 "catalog": {"organization": [{"name": "Margo CTS"}]}},
    "deploymentProfiles": [{"type": "compose", "id": "cts-compose", "components": [
        {"name": "wait-true-component", "properties": {
            "repository": "oci://registry.example.com/cts/wait-true-component",
            "revision": "1.0.0", "wait": True}},
        {"name": "wait-false-component", "properties": {
            "repository": "oci://registry.example.com/cts/wait-false-component",
            "revision": "1.0.0", "wait": False}}]}],
}
MULTI_COMPONENT_INTENT = {
    "apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
    "metadata": {"name": "cts-multi-component"},
    "spec": {"application": {"id": "cts-multi-component-app"},
             "targets": {"devices": ["multi-component-test-device"]}},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("kit")
    source = root / "fleet"
    (source / "apps" / "cts-multi-component-app").mkdir(parents=True)
    (source / "deployments").mkdir()
    (source / "apps" / "cts-multi-component-app" / "margo.yaml").write_bytes(
        canonical_yaml(MULTI_COMPONENT_APP))
    (source / "deployments" / "cts-multi-component.yaml").write_bytes(
        canonical_yaml(MULTI_COMPONENT_INTENT))
    shutil.copytree(ROOT / "examples" / "fleet" / "apps", source / "apps", dirs_exist_ok=True)
    data = root / "data"
    tokens = {s["id"]: add_client(data, s["id"]) for s in SCENARIOS}
    with running_server(data, "--source", str(source)) as base:
        yield {"base": base, "tokens": tokens}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s["id"])
def test_official_scenario(server: dict[str, Any], scenario: dict[str, Any]) -> None:
    token = server["tokens"][scenario["id"]]
    with httpx.Client(base_url=server["base"], timeout=10,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        results = run_scenario(http, scenario)
    failed = [f"{r.step}: {r.detail}" for r in results if r.status == "failed"]
    assert not failed, failed
    for result in results:
        print(f"{scenario['id']} {result.step}: {result.status} {result.detail}")
