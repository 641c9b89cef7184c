"""The cluster clause (`deviceConstraints["x-margo-gitops-extensions"].cluster`): requirements
on a Kubernetes cluster, each field compiled by its own dialect module:

    nodes                      cluster_nodes     N nodes with capacity available, a selector
    kubernetesVersion          cluster_version   a version range
    apiGroups                  cluster_features  served API groups (at a version)
    customResourceDefinitions  cluster_features  installed CRDs
    defaultStorageClass        cluster_features  a default storage class

Every requirement reads the cluster body a device reports under its root
`x-margo-gitops-extensions.cluster`; a device that reported none fails them all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from margo.constraints.cluster_features import (
    compile_api_groups,
    compile_crds,
    compile_storage_class,
)
from margo.constraints.cluster_nodes import compile_node_requirements
from margo.constraints.cluster_version import compile_version_requirement
from margo.constraints.compiled import Check
from margo.constraints.problems import ProblemCollector
from margo.errors import Path

__all__ = ["compile_cluster"]

#: The whole-cluster fields, one requirement each, in the order they are compiled.
_SINGLE_REQUIREMENTS: Final[Mapping[str, Callable[[ProblemCollector, Any, Path],
                                                  Check | None]]] = {
    "kubernetesVersion": compile_version_requirement,
    "apiGroups": compile_api_groups,
    "customResourceDefinitions": compile_crds,
    "defaultStorageClass": compile_storage_class,
}
_CLUSTER_FIELDS: Final = ("nodes", *_SINGLE_REQUIREMENTS)


def compile_cluster(log: ProblemCollector, value: Any, path: Path) -> list[Check]:
    """The cluster requirements: node requirements first, then one per whole-cluster field."""
    doc = log.fields_of(value, path, "cluster requirements", _CLUSTER_FIELDS)
    if doc is None:
        return []
    if not doc:
        log.problem(path, "cluster requirements are empty",
                    expected="one or more of " + ", ".join(_CLUSTER_FIELDS))
    checks: list[Check | None] = []
    if "nodes" in doc:
        checks += compile_node_requirements(log, doc["nodes"], (*path, "nodes"))
    for field, compile_requirement in _SINGLE_REQUIREMENTS.items():
        if field in doc:
            checks.append(compile_requirement(log, doc[field], (*path, field)))
    return [c for c in checks if c is not None]
