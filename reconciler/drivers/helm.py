"""The `helm` driver: components installed as Helm releases, through the Helm v4 engine
in-process (helm_python), with Helm's own release records as the source of truth.

What the driver reads: `installed()` lists releases in every namespace (Helm 4 stores
release labels on its records and returns them from `list`) and classifies each: ours in
the state Helm records (`deployed`, `failed`, `pending-install`, `pending-upgrade` for a
crashed upgrade or rollback), or `unmanaged` when its labels do not prove it ours, so the
planner never installs over a release someone installed by hand nor removes it.

What one step does, exactly as the planner chose it (the driver never decides again):
- `install`: `helm install`, creating the namespace;
- `upgrade` / `reconfigure`: `helm upgrade` with the values reset to exactly the desired
  ones (an empty set must not mean "reuse the old values");
- `reinstall` (a crashed first install; nothing to roll back to): `uninstall`, then
  `install`, as Helm users do;
- `recover` (a crashed later operation): `rollback` to the previous revision, then
  `upgrade`;
- `repair` (deployed as desired, but objects went missing and the drift policy is
  `repair`): `helm upgrade` onto the same chart and values, which creates them again;
- `remove`: `helm uninstall`;
- `skip` (the name is taken by a release that is not ours): refused, `INSTALL_FAILED`.
The driver assumes it is the only writer of its releases (the spec gives a device a single
WFM client), so a pending release it meets is a crashed operation, not a live one.

Telemetry (`injection`): every install and upgrade runs Helm's post-render step with our
plugin (`reconciler.telemetry.helmplugin`), which adds the Margo telemetry variables to
every container and init container of every pod template the release renders, unless the
chart's own `env` sets them (`reconciler.telemetry.inject`). Helm records the post-rendered
manifest, so drift checks and `helm get manifest` show what was applied.

Drift (`drift`): Helm's record says what it applied, not what is there now. With drift
detection on (`warn`, the default, or `repair`), `installed()` checks that every object of
each deployed release's manifest still exists (`reconciler.kubernetes.objects`). Missing
objects are named in `InstalledRelease.drift` (`reconciler.releases.with_drift`); the
release stays `deployed`. With `warn` the runner reports the component `failed` with code
`DRIFTED` until someone puts the objects back. With `repair` the release is marked for
repair and the planner plans `repair`: an upgrade onto the same chart and values.

A failed install or upgrade (a timeout, an object the API server refuses) leaves Helm's
record `failed`. Kubernetes keeps the previous ReplicaSets serving while a new rollout
cannot become ready, so the old version keeps running. The next attempt upgrades the
failed release after the runner's retry back-off. With `rollback_on_failure` (Helm's
`--rollback-on-failure`, formerly `--atomic`), Helm also rolls the release back to its
last good revision at once, so the previous objects are restored exactly. The failure is
reported either way.

Read-back (`confirm`, `reconciler.drivers.readback`): after each step the driver reads the
release from Helm's storage, never trusting the SDK's return value alone: the revision the
step wrote must be the current one, `deployed`, with the chart, labels and values applied
(`get values` of that revision, compared by digest); after a removal there must be no
record. Anything else (a record left `failed` or `pending-*`, another writer's revision)
is `READBACK_MISMATCH`.

The SDK (helm-python-sdk) is used through its public API only (`Config.install`,
`.upgrade`, `.status`, ...), except `_post_rendered`: the SDK has no public way to name a
post-renderer, so with telemetry injection that one function calls the C ABI beneath
`Config.install` / `.upgrade` itself.

Sealed values (`reconciler.sealed_values`): a component's envelopes are opened with the
device's key (`key`) at the start of its step, before anything touches the cluster (so a
value that cannot be opened, `SECRET_UNREADABLE`, leaves the running release as it was),
and the opened values go to Helm in memory. Helm keeps them, like every value, in its
release record (a Secret with the default storage driver). The read-back compares the
values under a random per-step key (`Opened.digest_key`), so no plain hash of a secret
reaches a message; Helm's messages lose every plaintext (`Opened.redacting`). Registry
credentials granted to the deployment (`reconciler.registry_grants`) are opened with them
and used for the step's chart pull; the cluster's nodes pull the images themselves, so the
same step, before Helm touches the release, writes them into the release's pull secret
(`margo-registry-<release>`) and references it from the namespace's `default`
ServiceAccount, whose pods then pull with it; a step without grants and the removal take
both away (`reconciler.drivers.helm_pull_secrets`).

Errors (`ApplyError` codes): `TIMEOUT` when Helm's wait or timeout ran out, `CANCELLED`
after `cancel()`, `ENGINE_UNAVAILABLE` when the cluster cannot be reached, `PULL_FAILED` and
friends from the chart cache, otherwise `INSTALL_FAILED` / `UPGRADE_FAILED` /
`UNINSTALL_FAILED` with Helm's message. Such a failure is not retryable when the chart
also rejects the values or fails to render offline (Helm reports both as generic release
errors): only a new desired state can fix that.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from margo.digests import data_digest
from reconciler.charts import ChartCache
from reconciler.desired import DesiredComponent, DesiredDeployment
from reconciler.drivers.helm_pull_secrets import PullSecrets
from reconciler.drivers.readback import NOTHING, require_match
from reconciler.errors import ApplyError, ErrorCode
from reconciler.helm_engine import helm
from reconciler.kubernetes.client import KubeClient, KubeConfigError, KubeError, default_access
from reconciler.kubernetes.objects import ObjectRef, ReleaseObjects, manifest_objects
from reconciler.planner import Action, Step
from reconciler.registry_grants import open_grants
from reconciler.releases import (
    DEFAULT_DRIFT,
    DRIFT_POLICIES,
    InstalledRelease,
    ReleaseState,
    ownership_labels,
    release_from_labels,
    with_drift,
)
from reconciler.sealed_values import Opener, open_values
from reconciler.telemetry import Injection
from reconciler.telemetry.helmplugin import ensure_plugin, injection_argument

__all__ = ["DRIFT_MODES", "HelmDriver"]

log = logging.getLogger("margo.device.helm")

#: Helm's status words, as the planner needs them (anything else, e.g. `failed`: FAILED).
_STATES = {"deployed": ReleaseState.DEPLOYED, "pending-install": ReleaseState.PENDING_INSTALL,
           "pending-upgrade": ReleaseState.PENDING_UPGRADE,
           "pending-rollback": ReleaseState.PENDING_UPGRADE}
#: `off`: trust Helm's records; `warn`: report missing objects; `repair`: re-apply them
#: (`reconciler.releases.DRIFT_POLICIES`, the same for every driver).
DRIFT_MODES = DRIFT_POLICIES

# Helm errors a retry cannot fix: the chart refuses the values, or does not render.
_PERMANENT = (helm.HelmValuesError, helm.HelmRenderError, helm.HelmChartInvalidError,
              helm.HelmChartLoadError, helm.HelmInvalidArgError)


def _timeout(component: DesiredComponent) -> int:
    """Helm takes whole seconds; never round a short timeout down to "no timeout"."""
    return max(1, math.ceil(component.timeout_seconds))


def _fails_offline(chart: helm.Chart, values: dict[str, Any], step: Step) -> bool:
    """Whether the chart rejects these values or fails to render without any cluster: then
    a Helm failure is the chart's verdict, which retrying cannot change. (Helm reports such
    failures as generic release errors, so the class of its exception cannot tell.)"""
    try:
        chart.render(values, name=step.release_name, namespace=step.namespace)
    except (helm.HelmValuesError, helm.HelmRenderError):
        return True
    except helm.HelmError:
        return False
    return False


def _values_digest(values: Any, key: bytes | None = None) -> str:
    """The digest of a release's user-supplied values, as Helm gives them back: no values
    (`null`) is `{}`, and a whole number is the same whether it came back as `1` or `1.0`
    (Helm keeps JSON numbers as floats). With `key` (values holding opened secrets), an
    HMAC under it instead, which says nothing about them outside this process."""
    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
            return int(value)
        return value
    if key is None:
        return data_digest(plain(values or {}))
    text = json.dumps(plain(values or {}), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)
    return "hmac-sha256:" + hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class _Written:
    """What one install or upgrade wrote, as it is to be read back from Helm's storage."""

    revision: int
    chart: str  # "<name> <version>"
    labels: Mapping[str, str]
    values_digest: str
    digest_key: bytes | None = None  # `_values_digest`'s key when values were sealed

    def expected(self) -> dict[str, str]:
        return {"status": "deployed", "revision": str(self.revision), "chart": self.chart,
                "values": self.values_digest,
                **{f"label {k}": v for k, v in sorted(self.labels.items())}}


