"""Reading the cluster a device reported (`x-margo-gitops-extensions.cluster`), shared by the
cluster dialects (nodes, version, features): a section of its body, what it said it could
not read, and the one shape of a cluster failure.

A device that reported no cluster fails every cluster requirement: absence never passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from margo.constraints.pointers import member
from margo.constraints.results import Failure

__all__ = ["NO_CLUSTER", "cluster_failure", "section", "unknown_note"]

#: The second half of every cluster sentence when the device reported no cluster.
NO_CLUSTER: Final = "the device reported no Kubernetes cluster data"


def section(cluster: Mapping[str, Any], *keys: str) -> Any:
    """cluster[k1][k2]...; `MISSING` as soon as a level is absent or not an object."""
    value: Any = cluster
    for key in keys:
        value = member(value, key)
    return value


def unknown_note(cluster: Mapping[str, Any], *words: str) -> str:
    """What the cluster said it could not read about a field (RBAC, errors), as a note, so a
    missing section reads as "could not read: forbidden" rather than as "has none"."""
    unknown = cluster.get("unknown")
    if not isinstance(unknown, list | tuple):
        return ""
    notes = []
    for entry in unknown:
        what = str(entry.get("what", "")) if isinstance(entry, Mapping) else ""
        if what and any(word.lower() in what.lower() for word in words):
            reason = entry.get("reason")
            notes.append(f"{what}: {reason}" if reason else what)
    return f" (the cluster could not read {'; '.join(notes)})" if notes else ""


def cluster_failure(stage: str, key: str, operator: str, required: Any, actual: Any,
                    message: str) -> list[Failure]:
    """The failure of a whole-cluster requirement, keyed `cluster.<field>`."""
    return [Failure(stage, f"cluster.{key}", operator, required, actual, None, message)]
