"""The render driver with Compose packages: pulled from the real registry, verified,
checked and written out as the project `docker compose` would be given."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kits.chartkit import converge

from margo.archive import deterministic_targz
from reconciler.charts import ChartCache
from reconciler.desired import DesiredDeployment, parse_deployment
from reconciler.drivers.render import RenderDriver
from reconciler.errors import ApplyError
from reconciler.oci import OciClient

COMPOSE = b"services:\n  hello:\n    image: example/hello:1\n    environment: [GREETING]\n"


def deployment(repository: str, revision: str, greeting: str) -> DesiredDeployment:
    document = {
        "id": "7a1c0e52-0000-4c1e-9d43-0b5a1d9e2a10",
        "metadata": {"name": "hello", "namespace": "compose", "deviceId": "box-1"},
        "spec": {"applicationId": "com-example-hello", "deploymentProfile": {
            "type": "compose", "components": [{"name": "hello", "properties": {
                "repository": repository, "revision": revision}}]},
            "parameters": {"greeting": {"value": greeting, "targets": [
                {"pointer": "GREETING", "components": ["hello"]}]}}}}
    return parse_deployment(yaml.safe_dump(document).encode())


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[RenderDriver]:
    with OciClient() as oci, ChartCache(tmp_path / "charts") as charts:
        yield RenderDriver(tmp_path / "out", charts, oci=oci)


def test_compose_projects_are_written_with_parameters_as_env(
        driver: RenderDriver, registry: str, tmp_path: Path) -> None:
    repository = f"oci://{registry}/compose/render-hello"
    with OciClient() as oci:
        oci.push_artifact(repository, "1.0.0", deterministic_targz(
            {"hello/compose.yaml": COMPOSE, "hello/.env": b"GREETING=default\n"}))
    assert driver.profile_types == ("helm", "compose")
    converge(driver, [deployment(repository, "1.0.0", "Hi there")])
    [project] = (tmp_path / "out" / "compose").iterdir()
    assert (project / "compose.yaml").read_bytes() == COMPOSE
    assert (project / "package.env").read_text() == "GREETING=default\n"
    assert "GREETING='Hi there'" in (project / ".env").read_text() or \
        'GREETING="Hi there"' in (project / ".env").read_text()
    [release] = driver.installed()
    assert release.healthy and release.component == "hello"
    # Reconfigure, then remove.
    converge(driver, [deployment(repository, "1.0.0", "Bye")])
    assert "Bye" in (project / ".env").read_text()
    converge(driver, [])
    assert driver.installed() == [] and not project.exists()


def test_unsafe_packages_are_refused_before_anything_is_written(
        driver: RenderDriver, registry: str, tmp_path: Path) -> None:
    repository = f"oci://{registry}/compose/render-unsafe"
    with OciClient() as oci:
        oci.push_artifact(repository, "1.0.0", deterministic_targz(
            {"hello/compose.yaml": COMPOSE, "other/compose.yaml": COMPOSE}))
    with pytest.raises(ApplyError) as caught:
        converge(driver, [deployment(repository, "1.0.0", "x")])
    assert caught.value.code == "UNSAFE_PACKAGE" and not caught.value.retryable
    assert driver.installed() == []


def test_without_an_oci_client_only_helm_is_supported(tmp_path: Path) -> None:
    with ChartCache(tmp_path / "charts") as charts:
        assert RenderDriver(tmp_path / "out", charts).profile_types == ("helm",)
