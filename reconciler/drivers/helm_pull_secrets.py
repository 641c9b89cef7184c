"""Registry credentials granted to a Helm deployment, given to the cluster that pulls its
images: a pull secret per release, referenced by the namespace's `default` ServiceAccount.

With the `helm` driver the device pulls only the chart; the kubelet of the node that runs a
pod pulls its images, with the credentials the pod names (`imagePullSecrets`). So at every
step that may pull (install, upgrade, reconfigure, reinstall, recover, repair), after the
chart is fetched and before Helm touches the release, `PullSecrets.sync`:

- writes the Secret `margo-registry-<release>` (type `kubernetes.io/dockerconfigjson`) in the
  release's namespace, creating the namespace when it does not exist yet: a Docker
  `config.json` with every grant of the deployment (`docker_config_text`). Every one, not
  only the hosts the device's own `registries:` leave out: the kubelet never sees the
  device's configuration. Labels say whose it is (managed by margo-gitops; the deployment,
  component and release). Written by server-side apply (field manager `margo-gitops`), and
  only when its data or labels differ from what is there: the same password sealed again
  changes nothing in the cluster;
- adds `{name: margo-registry-<release>}` to the `imagePullSecrets` of the namespace's
  `default` ServiceAccount, keeping the others: read, then patched under the resourceVersion
  read (that list is atomic for server-side apply, which would take all of it), again after
  a conflict; the account is created when the controller has not made it yet.

The API server's ServiceAccount admission copies an account's `imagePullSecrets` into each
new pod that runs under it and names none of its own: pods without a `serviceAccountName`
get the grant without the chart's cooperation. Pods under another ServiceAccount, or naming
their own `imagePullSecrets`, do not; such a chart has to name the Secret itself (its name is
known in advance). The scope is the namespace: every pod of it that uses the `default`
account may pull with the grants of each release there.

A step of a deployment without grants and the release's removal (`revoke`) take the
reference out of the account and delete the Secret, when there is one of ours: a revoked
grant leaves no credential in the cluster. A Secret of that name that margo-gitops did not
make is never written nor deleted (the step fails, `INSTALL_FAILED`, not retried). When the
kubeconfig is one this module's client cannot use (an exec credential plugin, which Helm
itself runs), no pull secret is written and a warning says so once, as for drift checks.

No message carries a password: API errors pass through the grants' redaction, which here
also covers the Secret's data as the request carried it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from reconciler.errors import ApplyError, ErrorCode
from reconciler.kubernetes.client import (
    Forbidden,
    KubeClient,
    KubeConfigError,
    KubeError,
    default_access,
)
from reconciler.registry_credentials import docker_config_text
from reconciler.registry_grants import Granted
from reconciler.releases import LABEL_COMPONENT, LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER
from reconciler.sealed_values import Opened

__all__ = ["PullSecrets", "secret_name"]

log = logging.getLogger("margo.device.helm")

SECRET_TYPE = "kubernetes.io/dockerconfigjson"
DATA_KEY = ".dockerconfigjson"
#: The account pods use when they name none.
SERVICE_ACCOUNT = "default"
FIELD_MANAGER = "margo-gitops"
LABEL_RELEASE = "margo-gitops.dev/release"
_APPLY = "application/apply-patch+yaml"
_MERGE = "application/merge-patch+json"
_ATTEMPTS = 5


def secret_name(release: str) -> str:
    """The pull secret of a release (a release name has at most 53 characters)."""
    return f"margo-registry-{release}"


class KubeWriter(KubeClient):
    """The read client plus one method that writes, for this module alone (`KubeClient`
    itself stays read-only)."""

    def send(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
             content_type: str = "application/json",
             params: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One request; its JSON answer ({} when none). `KubeError` for any failure."""
        headers = {"Content-Type": content_type} if body is not None else None
        try:
            response = self._http.request(
                method, path, params=dict(params or {}), headers=headers,
                content=None if body is None else json.dumps(body),
                extensions=self._extensions)
        except httpx.TransportError as exc:
            raise KubeError(None, "Unreachable", f"{self.access.server}{path}: {exc}") from exc
        except OSError as exc:  # an unreadable token file
            raise KubeError(None, "NoCredentials", str(exc)) from exc
        if not response.is_success:
            raise KubeError.from_response(response)
        with contextlib.suppress(ValueError):
            found = response.json()
            if isinstance(found, dict):
                return found
        return {}


def _ours(found: Mapping[str, Any]) -> bool:
    labels = (found.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(LABEL_MANAGED_BY) == MANAGER)


