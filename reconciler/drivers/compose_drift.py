"""What the Compose driver applied, and how a project has drifted from it since.

The engine's containers say what runs now, not what the driver brought up. So after every
successful `up` the driver writes a record next to the project's files,
`<work_dir>/<project>/margo-applied.json` (`APPLIED_FILE`): the ownership labels the
project was brought up with and, per service that got a container, the Compose
`config-hash` of its containers and whether it keeps running. The record is deleted
before each `up`, so a project whose last `up` failed or was interrupted has none and is
judged by its containers' health alone (a failure, applied again).

Drift, judged against a record whose labels the containers carry (`project_drift`):
- a service that had a container has none (removed out of band), or the whole project's
  containers are gone;
- a container stopped or killed: exited with 130, 137 or 143 (SIGINT, SIGKILL, SIGTERM),
  or with 0 from a service that keeps running;
- a container paused;
- a container whose `config-hash` is not the recorded one: recreated out of band from
  another configuration (an edited file or environment, `docker compose up` by hand).

A service keeps running when its container ran with a health check when the record was
written, or its Compose file says `restart: always` or `unless-stopped`, and no other
service waits for it with `depends_on: {condition: service_completed_successfully}`
(Compose's own sign of a one-shot job, which `up --wait` also uses). Any other service that
exits with 0 has finished its work; one that exits with another code failed by itself,
which is a failure (applied again), not drift.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from margo.files import write_atomically
from reconciler.drivers.compose_engine import (
    LABEL_CONFIG_HASH,
    LABEL_SERVICE,
    Container,
    by_project,
    ownership_of,
    project_release,
)
from reconciler.releases import InstalledRelease, ReleaseState, release_from_labels, with_drift

__all__ = ["APPLIED_FILE", "Applied", "applied_record", "one_shot_services", "project_drift",
           "read_applied", "releases_with_drift", "write_applied"]

APPLIED_FILE = "margo-applied.json"
_FORMAT = 1
#: Exit codes of a container stopped or killed by a signal (128 + SIGINT, SIGKILL, SIGTERM).
_STOPPED = (130, 137, 143)
_RESTARTED = ("always", "unless-stopped")


@dataclass(frozen=True)
class Applied:
    """One project as its last successful `up` left it: its ownership labels, each
    service's config-hash, and the services that keep running."""

    labels: Mapping[str, str]
    hashes: Mapping[str, str]
    keeps_running: frozenset[str]


def one_shot_services(compose: Mapping[str, Any]) -> frozenset[str]:
    """Services another service waits for with `condition: service_completed_successfully`
    in a Compose document: jobs that are meant to finish."""
    found: set[str] = set()
    for service in (compose.get("services") or {}).values():
        depends = service.get("depends_on") if isinstance(service, Mapping) else None
        if not isinstance(depends, Mapping):
            continue
        found.update(str(name) for name, how in depends.items() if isinstance(how, Mapping)
                     and how.get("condition") == "service_completed_successfully")
    return frozenset(found)


def _restarted(compose: Mapping[str, Any]) -> frozenset[str]:
    services = compose.get("services") or {}
    return frozenset(str(name) for name, service in services.items()
                     if isinstance(service, Mapping) and service.get("restart") in _RESTARTED)


def applied_record(containers: Iterable[Container], labels: Mapping[str, str],
                   compose: Mapping[str, Any]) -> Applied:
    """The record of a project just brought up: its containers as the engine lists them,
    the labels it was brought up with, and its Compose document (restart policies, jobs)."""
    ours = [c for c in containers if c.labels.get(LABEL_SERVICE)]
    hashes = {c.labels[LABEL_SERVICE]: c.labels.get(LABEL_CONFIG_HASH, "") for c in ours}
    checked = {c.labels[LABEL_SERVICE] for c in ours
               if c.state == "running" and "(health" in c.status}
    running = (checked | (_restarted(compose) & set(hashes))) - one_shot_services(compose)
    return Applied(dict(labels), dict(sorted(hashes.items())), frozenset(running))


