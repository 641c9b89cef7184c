"""Whether the objects a Helm release consists of still exist in the cluster (drift).

Helm's release record says what it applied, not what is there now: a Deployment deleted
out of band leaves the release `deployed`. `ReleaseObjects` reads the release manifest
once per revision, resolves each object's kind to its API path through the server's own
discovery documents (so CRDs work, and a kind that is no longer served counts as gone)
and GETs every object; what answers 404 is missing.

A read the client may not make (403) proves nothing either way and is left out, so drift
detection never reports a false alarm under narrow RBAC; an unreachable server raises
the `KubeError` (the caller reports the engine unavailable). Only presence is checked:
fields changed out of band are Helm's three-way merge's business at the next upgrade.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import yaml

from reconciler.kubernetes.client import KubeClient, KubeError

__all__ = ["ObjectRef", "ReleaseObjects", "manifest_objects"]

log = logging.getLogger("margo.device.drift")


@dataclass(frozen=True)
class ObjectRef:
    """One object of a manifest; `namespace` is None when the manifest names none."""

    api_version: str
    kind: str
    name: str
    namespace: str | None

    def describe(self, namespace: str | None) -> str:
        return f"{self.kind} {namespace}/{self.name}" if namespace else f"{self.kind} {self.name}"


def manifest_objects(manifest: str) -> list[ObjectRef]:
    """The objects of a rendered multi-document manifest, in order (Helm's `manifest`)."""
    refs: list[ObjectRef] = []
    for document in yaml.safe_load_all(manifest or ""):
        if not isinstance(document, dict):
            continue
        meta = document.get("metadata") or {}
        api_version, kind, name = document.get("apiVersion"), document.get("kind"), \
            meta.get("name")
        if not (isinstance(api_version, str) and isinstance(kind, str) and isinstance(name, str)):
            continue
        namespace = meta.get("namespace")
        refs.append(ObjectRef(api_version, kind, name,
                              namespace if isinstance(namespace, str) else None))
    return refs


class ReleaseObjects:
    """Checks objects against one API server; discovery answers are cached per group
    version and read again when a kind is not found (a CRD installed since)."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self._kinds: dict[str, dict[str, tuple[str, bool]] | None] = {}

    def _resources(self, api_version: str, *, fresh: bool = False) -> \
            dict[str, tuple[str, bool]] | None:
        """kind → (plural, namespaced) for a group version; None when it is not served."""
        if fresh or api_version not in self._kinds:
            path = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
            try:
                body = self.client.get(path)
            except KubeError as exc:
                if exc.status != 404:
                    raise
                self._kinds[api_version] = None
            else:
                self._kinds[api_version] = {
                    str(r["kind"]): (str(r["name"]), bool(r.get("namespaced")))
                    for r in body.get("resources") or []
                    if isinstance(r, dict) and "/" not in str(r.get("name", ""))}
        return self._kinds[api_version]

    def _path(self, ref: ObjectRef, release_namespace: str) -> tuple[str, str | None] | None:
        kinds = self._resources(ref.api_version)
        if kinds is None or ref.kind not in kinds:
            kinds = self._resources(ref.api_version, fresh=True)
        if kinds is None or ref.kind not in kinds:
            return None
        plural, namespaced = kinds[ref.kind]
        base = f"/api/{ref.api_version}" if "/" not in ref.api_version else \
            f"/apis/{ref.api_version}"
        if not namespaced:
            return f"{base}/{plural}/{ref.name}", None
        namespace = ref.namespace or release_namespace
        return f"{base}/namespaces/{namespace}/{plural}/{ref.name}", namespace

    def missing(self, refs: list[ObjectRef], release_namespace: str) -> list[str]:
        """Descriptions of the objects that are gone ("Deployment edge/web"), in order."""
        gone: list[str] = []
        for ref in refs:
            where: str | None = ref.namespace or release_namespace
            try:
                found = self._path(ref, release_namespace)
                if found is None:
                    gone.append(f"{ref.describe(where)} ({ref.api_version} {ref.kind} is "
                                "not served)")
                    continue
                path, where = found
                self.client.get(path)
            except KubeError as exc:
                if exc.status is None:
                    raise
                if exc.status == 404:
                    gone.append(ref.describe(where))
                else:  # 403 and friends: cannot tell, so do not claim drift
                    log.debug("cannot check %s: %s", ref.describe(where), exc)
        return gone
