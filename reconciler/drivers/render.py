"""The `render` driver: Helm charts rendered to files instead of installed into a cluster.

For devices where something else applies manifests (a GitOps agent watching a directory, an
air-gapped handover, a dry run of the whole fleet), and for tests that need the real Helm
engine without a Kubernetes API. Each release becomes a directory
`<output_dir>/<namespace>/<release>/` holding one file per rendered template (Helm's own
template paths, e.g. `greeter/templates/configmap.yaml`; NOTES.txt and templates that
render to nothing are left out), with deterministic bytes: the same chart and values always
give identical files.

The driver's record of what it installed is a ledger, `<output_dir>/.ledger.json`, playing
the part of Helm's release records:
- per release (key `<namespace>/<release>`): namespace, ownership labels, chart name and
  version, a revision counter, a status, whether that render was an install, and the
  `sha256:` digest of every file written (`files`; ledgers written before digests were
  recorded lack it and are still read: their files are only checked once rewritten);
- a release is written as `pending-install` / `pending-upgrade` *before* rendering and as
  `deployed` after the new directory is in place, so a crash in between is visible as an
  unhealthy release and the planner applies it again; a render failure leaves `failed`;
- every write replaces the whole file atomically (temporary file, fsync, rename);
- an unreadable ledger is an error (`ENGINE_UNAVAILABLE`), never "nothing installed", which
  would make the device reinstall everything.

Read-back (`confirm`, `reconciler.drivers.readback`): after each step the ledger entry must
be `deployed` with our labels, and the directory must hold exactly the files written, each
with the digest it was written with (after a removal: no entry, no directory); anything
else is `READBACK_MISMATCH`.

Directories are replaced by rendering into a temporary sibling, then renaming: the release
directory is always either the complete old render or the complete new one (or briefly
absent, while the ledger still says pending).

Drift: with the drift policy `warn` or `repair` (`drift`, the device's `driftDetection`;
default `repair`), `installed()` compares each deployed release's directory with the
ledger: a file edited, deleted or added, or the whole directory gone, is named in
`InstalledRelease.drift`. `repair` (planned by the planner as `Action.REPAIR`) renders the
same chart and values at the same revision again and replaces the directory, so the files
are exactly what was written before (a chart using random or time functions gives new
bytes, which the ledger then records). `off` trusts the ledger; only a missing directory
is noticed, as an unhealthy release.

Given an `OciClient`, the driver also "renders" Compose components: the package is pulled
and verified like the Compose driver does, checked for safety, and its files written to the
release directory with the parameters as `.env` - the project exactly as `docker compose`
would be given it. Simulated Compose devices use this; so can a hand-over to another tool.

Sealed values (`reconciler.sealed_values`): the rendered files are this driver's product,
handed to whatever applies them, so they hold the opened values (a Secret manifest, the
`.env` of a Compose project), exactly as the Helm or Compose engine would receive them. The
envelopes are opened with the device's key (`key`) before the ledger or any file changes (a
value that cannot be opened is `SECRET_UNREADABLE`, and the previous render stays as it
was); a release with opened values is written owner-only (directories 0700, files 0600),
and messages lose every plaintext (`Opened.redacting`). Keep `outputDir` on a disk as
trusted as the key itself, and out of backups that are not.

Registry credentials granted to the deployment (`reconciler.registry_grants`) are opened
with its sealed values and used for the step's chart or package pull only (never written:
the chart cache and the OCI client keep them for the call).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml

from margo.files import write_atomically
from reconciler.charts import ChartCache
from reconciler.compose_package import ComposePackage, validate_package
from reconciler.desired import DesiredComponent, DesiredDeployment
from reconciler.drivers.compose import env_file_text
from reconciler.drivers.readback import NOTHING, require_match
from reconciler.errors import ApplyError, ErrorCode
from reconciler.helm_engine import helm
from reconciler.planner import Action, Step
from reconciler.registry_grants import Granted, open_grants
from reconciler.releases import (
    DEFAULT_DRIFT,
    DRIFT_POLICIES,
    InstalledRelease,
    ReleaseState,
    ownership_labels,
    release_from_labels,
    with_drift,
)
from reconciler.sealed_values import Opened, Opener, open_values
from reconciler.telemetry import Injection
from reconciler.telemetry.inject import compose_injection, inject_files

if TYPE_CHECKING:
    from reconciler.oci import OciClient

__all__ = ["LEDGER_NAME", "RenderDriver"]

LEDGER_NAME = ".ledger.json"
#: With telemetry injection, a rendered Compose project's second Compose file.
TELEMETRY_OVERRIDE = "margo-telemetry.yaml"
_LEDGER_FORMAT = 1

# Kubernetes namespace names (DNS labels) and Helm release names: both become directory
# names here, so anything else (a path separator, "..") is refused.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
#: The ledger's status words (Helm's), as the planner needs them.
_STATES = {"deployed": ReleaseState.DEPLOYED, "pending-install": ReleaseState.PENDING_INSTALL,
           "pending-upgrade": ReleaseState.PENDING_UPGRADE}
_RELEASE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,51}[a-z0-9])?\Z")
#: How many file names a drift sentence lists per kind of change.
_NAMED = 3


def _check_names(step: Step) -> None:
    if not _DNS_LABEL.match(step.namespace):
        raise ApplyError(ErrorCode.INVALID_STEP, f"namespace {step.namespace!r} is not a valid "
                         "Kubernetes namespace name", retryable=False)
    if not _RELEASE.match(step.release_name):
        raise ApplyError(ErrorCode.INVALID_STEP,
                         f"release name {step.release_name!r} is not a valid "
                         "Helm release name", retryable=False)


def _manifest_files(rendered: dict[str, str]) -> dict[str, bytes]:
    """Rendered templates worth writing: no NOTES.txt, nothing that renders to whitespace,
    and only relative paths without `..` (a chart cannot write outside its directory)."""
    files: dict[str, bytes] = {}
    for name in sorted(rendered):
        path = PurePosixPath(name)
        if path.name == "NOTES.txt" or not rendered[name].strip():
            continue
        if path.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")):
            raise ApplyError(ErrorCode.UNSAFE_PACKAGE, f"chart template path {name!r} escapes the "
                             "release directory", retryable=False)
        text = rendered[name]
        files[name] = (text if text.endswith("\n") else text + "\n").encode("utf-8")
    return files


def _compose_files(package: ComposePackage, values: Mapping[str, Any],
                   injection: Injection | None = None) -> dict[str, bytes]:
    """The Compose project as `docker compose` would get it: the package's files and the
    parameters as `.env` (a package's own `.env` is kept as `package.env`: the Compose driver
    passes it first, so parameters override it). With telemetry injection,
    `margo-telemetry.yaml` holds what the Compose driver's override file would add (give it
    to Compose as a second `-f`)."""
    files = {("package.env" if name == ".env" else name): data
             for name, data in package.files.items()}
    files[".env"] = env_file_text(values).encode("utf-8")
    services = {entry.service: entry.override()
                for entry in compose_injection(package.compose, package.files, injection)}
    if any(services.values()):
        files[TELEMETRY_OVERRIDE] = yaml.safe_dump(
            {"services": {k: v for k, v in services.items() if v}}, sort_keys=True).encode()
    return dict(sorted(files.items()))


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _file_digests(files: Mapping[str, bytes]) -> dict[str, str]:
    """What the ledger records of a render: each file's digest, by its relative path."""
    return {name: _digest(data) for name, data in sorted(files.items())}


