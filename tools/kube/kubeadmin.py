"""A cluster administrator's hands for tests, benchmarks and `make cluster`: server-side
apply, get, list, delete and waiting, over httpx with the admin client certificate.

The device client's own Kubernetes client (`reconciler.kubernetes.client`) is read-only on
purpose; tests need to write (nodes, RBAC objects, out-of-band deletions), so they get this
separate, equally small client. Objects are plain dicts; a kind is mapped to its API path by
the table below, which lists the kinds the tests use (`resource_path` says so when a kind is
missing rather than guessing a plural).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

from tools.polling import poll_until

__all__ = ["KINDS", "KubeAdmin", "NotFound", "tls_context"]

FIELD_MANAGER = "margo-gitops-tests"

#: kind → (API prefix, plural, namespaced)
KINDS: dict[str, tuple[str, str, bool]] = {
    "Namespace": ("/api/v1", "namespaces", False),
    "Node": ("/api/v1", "nodes", False),
    "Pod": ("/api/v1", "pods", True),
    "Secret": ("/api/v1", "secrets", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Service": ("/api/v1", "services", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "ReplicaSet": ("/apis/apps/v1", "replicasets", True),
    "DaemonSet": ("/apis/apps/v1", "daemonsets", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases", True),
    "StorageClass": ("/apis/storage.k8s.io/v1", "storageclasses", False),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions",
                                 False),
}


def tls_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """Trust only the cluster's CA; present a client certificate when given."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None and key is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


class NotFound(LookupError):
    """404 from the API server."""


def resource_path(kind: str, name: str | None = None, namespace: str | None = None,
                  subresource: str | None = None) -> str:
    if kind not in KINDS:
        raise KeyError(f"kubeadmin: kind {kind!r} is not in KINDS; add it there")
    prefix, plural, namespaced = KINDS[kind]
    path = prefix
    if namespaced and namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class KubeAdmin:
    """Requests as the cluster's superuser (`system:masters`)."""

    def __init__(self, server: str, *, ca: Path, cert: Path, key: Path,
                 timeout: float = 30.0) -> None:
        self.server = server
        self._http = httpx.Client(base_url=server, verify=tls_context(ca, cert, key),
                                  timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> KubeAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, path, **kwargs)
        if response.status_code == 404:
            raise NotFound(f"{method} {path}: {response.text[:300]}")
        if response.is_error:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:600]}")
        return response

    def apply(self, obj: Mapping[str, Any], *, subresource: str | None = None) -> dict[str, Any]:
        """Server-side apply (create or update) `obj`, forcing our field ownership."""
        meta = obj["metadata"]
        path = resource_path(obj["kind"], meta["name"], meta.get("namespace"), subresource)
        return self.request("PATCH", path, params={"fieldManager": FIELD_MANAGER, "force": "true"},
                            content=json.dumps(obj),
                            headers={"Content-Type": "application/apply-patch+yaml"}).json()

    def apply_file(self, path: Path) -> list[dict[str, Any]]:
        """Server-side apply every document of a YAML file, in order."""
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
        return [self.apply(document) for document in documents]

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        return self.request("GET", resource_path(kind, name, namespace)).json()

    def find(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return self.get(kind, name, namespace)
        except NotFound:
            return None

    def list(self, kind: str, namespace: str | None = None, *,
             selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else {}
        return self.request("GET", resource_path(kind, None, namespace),
                            params=params).json()["items"]

    def delete(self, kind: str, name: str, namespace: str | None = None, *,
               missing_ok: bool = True) -> None:
        try:
            self.request("DELETE", resource_path(kind, name, namespace),
                         params={"propagationPolicy": "Background"})
        except NotFound:
            if not missing_ok:
                raise

    def merge_patch(self, kind: str, name: str, patch: Mapping[str, Any],
                    namespace: str | None = None) -> dict[str, Any]:
        return self.request("PATCH", resource_path(kind, name, namespace),
                            content=json.dumps(patch),
                            headers={"Content-Type": "application/merge-patch+json"}).json()

    def create_token(self, account: str, namespace: str, *, seconds: int = 86400) -> str:
        """A bound service account token (TokenRequest), as a pod would be given."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds}}
        path = resource_path("ServiceAccount", account, namespace, "token")
        return self.request("POST", path, json=body).json()["status"]["token"]

    def until(self, what: str, predicate: Callable[[], Any], *, timeout: float = 60.0,
              interval: float = 0.2) -> Any:
        """Poll `predicate` until it returns something true; fail naming `what`."""
        return poll_until(what, predicate, timeout=timeout, interval=interval)
