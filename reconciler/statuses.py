"""DeploymentStatusManifest bodies and paths for the three API generations a server may speak.

Pure functions: the runner decides *what* each component's state is; this module only says how
each generation wants to hear it.

| generation | path | body |
|---|---|---|
| rc.3 | `POST /api/v1/deployments/{id}/status` | `adoptedManifestVersion` required |
| rc.2 | `POST /api/v1/clients/{clientId}/deployments/{id}/status` | `apiVersion` + `kind` |
| oct-2024 | `POST /device/{deviceId}/deployment/{id}/status` | capitalised states |

The overall state is the most severe component state. The spec's own order string is garbled
("failed > removing > installing > pending > removing > installed"); we read it as
failed > removing > installing > pending > removed > installed, so one component still being
removed keeps the deployment `removing`, and a finished removal only shows once every
component is gone. Error sources follow the spec: the deployment's `metadata.name` on the
overall error, the component's name on a component's error. Error codes are strings (the
official OpenAPI types them so).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from margo.kinds import GENERATIONS, Shape
from margo.models import DeploymentState

__all__ = ["ADOPTED_COMMIT", "ADOPTED_VERSION", "EXTENSION", "GENERATIONS", "OBSERVED_AT",
           "observed_now", "overall_state", "status_body", "status_path"]

STATUS_API_VERSION = "deployment.margo.org/v1alpha1"
STATUS_KIND = "DeploymentStatusManifest"

#: (name, state, error) where error is None, {"code", "message"} or (code, message).
ComponentReport = tuple[str, str, Mapping[str, Any] | Sequence[str] | None]


def _check_generation(generation: str) -> None:
    if generation not in GENERATIONS:
        raise ValueError(f"unknown API generation {generation!r} (expected one of "
                         f"{', '.join(GENERATIONS)})")


def overall_state(states: Sequence[str]) -> str:
    """The most severe of the component states (see the module docstring for the order)."""
    if not states:
        raise ValueError("a deployment status needs at least one component")
    known = {state.value for state in DeploymentState}
    unknown = [s for s in states if s not in known]
    if unknown:
        raise ValueError(f"unknown component state {unknown[0]!r} (expected one of "
                         f"{', '.join(s.value for s in DeploymentState)})")
    return str(max(states, key=lambda state: DeploymentState(state).severity))


def _spell(state: str, generation: str) -> str:
    """Oct-2024 capitalised its states (`Installed`); later generations use lower case."""
    return state.capitalize() if generation == Shape.OCT_2024 else state


def _error(error: Mapping[str, Any] | Sequence[str], source: str) -> dict[str, str]:
    if isinstance(error, Mapping):
        code, message = error.get("code", ""), error.get("message", "")
    else:
        code, message = error
    return {"code": str(code), "source": source, "message": str(message)}


def status_body(generation: str, *, deployment_id: str, device_id: str | None,
                adopted_version: int | None, components: Sequence[ComponentReport],
                deployment_name: str, observed_at: str | None = None,
                adopted_commit: str | None = None,
                extensions: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeploymentStatusManifest for one deployment, shaped for `generation`.

    `components` lists every component of the deployment once, in the deployment's order.
    The overall error is the first component error whose state is the overall state (for a
    failed deployment: the first failed component's code and message), with the deployment's
    name as its source. rc.3 requires `adopted_version` (the manifestVersion the device had
    adopted when this state arose).

    What the spec has no field for travels in our extension object,
    `x-margo-gitops-extensions`, in every generation: the spec lets any document carry
    `x-<name>-extensions` objects and obliges servers and clients to ignore (and never fail
    on) those they do not know.
    - `observedAt` (`observed_at`, RFC 3339 with an offset): when the device saw this state.
      A report may wait in the journal for days while the device is offline; with this the
      server's history shows when the state arose, next to when it arrived.
    - What the device had adopted when the state arose, so that the server can tell which
      bytes the report is about (docs/server.md, "What a device has adopted"):
      `adoptedManifestVersion` for rc.2 (rc.3 has a field of its own; Oct-2024 devices have
      no manifest), and `adoptedCommit` (`adopted_commit`) for a device that follows its
      Git branch.
    - `extensions`: further keys (what a drift repair restored, say)."""
    _check_generation(generation)
    overall = overall_state([state for _, state, _ in components])
    if generation == Shape.RC3 and adopted_version is None:
        raise ValueError("rc.3 status reports require the adopted manifestVersion")
    body: dict[str, Any] = {}
    if generation != Shape.RC3:
        body = {"apiVersion": STATUS_API_VERSION, "kind": STATUS_KIND}
    body["deploymentId"] = deployment_id
    if device_id is not None:
        body["deviceId"] = device_id
    if generation == Shape.RC3:
        body["adoptedManifestVersion"] = adopted_version
    status: dict[str, Any] = {"state": _spell(overall, generation)}
    cause = next((error for _, state, error in components
                  if state == overall and error is not None), None)
    if cause is not None:
        status["error"] = _error(cause, deployment_name)
    body["status"] = status
    entries = []
    for name, state, error in components:
        entry: dict[str, Any] = {"name": name, "state": _spell(state, generation)}
        if error is not None:
            entry["error"] = _error(error, name)
        entries.append(entry)
    body["components"] = entries
    extension = _extension(generation, observed_at=observed_at, adopted_version=adopted_version,
                           adopted_commit=adopted_commit, extensions=extensions)
    if extension:
        body[EXTENSION] = extension
    return body


def _extension(generation: str, *, observed_at: str | None, adopted_version: int | None,
               adopted_commit: str | None,
               extensions: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keys of our extension object a report carries (see `status_body`)."""
    extension: dict[str, Any] = {}
    if observed_at is not None:
        extension[OBSERVED_AT[1]] = observed_at
    if adopted_version is not None and generation == Shape.RC2:
        extension[ADOPTED_VERSION] = adopted_version
    if adopted_commit is not None:
        extension[ADOPTED_COMMIT] = adopted_commit
    extension.update(extensions or {})
    return extension


#: Our extension object in status reports, and the keys that say what the device had
#: adopted (the server reads them at the same place: `wfm.attribution`).
EXTENSION = "x-margo-gitops-extensions"
ADOPTED_VERSION = "adoptedManifestVersion"
ADOPTED_COMMIT = "adoptedCommit"


#: Where a status report carries the device's time of the state it reports (the server
#: reads it at the same place: `wfm.records.DEVICE_TIME`).
OBSERVED_AT = ("x-margo-gitops-extensions", "observedAt")


def observed_now() -> str:
    """The device's current time for `observed_at`: UTC, milliseconds, with its offset."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def status_path(generation: str, *, deployment_id: str, device_id: str | None,
                client_id: str | None) -> str:
    """Where `generation` wants status reports. Segments are percent-encoded; a device id
    keeps its `/` (gateway hierarchy), which the Oct-2024 route matches as a path."""
    _check_generation(generation)
    deployment = quote(deployment_id, safe="")
    if generation == Shape.RC3:
        return f"/api/v1/deployments/{deployment}/status"
    if generation == Shape.RC2:
        if not client_id:
            raise ValueError("rc.2 status paths need the clientId from onboarding")
        return f"/api/v1/clients/{quote(client_id, safe='')}/deployments/{deployment}/status"
    if not device_id:
        raise ValueError("Oct-2024 status paths need the device id")
    return f"/device/{quote(device_id, safe='/')}/deployment/{deployment}/status"
