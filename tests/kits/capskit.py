"""Capability documents for the server's intake tests: the example fleet's device
documents (examples/capabilities) and a minimal cluster-proposal manifest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["cluster_manifest", "example_capabilities"]

CAPS = Path(__file__).resolve().parents[2] / "examples" / "capabilities"


def example_capabilities(name: str, device_id: str | None = None) -> dict[str, Any]:
    """examples/capabilities/<name>.json, reported as `device_id` when one is given."""
    doc: dict[str, Any] = json.loads((CAPS / f"{name}.json").read_text())
    if device_id is not None:
        doc["properties"]["id"] = device_id
    return doc


def cluster_manifest(cluster_id: str) -> dict[str, Any]:
    """A ClusterCapabilitiesManifest (the cluster proposal's capabilities body) of one
    schedulable worker node."""
    return {
        "apiVersion": "cluster.margo.org/v1alpha1", "kind": "ClusterCapabilitiesManifest",
        "metadata": {"id": cluster_id, "name": "a cluster", "kubernetesVersion": "1.31.2",
                     "platform": "rke2"},
        "apiSurface": {"apiGroups": [{"name": "", "versions": ["v1"]}]},
        "resources": {"allocatable": {"cpu": "8", "memory": "16Gi"}, "nodeCount": 1,
                      "nodes": [{"name": "n1", "roles": ["worker"], "controlPlane": False,
                                 "ready": True, "schedulable": True, "architecture": "amd64",
                                 "allocatable": {"cpu": 4, "memory": "8Gi"},
                                 "available": {"cpu": 4, "memory": "8Gi"}, "gpus": []}]},
        "capabilities": {"supportedDeploymentTypes": ["helm"], "otelCollector": True},
    }