def _described(record: Mapping[str, Any], values: Any,
               digest_key: bytes | None = None) -> dict[str, str]:
    """Helm's stored release (`status`) and its values, in `_Written.expected`'s words."""
    labels = record.get("labels") or {}
    return {"status": str(record.get("status", "")), "revision": str(record.get("revision", "")),
            "chart": f"{record.get('chart_name', '')} {record.get('chart_version', '')}",
            "values": _values_digest(values, digest_key),
            **{f"label {k}": str(v) for k, v in labels.items()}}


def _post_rendered(config: helm.Config, context: helm.HelmContext, chart: helm.Chart,
                   name: str, values: dict[str, Any], *, upgrade: bool,
                   options: dict[str, Any]) -> dict[str, Any]:
    """`Config.install` / `Config.upgrade` with Helm's post-render step (`options` holds
    `post_renderer` and `post_renderer_args` next to the usual options, under the C ABI's
    names).

    The one call into the SDK's private helpers: helm-python-sdk 0.2.2 has no public way to
    name a post-renderer (its `install` and `upgrade` build a fixed set of options), while
    the C ABI beneath them takes it in the same options JSON. So this calls that ABI exactly
    as the public methods do (same function, same argument order). Replace it with the
    public method once the SDK passes a post-renderer: tests/reconciler/
    test_helm_sdk_surface.py fails then, and also if the ABI function changes shape."""
    from helm_python import _native  # no public equivalent; see the docstring

    present = {key: value for key, value in options.items() if value is not None}
    payload = _native.call_string(
        "helm_upgrade" if upgrade else "helm_install", config._raw(), context._raw(),
        chart._raw(), None, name, json.dumps(values), json.dumps(present) if present else None)
    summary: dict[str, Any] = json.loads(payload)
    return summary


