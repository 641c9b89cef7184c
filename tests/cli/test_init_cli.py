"""`margo init` scaffolds what our own tools accept: a fleet source that validates and
compiles, and a chart that `margo lint-chart` passes and the Helm engine renders with every
name taken from the release, its replicas spread across nodes and its resources requested."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import helm_python as helm
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CAPABILITIES = ROOT / "examples" / "capabilities"


def margo(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "margo_cli.main", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_init_writes_a_fleet_source_that_validates_and_compiles(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    done = margo("init", fleet)
    assert done.returncode == 0, done.stderr
    apps = sorted(fleet.glob("apps/*/margo.yaml"))
    assert apps and sorted(fleet.glob("deployments/*.yaml"))
    validated = margo("validate", *apps)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    plan = margo("plan", "--source", fleet, "--capabilities", CAPABILITIES,
                 "--repos", tmp_path / "repos", "--json")
    assert plan.returncode == 0, plan.stderr
    devices = {d["device"]: [c["file"] for c in d["changes"]]
               for d in json.loads(plan.stdout)["devices"]}
    assert devices["k8s-single-amd64"] == ["starter.yaml"]
    assert devices["compose-box-amd64"] == []  # a Helm application: Kubernetes devices only


def test_init_chart_writes_an_application_the_chart_linter_passes(tmp_path: Path) -> None:
    done = margo("init", "--chart", "edge-web", tmp_path)
    assert done.returncode == 0, done.stderr
    app = tmp_path / "edge-web"
    assert margo("validate", app / "margo.yaml").returncode == 0
    lint = margo("lint-chart", app / "charts" / "edge-web", "--app", app / "margo.yaml",
                 "--json")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert json.loads(lint.stdout) == []  # not even a warning or a note


def test_the_scaffolded_chart_renders_names_from_the_release(tmp_path: Path) -> None:
    assert margo("init", "--chart", "edge-web", tmp_path).returncode == 0
    with helm.Chart.load(tmp_path / "edge-web" / "charts" / "edge-web") as chart:
        rendered = chart.render({"replicaCount": 3}, name="shop-front", namespace="shop",
                                is_install=True)
    objects = [o for text in rendered.values() for o in yaml.safe_load_all(text) if o]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("ConfigMap", "shop-front-config"), ("Deployment", "shop-front"),
        ("Service", "shop-front")]
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 3
    [spread] = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "shop-front"
    assert pod["containers"][0]["resources"]["requests"] == {"cpu": "100m", "memory": "64Mi"}
    assert "nodeName" not in pod and "nodeSelector" not in pod


@pytest.mark.parametrize(("args", "message"), [
    (["--chart", "Edge_Web"], "is no chart name"),
    ([], "already exists and is not empty"),
], ids=["a name Helm would refuse", "a folder that holds something"])
def test_init_refuses_and_overwrites_nothing(tmp_path: Path, args: list[str],
                                             message: str) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    done = margo("init", *args, tmp_path)
    assert done.returncode == 2
    assert message in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]

