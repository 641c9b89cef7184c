"""The device configuration's cluster provider and `margo device capabilities`.

(The cluster end to end, with the Helm driver, is test_cluster_real_e2e.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kits.kubekit import GPU_WORKER, THREE_NODES, KubeCluster

from margo.cluster import is_cluster_manifest, validate_cluster_manifest
from reconciler.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("other", [{"file": "caps.json"}, {"host": {}}])
def test_only_one_capability_provider_may_be_configured(tmp_path: Path,
                                                        other: dict[str, Any]) -> None:
    from margo.errors import DocumentError

    config = tmp_path / "device.yaml"
    (tmp_path / "token").write_text("t")

    def write(capabilities: dict[str, Any]) -> None:
        config.write_text(yaml.safe_dump({
            "device": {"id": "d"}, "server": {"url": "http://127.0.0.1:1", "clientId": "c",
                                              "tokenFile": "token"},
            "source": {"type": "margo-rest"}, "driver": {"type": "helm", "kubeconfig": "kc"},
            "dataDir": "data", "capabilities": capabilities}))

    write({"kubernetes": {}, **other})
    with pytest.raises(DocumentError, match="one of 'file', 'host' or 'kubernetes'"):
        load_config(config)
    write({"kubernetes": {}})  # the cluster provider defaults to the Helm driver's kubeconfig
    parsed = load_config(config)
    assert parsed.kubernetes is not None and parsed.kubernetes["kubeconfig"] == tmp_path / "kc"


def test_margo_device_capabilities_prints_both_documents(tmp_path: Path,
                                                         kube: KubeCluster) -> None:
    """The discovery of the real control plane, printed as the rc.3 document and as the
    proposal's manifest."""
    kube.set_nodes([*THREE_NODES, GPU_WORKER])
    (tmp_path / "token").write_text("t")
    config = tmp_path / "device.yaml"
    config.write_text(yaml.safe_dump({
        "device": {"id": "edge-cluster"},
        "server": {"url": "http://127.0.0.1:1", "clientId": "c", "tokenFile": "token"},
        "source": {"type": "margo-rest"}, "driver": {"type": "render"}, "dataDir": "data",
        "capabilities": {"kubernetes": {"kubeconfig": str(kube.device_kubeconfig())}}}))
    outputs = {}
    for form in ("margo", "cluster"):
        done = subprocess.run(
            [sys.executable, "-m", "margo_cli.main", "device", "capabilities", "--config",
             str(config), "--format", form], cwd=ROOT, capture_output=True, text=True,
            timeout=60)
        assert done.returncode == 0, done.stderr
        outputs[form] = json.loads(done.stdout)
    assert outputs["margo"]["properties"]["id"] == "edge-cluster"
    assert outputs["margo"]["labels"]["k8s.margo-gitops.dev/gpus"] == 1
    manifest = outputs["cluster"]
    assert is_cluster_manifest(manifest) and validate_cluster_manifest(manifest) == []
    assert manifest["metadata"]["id"] == "edge-cluster"
    assert manifest["resources"]["nodeCount"] == 4
