"""Helm charts published to a real OCI registry, as a vendor publishes them: packaged and
pushed with the real Helm engine. For the tests (`kits.chartkit`), the benchmarks and the
demo."""

from __future__ import annotations

import tempfile
from pathlib import Path

import helm_python as helm
import yaml

from reconciler.registry_credentials import docker_config_text

__all__ = ["EXAMPLE_CHARTS", "chart_digest", "publish_chart", "publish_example_charts"]

ROOT = Path(__file__).resolve().parents[1]
#: Every chart of the example fleet.
EXAMPLE_CHARTS = sorted((ROOT / "examples" / "fleet" / "apps").glob("*/charts/*/Chart.yaml"))


def publish_chart(registry: str, chart_dir: Path, *, repo_path: str = "charts",
                  credentials: tuple[str, str] | None = None) -> str:
    """Package `chart_dir` and push it to `registry` (plain HTTP; as user and password
    `credentials` to a registry that requires them); return the `oci://` repository of the
    chart (`oci://<registry>/<repo_path>/<chart name>`)."""
    name = yaml.safe_load((chart_dir / "Chart.yaml").read_text())["name"]
    with tempfile.TemporaryDirectory() as scratch:
        archive = helm.package(chart_dir, destination=scratch)
        if credentials is None:
            helm.push(archive, f"oci://{registry}/{repo_path}", plain_http=True)
        else:
            config = Path(scratch) / "config.json"
            config.write_text(docker_config_text([], {registry: credentials}))
            with helm.RegistryClient(plain_http=True, credentials_file=config) as client:
                helm.push(archive, f"oci://{registry}/{repo_path}", client=client,
                          plain_http=True)
    return f"oci://{registry}/{repo_path}/{name}"


def publish_example_charts(registry: str) -> dict[str, tuple[str, str]]:
    """Push every chart of the example fleet (`examples/fleet/apps/*/charts/*`) under
    `charts/`, as the example descriptions expect; chart name -> (`oci://` repository,
    chart version)."""
    out: dict[str, tuple[str, str]] = {}
    for chart_yaml in EXAMPLE_CHARTS:
        meta = yaml.safe_load(chart_yaml.read_text())
        out[meta["name"]] = (publish_chart(registry, chart_yaml.parent), str(meta["version"]))
    return out


def chart_digest(registry: str, repository: str, version: str) -> str:
    """The manifest digest the registry holds for `repository:version`."""
    with helm.RegistryClient(plain_http=True) as client:
        ref = repository.removeprefix("oci://") + f":{version}"
        return str(client.resolve(ref)["digest"])
