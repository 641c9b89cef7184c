"""How a rendered Kubernetes object shares a device with others: what its containers ask
for, and whether its name comes from the release.

A device may run one chart for several deployments, each its own Helm release, next to
other applications on a node that has little to spare. So every container should say what
it needs (a cpu and a memory request: the scheduler places by them, and without them a
small node is overcommitted unseen) and bound its memory (a limit: one leaking container
must not take the node's memory from the rest), and every object's name should be derived
from the release name, or a second release of the chart collides with the first.

Pure functions over rendered objects; `authoring.chartlint` turns them into findings.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["FIXED_NAME_EXEMPT", "containers", "fixed_name", "missing_resources"]

#: Kinds whose names are not the chart's to choose (a CRD is named after its group, and is
#: forbidden anyway).
FIXED_NAME_EXEMPT = frozenset({"CustomResourceDefinition"})


def containers(pod: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The containers and init containers of a pod spec."""
    for key in ("initContainers", "containers"):
        found = pod.get(key)
        if isinstance(found, list):
            yield from (c for c in found if isinstance(c, Mapping))


def missing_resources(container: Mapping[str, Any]) -> list[str]:
    """What of a cpu request, a memory request and a memory limit the container leaves
    unset. A limit alone counts as the request too (Kubernetes defaults it so)."""
    resources = container.get("resources")
    resources = resources if isinstance(resources, Mapping) else {}
    requests, limits = (resources.get(key) for key in ("requests", "limits"))
    requests = requests if isinstance(requests, Mapping) else {}
    limits = limits if isinstance(limits, Mapping) else {}
    missing = [f"{resource} request" for resource in ("cpu", "memory")
               if requests.get(resource) is None and limits.get(resource) is None]
    if limits.get("memory") is None:
        missing.append("memory limit")
    return missing


def fixed_name(doc: Mapping[str, Any], release: str) -> str | None:
    """The object's name when it does not contain the release name it was rendered with:
    fixed in the chart (or by a value such as `fullnameOverride`). None when it is derived
    from the release, generated (`generateName`), or the kind's name is not the chart's."""
    metadata = doc.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name or doc.get("kind") in FIXED_NAME_EXEMPT:
        return None
    return None if release in name else name
