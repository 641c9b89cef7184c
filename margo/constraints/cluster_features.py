"""The cluster feature dialects: `cluster.apiGroups` (served API groups, at a version if
given), `cluster.customResourceDefinitions` (installed CRDs, by plural.group or Kind.group)
and `cluster.defaultStorageClass` (some default, or a named one); compiled and checked here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from margo.constraints.cluster_report import NO_CLUSTER, cluster_failure, section, unknown_note
from margo.constraints.pointers import cluster_of, member
from margo.constraints.problems import ProblemCollector
from margo.constraints.results import Failure
from margo.constraints.vocabulary import MISSING
from margo.errors import Path

__all__ = ["ApiGroupsRequirement", "CrdRequirement", "StorageClassRequirement",
           "compile_api_groups", "compile_crds", "compile_storage_class"]

_VERSION_TEXT = r"v[0-9]+(?:(?:alpha|beta)[0-9]+)?"
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_API_VERSION = re.compile(_VERSION_TEXT)
_API_GROUP = re.compile(rf"({_DNS_LABEL}(?:\.{_DNS_LABEL})*)(?:/({_VERSION_TEXT}))?")
_CRD_NAME = re.compile(rf"([A-Za-z][A-Za-z0-9]*)\.({_DNS_LABEL}(?:\.{_DNS_LABEL})+)")


def _serves(groups: list[Any] | tuple[Any, ...], group: str, version: str | None) -> bool:
    for entry in groups:
        if member(entry, "name") == group:
            versions = member(entry, "versions")
            if version is None or (isinstance(versions, list | tuple) and version in versions):
                return True
    return False


@dataclass(frozen=True, slots=True)
class ApiGroupsRequirement:
    """Every listed API group (at the listed version, if one is given) is served."""

    stage: str
    entries: tuple[tuple[str, str, str | None], ...]  # (as written, group, version or None)

    @staticmethod
    def _served(properties: Mapping[str, Any]) -> dict[str, list[Any]] | None:
        cluster = cluster_of(properties)
        groups = MISSING if cluster is None else section(cluster, "apiSurface", "apiGroups")
        if not isinstance(groups, list | tuple):
            return None
        served: dict[str, list[Any]] = {}
        for group in groups:
            if isinstance(group, Mapping) and isinstance(group.get("name"), str):
                versions = group.get("versions")
                served.setdefault(group["name"], []).extend(
                    versions if isinstance(versions, list | tuple) else [])
        return served

    def _missing(self, served: dict[str, list[Any]]) -> list[str]:
        missing = []
        for text, group, version in self.entries:
            if group not in served:
                missing.append(f"{text} (group not served)")
            elif version is not None and version not in served[group]:
                missing.append(f"{text} (served: {', '.join(map(str, served[group])) or 'none'})")
        return missing

    def passes(self, properties: Mapping[str, Any]) -> bool:
        cluster = cluster_of(properties)
        groups = MISSING if cluster is None else section(cluster, "apiSurface", "apiGroups")
        if not isinstance(groups, list | tuple):
            return False
        return all(_serves(groups, group, version) for _, group, version in self.entries)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        served = self._served(properties)
        required = [text for text, _, _ in self.entries]
        needs = f"needs API {'group' if len(required) == 1 else 'groups'} {', '.join(required)}"
        cluster = cluster_of(properties)
        if cluster is None:
            message = f"{needs}, but {NO_CLUSTER}"
        elif served is None:
            message = (f"{needs}, but the cluster reported no API groups"
                       f"{unknown_note(cluster, 'apiGroups', 'api groups', 'discovery')}")
        else:
            missing = self._missing(served)
            if not missing:
                return []
            message = f"{needs}, but the cluster lacks {'; '.join(missing)}"
        return cluster_failure(self.stage, "apiGroups", "ContainsAll", required,
                                None if served is None else sorted(served), message)


def _crd_matches(entry: Mapping[str, Any], text: str, resource: str, group: str) -> bool:
    """`plural.group` or `Kind.group` against a reported CRD. The proposal reports kinds, not
    plurals, so a plural is recognised as the lower-cased kind plus s / es / y->ies (or an
    explicit `name`/`plural` field when the reporter adds one)."""
    if entry.get("group") != group:
        return False
    if entry.get("name") == text or entry.get("plural") == resource:
        return True
    kind = entry.get("kind")
    if not isinstance(kind, str) or not kind:
        return False
    if resource[0].isupper():
        return kind == resource
    lower = kind.lower()
    plurals = {lower, lower + "s", lower + "es"}
    if lower.endswith("y"):
        plurals.add(lower[:-1] + "ies")
    return resource in plurals


@dataclass(frozen=True, slots=True)
class CrdRequirement:
    """Every listed CustomResourceDefinition is installed."""

    stage: str
    entries: tuple[tuple[str, str, str], ...]  # (as written, plural or Kind, group)

    @staticmethod
    def _reported(properties: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
        cluster = cluster_of(properties)
        crds = (MISSING if cluster is None
                else section(cluster, "apiSurface", "customResourceDefinitions"))
        if not isinstance(crds, list | tuple):
            return None
        return [crd for crd in crds if isinstance(crd, Mapping)]

    def _missing(self, crds: list[Mapping[str, Any]]) -> list[tuple[str, str]]:
        return [(text, group) for text, resource, group in self.entries
                if not any(_crd_matches(crd, text, resource, group) for crd in crds)]

    def passes(self, properties: Mapping[str, Any]) -> bool:
        crds = self._reported(properties)
        return crds is not None and not self._missing(crds)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        crds = self._reported(properties)
        required = [text for text, _, _ in self.entries]
        needs = f"needs {'CRD' if len(required) == 1 else 'CRDs'} {', '.join(required)}"
        cluster = cluster_of(properties)
        if cluster is None:
            message = f"{needs}, but {NO_CLUSTER}"
        elif crds is None:
            note = unknown_note(cluster, "customResourceDefinitions", "crd")
            message = f"{needs}, but the cluster reported no CRDs{note}"
        else:
            missing = self._missing(crds)
            if not missing:
                return []
            details = []
            for text, group in missing:
                kinds = sorted({str(c.get("kind")) for c in crds if c.get("group") == group})
                details.append(f"{text} (group {group} has {', '.join(kinds)})" if kinds
                               else f"{text} (no CRD of group {group})")
            message = f"{needs}, but the cluster lacks {'; '.join(details)}"
        actual = None if crds is None else [f"{c.get('kind')}.{c.get('group')}" for c in crds]
        return cluster_failure(self.stage, "customResourceDefinitions", "ContainsAll", required,
                                actual, message)


@dataclass(frozen=True, slots=True)
class StorageClassRequirement:
    """The cluster has a default StorageClass (`name` None), or `name` is the default."""

    stage: str
    name: str | None

    @staticmethod
    def _classes(properties: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
        cluster = cluster_of(properties)
        classes = MISSING if cluster is None else section(cluster, "capabilities",
                                                            "storageClasses")
        if not isinstance(classes, list | tuple):
            return None
        return [c for c in classes if isinstance(c, Mapping)]

    def _ok(self, classes: list[Mapping[str, Any]]) -> bool:
        return any(c.get("isDefault") is True and (self.name is None or c.get("name") == self.name)
                   for c in classes)

    def passes(self, properties: Mapping[str, Any]) -> bool:
        classes = self._classes(properties)
        return classes is not None and self._ok(classes)

    def explain(self, properties: Mapping[str, Any]) -> list[Failure]:
        classes = self._classes(properties)
        needs = ("needs a default storage class" if self.name is None
                 else f"needs {self.name!r} as the default storage class")
        cluster = cluster_of(properties)
        defaults = [str(c.get("name")) for c in classes or () if c.get("isDefault") is True]
        if cluster is None:
            message = f"{needs}, but {NO_CLUSTER}"
        elif classes is None:
            note = unknown_note(cluster, "storageClasses", "storage")
            message = f"{needs}, but the cluster reported no storage classes{note}"
        elif self._ok(classes):
            return []
        elif defaults:
            message = f"{needs}, but the default is {', '.join(map(repr, defaults))}"
        else:
            names = ", ".join(repr(str(c.get("name"))) for c in classes) or "none"
            message = f"{needs}, but no storage class is the default (classes: {names})"
        return cluster_failure(self.stage, "defaultStorageClass", "In",
                                True if self.name is None else self.name, defaults or None,
                                message)


# --------------------------------------------------------------------------- compilation


def compile_api_groups(log: ProblemCollector, value: Any,
                       path: Path) -> ApiGroupsRequirement | None:
    """`group` or `group/version`; a bare version (`v1`) is the core group."""
    before = len(log.problems)
    example = "e.g. [networking.k8s.io, monitoring.coreos.com/v1, v1]"
    entries: list[tuple[str, str, str | None]] = []
    for i, text in log.string_list(value, path, "apiGroups", example):
        if _API_VERSION.fullmatch(text):
            entries.append((text, "", text))
            continue
        found = _API_GROUP.fullmatch(text)
        if found is None:
            log.problem((*path, i), f"{text!r} is not an API group[/version]",
                        expected=example, found=text)
        else:
            entries.append((text, found[1], found[2]))
    return None if len(log.problems) != before else ApiGroupsRequirement(
        "cluster", tuple(entries))


def compile_crds(log: ProblemCollector, value: Any, path: Path) -> CrdRequirement | None:
    """`customResourceDefinitions`: plural.group or Kind.group names."""
    before = len(log.problems)
    example = "e.g. [servicemonitors.monitoring.coreos.com] (plural.group or Kind.group)"
    entries: list[tuple[str, str, str]] = []
    for i, text in log.string_list(value, path, "customResourceDefinitions", example):
        found = _CRD_NAME.fullmatch(text)
        if found is None:
            log.problem((*path, i), f"{text!r} is not a CRD name (plural.group)",
                        expected=example, found=text)
        else:
            entries.append((text, found[1], found[2]))
    return None if len(log.problems) != before else CrdRequirement("cluster", tuple(entries))


def compile_storage_class(log: ProblemCollector, value: Any,
                          path: Path) -> StorageClassRequirement | None:
    """`defaultStorageClass`: true (some default) or the name the default must have."""
    if value is True:
        return StorageClassRequirement("cluster", None)
    if isinstance(value, str) and value:
        return StorageClassRequirement("cluster", value)
    log.problem(path, "defaultStorageClass is true (some default) or a class name",
                expected="true or a storage class name", found=value)
    return None