def _on_disk(directory: Path) -> dict[str, str]:
    """Every file under `directory` by relative path, with its digest. Anything that is not
    a regular file (a link, a fifo) or cannot be read gets a marker no digest equals, so it
    counts as changed; links are never followed."""
    found: dict[str, str] = {}
    for root, dirs, names in os.walk(directory):
        base = Path(root)
        for name in [*names, *(d for d in dirs if (base / d).is_symlink())]:
            path = base / name
            relative = path.relative_to(directory).as_posix()
            if path.is_symlink() or not path.is_file():
                found[relative] = "not a regular file"
                continue
            try:
                found[relative] = _digest(path.read_bytes())
            except OSError as exc:
                found[relative] = f"unreadable ({exc.strerror or exc})"
    return found


def _names(paths: list[str]) -> str:
    shown = ", ".join(paths[:_NAMED])
    return shown + (f" and {len(paths) - _NAMED} more" if len(paths) > _NAMED else "")


def _files_drift(recorded: Mapping[str, str], found: Mapping[str, str]) -> str:
    """One sentence naming the files that differ from what the driver wrote ("" if none)."""
    changes = (("edited", sorted(p for p in recorded if p in found and found[p] != recorded[p])),
               ("deleted", sorted(set(recorded) - set(found))),
               ("added", sorted(set(found) - set(recorded))))
    parts = [f"{what} {_names(paths)}" for what, paths in changes if paths]
    return f"rendered files changed: {'; '.join(parts)}" if parts else ""


