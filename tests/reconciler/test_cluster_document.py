"""margo.cluster: the proposal's ClusterCapabilitiesManifest, its schema, and the rc.3
document that carries it (both directions), on the proposal's own complete example
(tests/fixtures/kubernetes/proposal-complete-example.json, copied from section 3 of
the Kubernetes cluster capabilities proposal) and on documents built by hand."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from margo.cluster import (
    CLUSTER_API_VERSION,
    EXTENSION_KEY,
    LABEL_PREFIX,
    cluster_body,
    cluster_labels,
    cluster_manifest_from_capabilities,
    cluster_manifest_schema,
    cores,
    device_capabilities_from_cluster,
    exact_binary,
    is_cluster_manifest,
    rounded_binary,
    validate_cluster_manifest,
)
from margo.errors import DocumentError
from margo.kinds import Kind
from margo.validation import validate_value

EXAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "kubernetes" / (
    "proposal-complete-example.json")


@pytest.fixture
def example() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(EXAMPLE.read_text(encoding="utf-8"))
    return loaded


def messages(doc: Any) -> list[str]:
    return [f"{p.json_path}: {p.message}" for p in validate_cluster_manifest(doc)]


def test_the_proposals_example_is_a_valid_manifest(example: dict[str, Any]) -> None:
    Draft202012Validator.check_schema(cluster_manifest_schema())
    assert messages(example) == []
    assert is_cluster_manifest(example)
    fields_only = {k: v for k, v in example.items() if k not in ("apiVersion", "kind")}
    assert is_cluster_manifest(fields_only)  # told apart by apiSurface + kubernetesVersion
    assert not is_cluster_manifest({"properties": {"id": "d", "vendor": "v"}})
    assert not is_cluster_manifest([example])


def test_example_becomes_a_valid_rc3_document(example: dict[str, Any]) -> None:
    doc = device_capabilities_from_cluster(example, vendor="Acme", serial_number="S-1")
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
    assert doc["properties"] == {
        "id": "plant-a-edge-cluster-01", "vendor": "Acme", "modelNumber": "unknown",
        "serialNumber": "S-1",
        "cpus": [{"cores": 16, "architecture": "amd64"}] * 3,
        "memory": "192Gi", "storage": "1500Gi",
        "peripherals": [{"type": "gpu", "manufacturer": "NVIDIA"}] * 4,
        "interfaces": [], "supportedDeploymentTypes": ["helm"], "supportedRuntimes": ["oci"],
        "otelCollector": True}
    assert doc["labels"] == {
        "example.com/environment": "production", "example.com/region": "us-east-plant-a",
        LABEL_PREFIX + "architectures": ["amd64"],
        LABEL_PREFIX + "default-storage-class": "local-path",
        LABEL_PREFIX + "gpu-vendors": ["nvidia"], LABEL_PREFIX + "gpus": 4,
        LABEL_PREFIX + "minor": 31, LABEL_PREFIX + "nodes": 3,
        LABEL_PREFIX + "platform": "k3s", LABEL_PREFIX + "version": "1.31.2"}
    assert cluster_body(doc) == {k: v for k, v in example.items()
                                 if k not in ("apiVersion", "kind")}


def test_round_trip_gives_back_the_manifest(example: dict[str, Any]) -> None:
    doc = device_capabilities_from_cluster(example)
    assert cluster_manifest_from_capabilities(doc) == example
    bare = {k: v for k, v in example.items() if k not in ("apiVersion", "kind")}
    assert device_capabilities_from_cluster(bare) == doc  # the body alone converts alike
    again = cluster_manifest_from_capabilities(doc)
    again["metadata"]["id"] = "changed"
    assert cluster_body(doc)["metadata"]["id"] == "plant-a-edge-cluster-01"  # a copy


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: d.update(apiVersion="cluster.margo.org/v1"),
     "$.apiVersion: expected 'cluster.margo.org/v1alpha1', found 'cluster.margo.org/v1'"),
    (lambda d: d["metadata"].pop("kubernetesVersion"), "kubernetesVersion"),
    (lambda d: d["metadata"].update(id="has space"), "$.metadata.id"),
    (lambda d: d["capabilities"]["storageClasses"][0].pop("isDefault"), "isDefault"),
    (lambda d: d["capabilities"].update(supportedDeploymentTypes=["compose"]),
     "$.capabilities.supportedDeploymentTypes: must include 'helm'"),
    (lambda d: d["resources"]["allocatable"].update(memory="lots"),
     "$.resources.allocatable.memory: not a Kubernetes quantity"),
    (lambda d: d["resources"]["nodeSummary"][0].update(allocatableCpu="-1"),
     "$.resources.nodeSummary[0].allocatableCpu: not a Kubernetes quantity"),
    (lambda d: d["apiSurface"]["apiGroups"][0].update(versions=[]), "$.apiSurface.apiGroups"),
    (lambda d: d.update(spec={}), "spec"),
    (lambda d: d["capabilities"].pop("otelCollector"),
     "$.capabilities.otelCollector: capabilities.otelCollector is required"),
    (lambda d: d.pop("resources"), "$.resources: resources is required"),
])
def test_invalid_manifests_are_explained(example: dict[str, Any], change: Any,
                                         expected: str) -> None:
    change(example)
    found = messages(example)
    assert any(expected in m for m in found), found
    with pytest.raises(DocumentError):
        device_capabilities_from_cluster(example)


def test_absent_required_fields_are_fine_when_declared_unknown(example: dict[str, Any]) -> None:
    del example["resources"]
    del example["capabilities"]["otelCollector"]
    example["unknown"] = [
        {"what": "resources", "reason": "forbidden by RBAC: nodes is forbidden"},
        {"what": "capabilities.otelCollector", "reason": "nodes could not be read"}]
    assert messages(example) == []
    doc = device_capabilities_from_cluster(example)
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
    assert not {"cpus", "memory", "storage", "peripherals", "otelCollector"} & set(
        doc["properties"])
    assert not {"nodes", "gpus", "architectures"} & {
        k.removeprefix(LABEL_PREFIX) for k in doc["labels"]}
    example["x-acme-extensions"] = {"anything": [1, 2]}  # vendor extensions are kept
    assert cluster_manifest_from_capabilities(
        device_capabilities_from_cluster(example))["x-acme-extensions"] == {"anything": [1, 2]}


def test_a_plain_device_document_has_no_cluster() -> None:
    plain = {"properties": {"id": "d1", "vendor": "v", "modelNumber": "m",
                            "serialNumber": "s"}}
    assert cluster_body(plain) is None
    with pytest.raises(ValueError, match="not a cluster's capabilities"):
        cluster_manifest_from_capabilities(plain)


def cluster_with(nodes: list[dict[str, Any]], **capabilities: Any) -> dict[str, Any]:
    """A manifest with our per-node list (what discovery reports)."""
    return {"apiVersion": CLUSTER_API_VERSION, "kind": "ClusterCapabilitiesManifest",
            "metadata": {"id": "c", "kubernetesVersion": "1.30.4+k3s1"},
            "apiSurface": {"apiGroups": [{"name": "", "versions": ["v1"]}]},
            "resources": {"allocatable": {"cpu": "12", "memory": "48Gi"},
                          "nodeCount": len(nodes), "nodes": nodes},
            "capabilities": {"supportedDeploymentTypes": ["helm"], "otelCollector": False,
                             **capabilities}}


def a_node(name: str, *, cpu: float = 4, ready: bool = True, schedulable: bool = True,
           architecture: str = "amd64", gpus: int = 0, **extra: Any) -> dict[str, Any]:
    node = {"name": name, "ready": ready, "schedulable": schedulable,
            "controlPlane": False, "architecture": architecture,
            "allocatable": {"cpu": 4, "memory": "16Gi", "ephemeralStorage": "100Gi"},
            "available": {"cpu": cpu, "memory": "8Gi", "ephemeralStorage": "50Gi"},
            "gpus": [{"resource": "amd.com/gpu", "count": gpus, "manufacturer": "AMD"}]
            if gpus else [], **extra}
    return node


def test_cpus_list_only_nodes_that_can_take_a_pod() -> None:
    manifest = cluster_with([
        a_node("a", cpu=1.5, gpus=2, zone="z1", region="r"),
        a_node("b", cpu=0, zone="z2", region="r"),               # full
        a_node("c", ready=False, gpus=1),                         # NotReady
        a_node("d", schedulable=False, controlPlane=True),        # tainted or cordoned
        a_node("e", architecture="riscv64")])                     # no rc.3 word for it
    doc = device_capabilities_from_cluster(manifest)
    validate_value(doc, expect=Kind.DEVICE_CAPABILITIES)
    properties = doc["properties"]
    assert properties["cpus"] == [{"cores": 1.5, "architecture": "amd64"}, {"cores": 4}]
    assert (properties["memory"], properties["storage"]) == ("24Gi", "150Gi")  # a, b, e
    assert properties["peripherals"] == [{"type": "gpu", "manufacturer": "AMD"}] * 2
    assert properties["otelCollector"] is False
    labels = cluster_labels(manifest)
    assert {k.removeprefix(LABEL_PREFIX): v for k, v in labels.items()} == {
        "architectures": ["amd64"], "control-plane-nodes": 1, "gpu-vendors": ["amd"],
        "gpus": 2, "minor": 30, "nodes": 5, "regions": ["r"], "schedulable-nodes": 3,
        "version": "1.30.4", "zones": ["z1", "z2"]}


def test_two_default_storage_classes_name_no_default() -> None:
    classes = [{"name": n, "provisioner": "p", "isDefault": True} for n in ("x", "y")]
    labels = cluster_labels(cluster_with([a_node("a")], storageClasses=classes))
    assert LABEL_PREFIX + "default-storage-class" not in labels


def test_discovered_labels_win_over_operator_labels() -> None:
    manifest = cluster_with([a_node("a")])
    manifest["labels"] = {LABEL_PREFIX + "nodes": 99, LABEL_PREFIX + "platform": "k3s",
                          "team": "edge"}
    labels = device_capabilities_from_cluster(manifest)["labels"]
    assert labels[LABEL_PREFIX + "nodes"] == 1          # discovered
    assert labels[LABEL_PREFIX + "platform"] == "k3s"   # unknown to discovery: kept
    assert labels["team"] == "edge"


def test_quantity_helpers_never_round_up() -> None:
    assert [exact_binary(n) for n in (16 * 1024**3, 1536 * 1024**2, 16379772 * 1024, 1000,
                                      0)] == ["16Gi", "1536Mi", "16379772Ki", "1000", "0"]
    assert rounded_binary(11579780 * 1024) == "11Gi"
    assert rounded_binary(9 * 1024**3 + 1) == "9216Mi"
    from decimal import Decimal
    assert (cores(Decimal("3.8")), cores(Decimal("4")), cores(Decimal("0.0019"))) == (
        3.8, 4, 0.001)


def test_the_schema_is_a_fresh_copy_each_time() -> None:
    schema = cluster_manifest_schema()
    schema["properties"].clear()
    assert cluster_manifest_schema()["properties"]["apiVersion"] == {
        "const": CLUSTER_API_VERSION}
    assert EXTENSION_KEY.startswith("x-") and copy.deepcopy(schema) == schema