class PullSecrets:
    """Pull secrets of the releases on one cluster (see the module docstring); the API
    client is opened on first use with the credentials Helm uses."""

    def __init__(self, kubeconfig: Path | None = None, kube_context: str | None = None, *,
                 client: KubeWriter | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.kube_context = kube_context
        self._client = client
        self._warned = False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def sync(self, namespace: str, release: str, granted: Granted, *, deployment_id: str,
             component: str, failure: str) -> None:
        """Before an install or upgrade: the release's pull secret holding `granted`, or
        none when nothing is granted. `ApplyError` (`failure`, or `ENGINE_UNAVAILABLE`),
        without any password, when the cluster refuses or cannot be reached."""
        if not granted.credentials:
            self.revoke(namespace, release, failure=failure)
            return
        config = docker_config_text([], granted.credentials)
        data = base64.b64encode(config.encode("utf-8")).decode("ascii")
        labels = {LABEL_MANAGED_BY: MANAGER, LABEL_DEPLOYMENT: deployment_id,
                  LABEL_COMPONENT: component, LABEL_RELEASE: release}
        what = f"writing the pull secret {namespace}/{secret_name(release)}"
        try:
            client = self._kube()
        except (KubeConfigError, OSError) as exc:  # e.g. an exec plugin, which Helm runs
            if not self._warned:
                log.warning("no pull secrets for Helm releases: the cluster's credentials "
                            "cannot be used for it (%s); the kubelet pulls with what the "
                            "cluster has", exc)
                self._warned = True
            return
        with granted.redacting(), Opened({}, (config,)).redacting(), \
                self._errors(failure, what):
            if self._secret(client, namespace, release, data, labels):
                log.info("registry credentials for %s written to Secret %s/%s",
                         ", ".join(sorted(granted.hosts)), namespace, secret_name(release))
            self._reference(client, namespace, secret_name(release), add=True)

    def revoke(self, namespace: str, release: str, *, failure: str) -> None:
        """The release's pull secret and its reference gone (after an uninstall, or a step
        without grants). Nothing to do, and no error, when this client cannot read Secrets
        there: then it never wrote one."""
        try:
            client = self._kube()
        except (KubeConfigError, OSError) as exc:  # then nothing can have been written
            log.debug("no pull secret to remove: cannot reach the cluster (%s)", exc)
            return
        name = secret_name(release)
        path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
        with self._errors(failure, f"removing the pull secret {namespace}/{name}"):
            try:
                found = _get(client, path)
            except Forbidden as exc:
                log.debug("cannot read %s: %s", path, exc)
                return
            if found is None or not _ours(found):
                return
            self._reference(client, namespace, name, add=False)
            try:
                client.send("DELETE", path)
            except KubeError as exc:
                if exc.status != 404:  # gone meanwhile: as good
                    raise
            log.info("pull secret %s/%s removed", namespace, name)

    # --- steps -----------------------------------------------------------------------------

    def _secret(self, client: KubeWriter, namespace: str, release: str, data: str,
                labels: Mapping[str, str]) -> bool:
        """The Secret written when it differs (True), after making its namespace."""
        name = secret_name(release)
        if _get(client, f"/api/v1/namespaces/{namespace}") is None:
            try:
                client.send("POST", "/api/v1/namespaces", {
                    "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
                    params={"fieldManager": FIELD_MANAGER})
            except KubeError as exc:
                if exc.status != 409:  # made meanwhile (Helm's own create is the same)
                    raise
        path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
        found = _get(client, path)
        if found is not None and not _ours(found):
            raise ApplyError(ErrorCode.INSTALL_FAILED, f"release {release}: Secret "
                             f"{namespace}/{name} exists and margo-gitops did not make it; "
                             "it is not overwritten (rename or remove it)", retryable=False)
        if found is not None and found.get("type") == SECRET_TYPE \
                and (found.get("data") or {}) == {DATA_KEY: data} \
                and all(((found.get("metadata") or {}).get("labels") or {}).get(k) == v
                        for k, v in labels.items()):
            return False
        client.send("PATCH", path, {
            "apiVersion": "v1", "kind": "Secret", "type": SECRET_TYPE,
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "data": {DATA_KEY: data}}, content_type=_APPLY,
            params={"fieldManager": FIELD_MANAGER, "force": "true"})
        return True

    @staticmethod
    def _reference(client: KubeWriter, namespace: str, name: str, *, add: bool) -> None:
        """`name` added to (or taken out of) the `imagePullSecrets` of the namespace's
        default ServiceAccount, every other entry kept."""
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{SERVICE_ACCOUNT}"
        for _ in range(_ATTEMPTS):
            account = _get(client, path)
            if account is None:
                if not add:
                    return
                try:
                    client.send("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {
                        "apiVersion": "v1", "kind": "ServiceAccount",
                        "metadata": {"name": SERVICE_ACCOUNT},
                        "imagePullSecrets": [{"name": name}]},
                        params={"fieldManager": FIELD_MANAGER})
                    return
                except KubeError as exc:
                    if exc.status != 409:  # made meanwhile: read it again
                        raise
                    continue
            listed = [s for s in account.get("imagePullSecrets") or [] if isinstance(s, dict)]
            if any(s.get("name") == name for s in listed) == add:
                return
            kept = [*listed, {"name": name}] if add else \
                [s for s in listed if s.get("name") != name]
            try:
                client.send("PATCH", path, {
                    "metadata": {"resourceVersion": account["metadata"]["resourceVersion"]},
                    "imagePullSecrets": kept or None},
                    content_type=_MERGE, params={"fieldManager": FIELD_MANAGER})
                return
            except KubeError as exc:
                if exc.status != 409:  # changed since read: read it again
                    raise
        raise KubeError(409, "Conflict", f"ServiceAccount {namespace}/{SERVICE_ACCOUNT} "
                        f"changed at each of {_ATTEMPTS} attempts")

    # --- helpers ---------------------------------------------------------------------------

    def _kube(self) -> KubeWriter:
        """The API client, opened on first use; `KubeConfigError` or `OSError` when the
        kubeconfig (or the pod's service account) cannot be used."""
        if self._client is None:
            self._client = KubeWriter(default_access(self.kubeconfig, self.kube_context))
        return self._client

    @staticmethod
    @contextlib.contextmanager
    def _errors(failure: str, what: str) -> Iterator[None]:
        try:
            yield
        except KubeError as exc:
            code = ErrorCode.ENGINE_UNAVAILABLE if exc.unreachable else failure
            raise ApplyError(code, f"{what}: {exc.describe() if exc.status else exc}") from exc


def _get(client: KubeWriter, path: str) -> dict[str, Any] | None:
    """The object at `path`, or None when there is none (404)."""
    try:
        return client.get(path)
    except KubeError as exc:
        if exc.status == 404:
            return None
        raise