def _valid_entry(entry: Any) -> bool:
    """A ledger entry the driver can use: an object whose `files`, when present, maps
    relative paths to digests (entries of older ledgers have no `files`)."""
    if not isinstance(entry, dict):
        return False
    files = entry.get("files", {})
    return isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in files.items())


class RenderDriver:
    """Renders Helm components into `output_dir` (see the module docstring).

    Not safe for two processes sharing one `output_dir`; within a process, steps are
    serialised. The `ChartCache` belongs to the caller, who closes it."""

    name = "render"

    def __init__(self, output_dir: Path, charts: ChartCache, *,
                 oci: OciClient | None = None, drift: str = DEFAULT_DRIFT["render"],
                 injection: Injection | None = None, key: Opener | None = None,
                 data_dir: Path | None = None) -> None:
        if drift not in DRIFT_POLICIES:
            raise ValueError(f"drift must be one of {', '.join(DRIFT_POLICIES)}, not {drift!r}")
        self.output_dir = Path(output_dir)
        self.drift = drift
        self.injection = injection
        self.key = key  # opens sealed values (reconciler.encryption_key.DeviceKey)
        #: The device's data directory: opened values are never written inside it.
        self.data_dir = data_dir
        self.charts = charts
        self.oci = oci
        self.profile_types: tuple[str, ...] = ("helm", "compose") if oci else ("helm",)
        self.ledger_path = self.output_dir / LEDGER_NAME
        self._lock = threading.Lock()
        #: Per release key, the digest of every file the last step wrote (for `confirm`).
        self._written: dict[str, dict[str, str]] = {}

    # --- Driver protocol -----------------------------------------------------------------

    def installed(self) -> list[InstalledRelease]:
        """Our releases from the ledger, each deployed one checked against its directory
        (`_checked`). Raises `ApplyError("ENGINE_UNAVAILABLE")` for a corrupt ledger."""
        with self._lock:
            releases = self._read_ledger()
            out: list[InstalledRelease] = []
            for key in sorted(releases):
                entry = releases[key]
                namespace, _, name = key.partition("/")
                status = str(entry.get("status", ""))
                release = release_from_labels(
                    entry.get("labels") or {}, release_name=name, namespace=namespace,
                    state=_STATES.get(status, ReleaseState.FAILED), detail=status,
                    chart_version=str((entry.get("chart") or {}).get("version", "")))
                if release.managed:
                    out.append(self._checked(release, entry) if release.healthy else release)
        return out

    def apply(self, step: Step, deployment: DesiredDeployment | None) -> None:
        """Render (install / upgrade / reconfigure) or delete (remove) one release."""
        _check_names(step)
        with self._lock:
            if step.action is Action.REMOVE:
                self._remove(step)
            elif step.action is Action.SKIP:
                raise ApplyError(ErrorCode.INSTALL_FAILED, step.reason, retryable=False)
            elif step.action in (Action.INSTALL, Action.UPGRADE, Action.RECONFIGURE,
                                 Action.REINSTALL, Action.RECOVER):
                opened, granted = self._open(step, deployment)
                with opened.redacting(), granted.redacting():
                    self._render(step, deployment, opened, granted)
            elif step.action is Action.REPAIR:
                opened, granted = self._open(step, deployment)
                with opened.redacting(), granted.redacting():
                    self._repair(step, deployment, opened, granted)
            elif step.action is not Action.UNCHANGED:
                raise ApplyError(ErrorCode.INVALID_STEP, f"unknown action {step.action!r}",
                                 retryable=False)

    def confirm(self, step: Step, deployment: DesiredDeployment | None) -> None:
        """Read the release back from the ledger and the disk (`reconciler.drivers.readback`):
        after a removal, neither an entry nor a directory; after any other step, the entry
        `deployed` with our labels, and exactly the files written, byte for byte (digests)."""
        key = f"{step.namespace}/{step.release_name}"
        what = f"the rendered release {key}"
        with self._lock:
            entry = self._read_ledger().get(key)
            directory = self._release_dir(step.namespace, step.release_name)
            if step.action is Action.REMOVE:
                require_match(what, {"ledger entry": NOTHING, "directory": NOTHING}, {
                    "ledger entry": NOTHING if entry is None else str(entry.get("status")),
                    "directory": "present" if directory.exists() else NOTHING})
                return
            component, deployment = self._desired(step, deployment)
            written = self._written.pop(key, None)
            if written is None:
                written = dict((entry or {}).get("files") or {})
            on_disk = _on_disk(directory) if directory.is_dir() else {}
            expected = {"status": "deployed", **{
                f"label {k}": v for k, v in self._labels(component, deployment).items()}}
            expected.update({f"file {name}": digest for name, digest in written.items()})
            expected.update({f"file {name}": NOTHING for name in on_disk if name not in written})
            found = {"status": str((entry or {}).get("status", NOTHING)), **{
                f"label {k}": str(v) for k, v in ((entry or {}).get("labels") or {}).items()}}
            found.update({f"file {name}": digest for name, digest in on_disk.items()})
            require_match(what, expected, found)

    def close(self) -> None:
        """Nothing to release: charts belong to the ChartCache, files are closed."""

    # --- actions ---------------------------------------------------------------------------

    def _open(self, step: Step, deployment: DesiredDeployment | None,
              ) -> tuple[Opened, Granted]:
        """The step's values with the sealed ones opened, and the deployment's registry
        grants (before anything is written)."""
        component = step.desired
        if component is None or deployment is None:
            return Opened({}), Granted()  # `_desired` says what is wrong
        opened = open_values(component.values, self.key, component=component.name)
        if opened.secrets and self._inside_data_dir():
            raise ApplyError(ErrorCode.SECRET_EXPOSED, f"{component.name} has sealed values, "
                             f"and the rendered files would hold them in clear in "
                             f"{self.output_dir}, inside the data directory {self.data_dir}: "
                             "set driver.outputDir outside dataDir (docs/device.md, Sealed "
                             "values)", retryable=False)
        return (opened,
                open_grants(deployment.registry_grants, self.key, deployment=deployment.name))

    def _inside_data_dir(self) -> bool:
        if self.data_dir is None:
            return False
        return self.output_dir.resolve().is_relative_to(self.data_dir.resolve())

    def _render(self, step: Step, deployment: DesiredDeployment | None,
                opened: Opened, granted: Granted) -> None:
        component, deployment = self._desired(step, deployment)
        source, loaded = self._fetch(component, deployment, granted)
        releases = self._read_ledger()
        key = f"{step.namespace}/{step.release_name}"
        previous = releases.get(key)
        revision = int(previous.get("revision", 0)) + 1 if previous else 1
        first = previous is None or previous.get("status") == "pending-install"
        entry: dict[str, Any] = {
            "namespace": step.namespace,
            "labels": self._labels(component, deployment),
            "chart": source,
            "revision": revision,
            "status": "pending-install" if first else "pending-upgrade",
        }
        releases[key] = entry
        self._write_ledger(releases)
        try:
            files = self._files(step, opened, loaded, revision=revision, first=first)
        except ApplyError:
            entry["status"] = "failed"
            self._write_ledger(releases)
            raise
        self._replace_dir(step.namespace, step.release_name, files, private=bool(opened.secrets))
        entry.update(status="deployed", install=first, files=_file_digests(files))
        self._write_ledger(releases)
        self._written[key] = _file_digests(files)

    def _repair(self, step: Step, deployment: DesiredDeployment | None,
                opened: Opened, granted: Granted) -> None:
        """Write a drifted release's files again: the same chart and values rendered at the
        same revision, as an install or upgrade as the ledger recorded, so the bytes are
        those written before. The ledger stays `deployed` throughout (the directory is
        replaced atomically); a failure leaves it and the drifted files as they were."""
        component, deployment = self._desired(step, deployment)
        source, loaded = self._fetch(component, deployment, granted)
        releases = self._read_ledger()
        entry = releases.get(f"{step.namespace}/{step.release_name}")
        if entry is None or entry.get("status") != "deployed" or entry.get("chart") != source:
            self._render(step, deployment, opened, granted)  # not what the plan saw: afresh
            return
        revision = int(entry.get("revision", 1))
        first = bool(entry.get("install", revision == 1))
        files = self._files(step, opened, loaded, revision=revision, first=first)
        self._replace_dir(step.namespace, step.release_name, files, private=bool(opened.secrets))
        entry.update(install=first, files=_file_digests(files))
        self._write_ledger(releases)
        self._written[f"{step.namespace}/{step.release_name}"] = _file_digests(files)

    @staticmethod
    def _desired(step: Step, deployment: DesiredDeployment | None,
                 ) -> tuple[DesiredComponent, DesiredDeployment]:
        if step.desired is None or deployment is None:
            raise ApplyError(ErrorCode.INVALID_STEP,
                             f"{step.action} of {step.release_name} needs the "
                             "desired component and its deployment", retryable=False)
        return step.desired, deployment

    def _fetch(self, component: DesiredComponent, deployment: DesiredDeployment,
               granted: Granted) -> tuple[dict[str, str], Any]:
        """Pull (with the deployment's grants) and check the chart (or Compose package)
        before anything is written: the ledger's description of it and the loaded chart or
        package."""
        if deployment.profile_type != "compose":
            chart = self.charts.load(self.charts.fetch(
                component.repository, component.revision, granted=granted.credentials))
            return {"name": chart.name, "version": chart.version}, chart
        if self.oci is None:
            raise ApplyError(ErrorCode.UNSUPPORTED_TYPE, "this render driver has no OCI client "
                             "for Compose packages", retryable=False)
        package = validate_package(self.oci.fetch_artifact(
            component.repository, component.revision, granted=granted.credentials))
        return {"name": package.top_directory, "version": component.revision,
                "digest": package.digest}, package

    def _files(self, step: Step, opened: Opened, loaded: Any, *, revision: int,
               first: bool) -> dict[str, bytes]:
        """The release's files from the component's values (sealed ones opened);
        `RENDER_FAILED` (not retryable) when the chart refuses the values or does not
        render."""
        try:
            if isinstance(loaded, helm.Chart):
                rendered = loaded.render(
                    dict(opened.values), name=step.release_name, namespace=step.namespace,
                    revision=revision, is_install=first, is_upgrade=not first)
                return _manifest_files(inject_files(rendered, self.injection)[0])
            return _compose_files(loaded, opened.values, self.injection)
        except (helm.HelmError, ValueError, yaml.YAMLError) as exc:
            raise ApplyError(ErrorCode.RENDER_FAILED, str(exc), retryable=False) from exc

    def _remove(self, step: Step) -> None:
        releases = self._read_ledger()
        key = f"{step.namespace}/{step.release_name}"
        if key in releases:
            releases[key]["status"] = "uninstalling"
            self._write_ledger(releases)
        self._clear_leftovers(step.namespace, step.release_name)
        target = self._release_dir(step.namespace, step.release_name)
        if target.exists():
            shutil.rmtree(target)
        with contextlib.suppress(OSError):
            target.parent.rmdir()  # the namespace directory, when it was the last release
        if releases.pop(key, None) is not None:
            self._write_ledger(releases)

    @staticmethod
    def _labels(component: DesiredComponent, deployment: DesiredDeployment) -> dict[str, str]:
        return ownership_labels(deployment.deployment_id, component.name,
                                desired_digest=deployment.digest,
                                spec_digest=component.spec_digest,
                                values_digest=component.values_digest)

    # --- drift -----------------------------------------------------------------------------

    def _checked(self, release: InstalledRelease, entry: Mapping[str, Any]) -> InstalledRelease:
        """A deployed release as its directory shows it. With drift checks off, only a
        vanished directory is noticed (unhealthy: rendered again); otherwise any file that
        differs from what the ledger recorded is drift, named for people."""
        directory = self._release_dir(release.namespace, release.release_name)
        if self.drift == "off":
            if directory.is_dir():
                return release
            return dataclasses.replace(release, state=ReleaseState.FAILED,
                                       detail="deployed (output directory missing)")
        if not directory.is_dir():
            drift = f"the rendered directory {release.namespace}/{release.release_name} " \
                    "is missing"
        else:
            recorded = entry.get("files")
            drift = "" if recorded is None else _files_drift(recorded, _on_disk(directory))
        return with_drift(release, drift, self.drift)

    # --- files -----------------------------------------------------------------------------

    def _release_dir(self, namespace: str, name: str) -> Path:
        return self.output_dir / namespace / name

    def _clear_leftovers(self, namespace: str, name: str) -> None:
        """Remove temporary directories a crash left behind for this release."""
        parent = self.output_dir / namespace
        if parent.is_dir():
            for leftover in parent.glob(f".{name}.*"):
                shutil.rmtree(leftover, ignore_errors=True)

    def _replace_dir(self, namespace: str, name: str, files: dict[str, bytes], *,
                     private: bool = False) -> None:
        """Write `files` as the release's directory (owner-only when `private`: they hold
        opened sealed values)."""
        target = self._release_dir(namespace, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._clear_leftovers(namespace, name)
        tag = uuid.uuid4().hex[:12]
        staging = target.parent / f".{name}.new-{tag}"
        folders = 0o700 if private else 0o777  # both less the umask
        staging.mkdir(mode=folders)
        for relative, data in files.items():
            path = staging / relative
            path.parent.mkdir(mode=folders, parents=True, exist_ok=True)
            if private:
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(descriptor, "wb") as handle:
                    handle.write(data)
            else:
                path.write_bytes(data)
        retired = target.parent / f".{name}.old-{tag}"
        if target.exists():
            target.rename(retired)
        staging.rename(target)
        shutil.rmtree(retired, ignore_errors=True)

    # --- ledger ----------------------------------------------------------------------------

    def _read_ledger(self) -> dict[str, dict[str, Any]]:
        try:
            data = self.ledger_path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE,
                             f"cannot read the render ledger {self.ledger_path}: {exc}") from exc
        try:
            document = json.loads(data)
            releases = document["releases"]
            if document.get("format") != _LEDGER_FORMAT or not isinstance(releases, dict) or \
                    not all(_valid_entry(v) and "/" in k for k, v in releases.items()):
                raise ValueError("unexpected structure")
        except (ValueError, TypeError, KeyError) as exc:
            raise ApplyError(ErrorCode.ENGINE_UNAVAILABLE,
                             f"the render ledger {self.ledger_path} is corrupt ({exc}); "
                             "repair or remove it to let the device reinstall") from exc
        return releases

    def _write_ledger(self, releases: dict[str, dict[str, Any]]) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        document = {"format": _LEDGER_FORMAT,
                    "releases": {key: releases[key] for key in sorted(releases)}}
        data = json.dumps(document, indent=2, sort_keys=True).encode("utf-8") + b"\n"
        write_atomically(self.ledger_path, data)
