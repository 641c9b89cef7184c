"""Fixtures for the conformance kit's tests: one real OCI registry (Debian docker-registry)
holding the kit's application package in the Margo layout, shared by the modules here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.conformancekit import PACKAGE_DIR, push_margo_package
from kits.registrykit import running_registry

PACKAGE_REPOSITORY = "margo-ctt/hello-world"
PACKAGE_TAG = "1.0"  # the Application Description's metadata.version (tag MUST equal it)


@pytest.fixture(scope="session")
def kit_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`127.0.0.1:<port>` of a running registry (plain HTTP)."""
    with running_registry(tmp_path_factory.mktemp("kit-registry")) as host:
        yield host


@pytest.fixture(scope="session")
def package_ref(kit_registry: str) -> str:
    """`host/margo-ctt/hello-world:1.0`: the kit's margo-ctt-package, pushed as Margo says."""
    push_margo_package(kit_registry, PACKAGE_REPOSITORY, PACKAGE_TAG, PACKAGE_DIR)
    return f"{kit_registry}/{PACKAGE_REPOSITORY}:{PACKAGE_TAG}"