def write_applied(path: Path, applied: Applied) -> None:
    document = {"format": _FORMAT, "labels": dict(sorted(applied.labels.items())),
                "services": {name: {"configHash": digest,
                                    "keepsRunning": name in applied.keeps_running}
                             for name, digest in applied.hashes.items()}}
    write_atomically(path, json.dumps(document, indent=2, sort_keys=True) + "\n")


def read_applied(path: Path) -> Applied | None:
    """The record at `path`; None when there is none. `ValueError` naming the file when it
    cannot be read or is not a record (`OSError` too, for an unreadable file)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        document = json.loads(data)
        labels, services = document["labels"], document["services"]
        if document.get("format") != _FORMAT or not isinstance(labels, dict) or \
                not isinstance(services, dict) or not all(
                    isinstance(s, dict) and isinstance(s.get("configHash"), str)
                    for s in services.values()):
            raise ValueError("unexpected structure")
        return Applied({str(k): str(v) for k, v in labels.items()},
                       {str(name): s["configHash"] for name, s in services.items()},
                       frozenset(str(name) for name, s in services.items()
                                 if s.get("keepsRunning") is True))
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path} is not a record of an applied project ({exc})") from exc


def _stopped(container: Container, keeps_running: bool) -> bool:
    code = container.exit_code
    return container.state == "exited" and (code in _STOPPED or (code == 0 and keeps_running))


def project_drift(containers: Iterable[Container], applied: Applied) -> tuple[str, set[str]]:
    """How the project's containers differ from the record: one sentence ("" if they do
    not) and the ids of the containers it names (they are drifted, not failing)."""
    containers = sorted(containers, key=lambda c: c.name)
    present = {c.labels.get(LABEL_SERVICE, "") for c in containers}
    found = [f"service {s} has no container" for s in sorted(set(applied.hashes) - present)]
    drifted: set[str] = set()
    for container in containers:
        service = container.labels.get(LABEL_SERVICE, "")
        expected = applied.hashes.get(service)
        if expected is None:
            continue  # not a service the record knows: `up --remove-orphans` decides
        if container.labels.get(LABEL_CONFIG_HASH, "") != expected:
            found.append(f"{container.name} was recreated from another configuration")
        elif container.state == "paused":
            found.append(f"{container.name} was paused")
        elif _stopped(container, service in applied.keeps_running):
            found.append(f"{container.name} was stopped (exited with code "
                         f"{container.exit_code})")
        else:
            continue
        drifted.add(container.id)
    return "; ".join(found), drifted


def _recorded(container: Container, record: Applied) -> bool:
    """Whether the container carries the ownership labels the record was written with."""
    return all(record.labels.get(k, "") == v for k, v in ownership_of(container).items())


def releases_with_drift(containers: Iterable[Container], records: Mapping[str, Applied],
                        policy: str) -> list[InstalledRelease]:
    """Like `compose_engine.releases_from_ps`, each project judged against its record (when
    its containers carry the record's labels): drift named and marked for `policy`, and a
    recorded project whose containers are all gone listed as deployed and drifted, instead
    of vanishing (which would make it a fresh install)."""
    grouped = by_project(containers)
    out: list[InstalledRelease] = []
    for project, found in grouped.items():
        record = records.get(project)
        judged = project_drift(found, record) if record is not None and all(
            _recorded(c, record) for c in found) else None
        release = project_release(project, found, judged=judged)
        out.append(with_drift(release, judged[0], policy) if judged and release.healthy
                   else release)
    for project, record in records.items():
        if project not in grouped:
            release = release_from_labels(record.labels, release_name=project, namespace="",
                                          state=ReleaseState.DEPLOYED, detail="no containers")
            if release.managed:
                out.append(with_drift(release, "every container of the project is gone",
                                      policy))
    return sorted(out, key=lambda r: r.release_name)
