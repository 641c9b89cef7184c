"""A deployment kept for a grace period is removed when the period runs out, even if the
device reports nothing more: the server schedules the compile itself."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
from kits.serverkit import ROOT, add_client, running_server

from tools.polling import poll_until

INTENT = """\
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata: {name: vision}
spec:
  application: {id: com-example-gpu-inference}
  profile: {type: helm}
  namespace: vision
  gracePeriod: 4s
"""


def deployments(http: httpx.Client) -> list[dict[str, Any]]:
    return list(http.get("/api/v1/deployments").json()["deployments"])


def wait(predicate: Any, timeout: float = 20) -> None:
    poll_until("the condition", predicate, timeout=timeout)


def test_grace_period_expiry_removes_the_deployment_without_new_reports(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    shutil.copytree(ROOT / "examples" / "fleet" / "apps", fleet / "apps")
    (fleet / "deployments").mkdir()
    (fleet / "deployments" / "vision.yaml").write_text(INTENT)
    data = tmp_path / "data"
    token = add_client(data, "site")
    caps = json.loads((ROOT / "examples/capabilities/k8s-cluster-gpu.json").read_text())
    with running_server(data, "--source", str(fleet)) as base, httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=10) as http:
        assert http.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps).status_code == 201
        wait(lambda: len(deployments(http)) == 1)
        caps["properties"]["peripherals"] = []  # the GPU is gone
        assert http.put("/api/v1/capabilities/k8s-cluster-gpu", json=caps).status_code == 200
        time.sleep(0.8)  # the recompile for the report has run; the deployment is kept
        assert len(deployments(http)) == 1
        wait(lambda: deployments(http) == [])  # with no further report from the device