class HelmDriver:
    """Runs Helm components as releases (see the module docstring).

    One `helm_python.Config` per namespace, created on first use and kept: Helm's
    per-release reads and writes (status, rollback, uninstall) act in the configuration's
    namespace, and the `memory` storage driver keeps its records per configuration.

    Installs create the release's namespace and use Helm 4's defaults: server-side apply
    and OpenAPI validation by the API server.

    With `storage_driver="memory"` Helm's records live in this process only and
    `list --all-namespaces` sees none of them, so `installed()` then lists each namespace
    this driver has used instead. Every other storage driver is listed cluster-wide.

    The `ChartCache` belongs to the caller, who closes it."""

    name = "helm"
    profile_types: tuple[str, ...] = ("helm",)

    def __init__(self, charts: ChartCache, *, kubeconfig: Path | None = None,
                 kube_context: str | None = None, storage_driver: str = "secret",
                 drift: str = DEFAULT_DRIFT["helm"], rollback_on_failure: bool = False,
                 injection: Injection | None = None, key: Opener | None = None) -> None:
        if drift not in DRIFT_MODES:
            raise ValueError(f"drift must be one of {', '.join(DRIFT_MODES)}, not {drift!r}")
        self.charts = charts
        self.kubeconfig = kubeconfig
        self.kube_context = kube_context
        self.storage_driver = storage_driver
        self.drift = drift
        self.rollback_on_failure = rollback_on_failure
        self.injection = injection
        self.key = key  # opens sealed values (reconciler.encryption_key.DeviceKey)
        self._post_renderer: str | None = None
        self._configs: dict[str, helm.Config] = {}
        self._running: dict[int, helm.HelmContext] = {}
        self._cancelled: set[int] = set()
        self._lock = threading.RLock()
        self._objects: ReleaseObjects | None = None
        self._manifests: dict[tuple[str, str, int], list[ObjectRef]] = {}
        self._written: dict[tuple[str, str], _Written] = {}
        #: The releases' pull secrets: the grants, for the kubelet's image pulls.
        self.pull_secrets = PullSecrets(kubeconfig, kube_context)

    # --- Driver protocol -----------------------------------------------------------------

    def installed(self) -> list[InstalledRelease]:
        """Every release in every namespace, from Helm's records, classified."""
        out: list[InstalledRelease] = []
        for row in self._list_releases():
            status = str(row.get("status", ""))
            if status == "uninstalled":  # kept history of a removed release
                continue
            release = release_from_labels(
                row.get("labels") or {}, release_name=str(row["name"]),
                namespace=str(row["namespace"]), state=_STATES.get(status, ReleaseState.FAILED),
                detail=status, chart_version=str(row.get("chart_version", "")))
            if release.healthy and self.drift != "off":
                release = self._with_drift(release, int(row.get("revision") or 0))
            out.append(release)
        return sorted(out, key=lambda r: (r.namespace, r.release_name))

    def apply(self, step: Step, deployment: DesiredDeployment | None) -> None:
        """Carry out one planned step (see the module docstring)."""
        action = step.action
        if action is Action.UNCHANGED:
            return
        if action is Action.REMOVE:
            self._uninstall(step.namespace, step.release_name,
                            description=f"margo-gitops: {step.reason}")
            self.pull_secrets.revoke(step.namespace, step.release_name,
                                     failure=ErrorCode.UNINSTALL_FAILED)
            return
        if action is Action.SKIP:
            raise ApplyError(ErrorCode.INSTALL_FAILED, step.reason, retryable=False)
        if action not in (Action.INSTALL, Action.UPGRADE, Action.RECONFIGURE, Action.REINSTALL,
                          Action.RECOVER, Action.REPAIR):
            raise ApplyError(ErrorCode.INVALID_STEP, f"unknown action {action!r}",
                             retryable=False)
        component = step.desired
        if component is None or deployment is None:
            raise ApplyError(ErrorCode.INVALID_STEP,
                             f"{action} of {step.release_name} needs the "
                             "desired component and its deployment", retryable=False)
        opened = open_values(component.values, self.key, component=component.name)
        granted = open_grants(deployment.registry_grants, self.key, deployment=deployment.name)
        upgrade = action not in (Action.INSTALL, Action.REINSTALL)
        with opened.redacting(), granted.redacting():
            chart = self.charts.load(self.charts.fetch(
                component.repository, component.revision, granted=granted.credentials))
            self.pull_secrets.sync(  # the images are the kubelet's pulls
                step.namespace, step.release_name, granted, component=component.name,
                deployment_id=deployment.deployment_id,
                failure=ErrorCode.UPGRADE_FAILED if upgrade else ErrorCode.INSTALL_FAILED)
            labels = ownership_labels(deployment.deployment_id, component.name,
                                      desired_digest=deployment.digest,
                                      spec_digest=component.spec_digest,
                                      values_digest=component.values_digest)
            description = f"margo-gitops {action}: {step.reason}"
            if action is Action.REINSTALL:
                self._uninstall(step.namespace, step.release_name,
                                description="margo-gitops: clearing a crashed install")
            elif action is Action.RECOVER:
                self._rollback(step.namespace, step.release_name, component)
            summary = self._release(step, component, chart, labels, description,
                                    opened.values, upgrade=upgrade)
        self._written[(step.namespace, step.release_name)] = _Written(
            int(summary.get("revision") or 0), f"{chart.name} {chart.version}", labels,
            _values_digest(opened.values, opened.digest_key), opened.digest_key)

    def confirm(self, step: Step, deployment: DesiredDeployment | None) -> None:
        """Read the release back from Helm's storage (see `reconciler.drivers.readback`):
        after a removal, no record; after any other step, the revision that step wrote,
        `deployed`, with the chart, labels and values it was given."""
        written = self._written.pop((step.namespace, step.release_name), None)
        what = f"release {step.namespace}/{step.release_name} in Helm's storage"
        record = self._status(step.namespace, step.release_name)
        if step.action is Action.REMOVE:
            found = NOTHING if record is None else \
                f"{record.get('status')} revision {record.get('revision')}"
            require_match(what, {"release": NOTHING}, {"release": found})
            return
        if written is None:
            raise ApplyError(ErrorCode.INVALID_STEP, f"{step.action} of {step.release_name}: "
                             "nothing was applied to confirm", retryable=False)
        if record is None:
            require_match(what, written.expected(), {})
            return
        revision = int(record.get("revision") or 0)
        with self._errors(ErrorCode.ENGINE_UNAVAILABLE, f"reading the values of {what}"):
            values = self.config(step.namespace).get_values(step.release_name,
                                                            revision=revision or None)
        require_match(what, written.expected(), _described(record, values, written.digest_key))

    def cancel(self) -> None:
        """Abort every Helm operation in flight (from any thread), e.g. at shutdown; each
        raises `ApplyError("CANCELLED")` in the thread that started it."""
        with self._lock:
            for key, context in self._running.items():
                self._cancelled.add(key)
                context.cancel()

    def close(self) -> None:
        """Free the Helm configurations (native handles), the drift reader and the pull
        secrets' client."""
        with self._lock:
            for config in self._configs.values():
                config.close()
            self._configs.clear()
            if self._objects is not None:
                self._objects.client.close()
                self._objects = None
            self.pull_secrets.close()

    def config(self, namespace: str) -> helm.Config:
        """The Helm configuration this driver uses for `namespace` ("" = the kubeconfig's
        default), created on first use. Public so that tools and tests can read the same
        release records (with the memory storage driver, no other configuration can)."""
        with self._lock:
            config = self._configs.get(namespace)
            if config is None:
                with self._errors(ErrorCode.ENGINE_UNAVAILABLE, "configuring Helm"):
                    config = helm.Config(kubeconfig_path=self.kubeconfig,
                                         kube_context=self.kube_context,
                                         storage_driver=self.storage_driver,
                                         namespace=namespace or None)
                self._configs[namespace] = config
            return config

    # --- drift -----------------------------------------------------------------------------

    def _reader(self) -> ReleaseObjects | None:
        """The API reader for drift checks, opened on first use with the credentials Helm
        uses; None (drift not checked, said once in the log) when they cannot be used."""
        if self._objects is None:
            try:
                self._objects = ReleaseObjects(KubeClient(default_access(self.kubeconfig,
                                                                         self.kube_context)))
            except (KubeConfigError, OSError) as exc:
                log.warning("drift detection is off: cannot read the cluster (%s)", exc)
                self.drift = "off"
                return None
        return self._objects

    def _with_drift(self, release: InstalledRelease, revision: int) -> InstalledRelease:
        """`release` with the objects its manifest lists but the cluster no longer has."""
        reader = self._reader()
        if reader is None:
            return release
        key = (release.namespace, release.release_name, revision)
        refs = self._manifests.get(key)
        if refs is None:
            record = self._status(release.namespace, release.release_name)
            refs = manifest_objects(str((record or {}).get("manifest", "")))
            self._manifests = {k: v for k, v in self._manifests.items()
                               if k[:2] != key[:2]} | {key: refs}
        try:
            gone = reader.missing(refs, release.namespace)
        except KubeError as exc:
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, f"checking release "
                             f"{release.release_name} for drift: {exc}") from exc
        if not gone:
            return release
        return with_drift(release, f"missing from the cluster: {', '.join(gone)}", self.drift)

    # --- steps -----------------------------------------------------------------------------

    def _release(self, step: Step, component: DesiredComponent, chart: helm.Chart,
                 labels: dict[str, str], description: str, opened: Mapping[str, Any], *,
                 upgrade: bool) -> dict[str, Any]:
        """One `helm install` / `helm upgrade` (values reset to exactly the desired ones,
        `opened`: the component's values with sealed ones opened) through the SDK's public
        `Config.install` / `Config.upgrade`; with telemetry injection, through
        `_post_rendered`. Returns Helm's summary of the new revision."""
        options: dict[str, Any] = {
            "namespace": step.namespace, "timeout": _timeout(component),
            "wait": "watcher" if component.wait else None, "labels": labels,
            "description": description[:200],
            "rollback_on_failure": self.rollback_on_failure}
        config = self.config(step.namespace)
        failure = ErrorCode.UPGRADE_FAILED if upgrade else ErrorCode.INSTALL_FAILED
        what = f"{'upgrading' if upgrade else 'installing'} {step.release_name}"
        values = dict(opened)
        try:
            with self._operation() as context, self._errors(failure, what, context):
                if self.injection is not None:
                    return _post_rendered(config, context, chart, step.release_name, values,
                                          upgrade=upgrade, options=self._abi_options(
                                              options, upgrade=upgrade))
                if upgrade:
                    return config.upgrade(chart, step.release_name, values, context=context,
                                          reset_values=True, **options)
                return config.install(chart, step.release_name, values, context=context,
                                      create_namespace=True, **options)
        except ApplyError as exc:
            if exc.code == failure and exc.retryable and _fails_offline(chart, values, step):
                raise ApplyError(failure, exc.message, retryable=False) from exc.__cause__
            raise

    def _abi_options(self, options: dict[str, Any], *, upgrade: bool) -> dict[str, Any]:
        """`options` under the C ABI's names (as `Config.install` / `.upgrade` build them),
        with the post-render step: our plugin (`reconciler.telemetry.helmplugin`) with the
        injection as its argument, so every pod template of the release gets the variables
        before Helm applies anything."""
        abi = {**options, "timeout_seconds": options["timeout"],
               "rollback_on_failure": options["rollback_on_failure"] or None}
        del abi["timeout"]
        abi.update({"reset_values": True} if upgrade else {"create_namespace": True})
        abi.update(self._post_render_options())
        return abi

    def _post_render_options(self) -> dict[str, Any]:
        """Helm's post-render options for the telemetry injection (none without one)."""
        if self.injection is None:
            return {}
        if self._post_renderer is None:
            try:
                self._post_renderer = ensure_plugin()
            except OSError as exc:
                raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, "cannot write the telemetry "
                                 f"post-renderer into Helm's plugins directory: {exc}") from exc
        return {"post_renderer": self._post_renderer,
                "post_renderer_args": [injection_argument(self.injection)]}

    def _rollback(self, namespace: str, name: str, component: DesiredComponent) -> None:
        with self._errors(ErrorCode.UPGRADE_FAILED,
                          f"rolling back the crashed operation on {name}"):
            self.config(namespace).rollback(name, timeout=_timeout(component))

    def _uninstall(self, namespace: str, name: str, *, description: str) -> None:
        with self._errors(ErrorCode.UNINSTALL_FAILED, f"uninstalling {name}"):
            self.config(namespace).uninstall(name, ignore_not_found=True,
                                             description=description[:200])

    def _status(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Helm's current record of a release, or None when there is none."""
        with self._errors(ErrorCode.ENGINE_UNAVAILABLE, f"reading release {name}"):
            try:
                return self.config(namespace).status(name)
            except helm.HelmNotFoundError:
                return None

    def _list_releases(self) -> list[dict[str, Any]]:
        with self._errors(ErrorCode.ENGINE_UNAVAILABLE, "listing Helm releases"):
            if self.storage_driver != "memory":
                return self.config("").list(all_namespaces=True, all_states=True)
            with self._lock:
                configs = list(self._configs.values())
            return [row for config in configs for row in config.list(all_states=True)]

    # --- helpers ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _operation(self) -> Iterator[helm.HelmContext]:
        """A cancellable context for one long Helm action, registered for `cancel()`."""
        context = helm.HelmContext()
        key = id(context)
        with self._lock:
            self._running[key] = context
        try:
            yield context
        finally:
            with self._lock:
                self._running.pop(key, None)
                self._cancelled.discard(key)
            context.close()

    @contextlib.contextmanager
    def _errors(self, failure: str, what: str,
                context: helm.HelmContext | None = None) -> Iterator[None]:
        """Translate Helm's exceptions into `ApplyError`, keeping Helm's message."""
        try:
            yield
        except helm.HelmCancelledError as exc:
            key = id(context)
            with self._lock:
                cancelled = key in self._cancelled
                self._cancelled.discard(key)
            if cancelled:
                raise ApplyError(ErrorCode.CANCELLED, f"{what}: cancelled ({exc})") from exc
            raise ApplyError(ErrorCode.TIMEOUT, f"{what}: {exc}") from exc
        except helm.HelmKubeError as exc:
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE, f"{what}: {exc}") from exc
        except _PERMANENT as exc:
            raise ApplyError(failure, f"{what}: {exc}", retryable=False) from exc
        except helm.HelmError as exc:
            raise ApplyError(failure, f"{what}: {exc}") from exc
