"""The fleet source: application descriptors and deployment intents, from a directory or Git.

Layout (see `docs/intents.md`):

    apps/<app-id>/margo.yaml               one ApplicationDescription (any spec shape);
    apps/<app-id>/<anything>/margo.yaml    further versions of the same application
    deployments/<intent-name>.yaml         one DeploymentIntent each

Everything else (chart directories, READMEs) is ignored. A broken file never stops the
load: it becomes a located problem, and the compiler keeps the previous state of whatever
that file governs (the intent named by the file, or every intent of the application named
by the directory).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import cast

import pygit2

from compiler.intents import Intent, load_intent
from margo.errors import DocumentError, Problem
from margo.kinds import Kind
from margo.loading import load_document
from margo.models import ApplicationDescription
from margo.validation import validate_loaded

__all__ = ["AppVersion", "FleetSource", "SourceError", "load_source"]

_NATURAL = re.compile(r"(\d+)")


class SourceError(RuntimeError):
    """The source as a whole cannot be read (missing directory, unknown Git ref)."""


@dataclass(frozen=True, slots=True)
class AppVersion:
    description: ApplicationDescription
    digest: str
    file: str


@dataclass
class FleetSource:
    revision: str
    applications: dict[str, dict[str, AppVersion]] = field(default_factory=dict)
    intents: dict[str, Intent] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    broken_intents: set[str] = field(default_factory=set)
    broken_apps: set[str] = field(default_factory=set)

    def application(self, app_id: str, version: str | None) -> AppVersion | None:
        """A version of an application; without a version, the newest (natural order)."""
        versions = self.applications.get(app_id, {})
        if version is not None:
            return versions.get(version)
        if not versions:
            return None
        return versions[max(versions, key=_version_key)]


def _version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Natural order: 1.10 > 1.9, 2.0.0 > 2.0.0-rc.1 (a pre-release sorts first)."""
    core, _, pre = version.partition("-")
    parts = tuple((0, int(p)) if p.isdigit() else (1, p) for p in _NATURAL.split(core) if p)
    return (*parts, (1, "") if not pre else (0, pre))


def _directory_files(root: Path) -> Iterator[tuple[str, bytes]]:
    for top in ("apps", "deployments"):
        base = root / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                rel = path.relative_to(root).as_posix()
                if _is_source_file(rel):
                    yield rel, path.read_bytes()


def _git_files(repo_path: Path, ref: str) -> tuple[str, Iterator[tuple[str, bytes]]]:
    try:
        repo = pygit2.Repository(str(repo_path))
        commit = repo.revparse_single(ref).peel(pygit2.Commit)
    except (pygit2.GitError, KeyError, ValueError) as exc:
        raise SourceError(f"{repo_path}: cannot resolve {ref!r}: {exc}") from None

    def walk(tree: pygit2.Tree, prefix: str) -> Iterator[tuple[str, bytes]]:
        for entry in sorted(tree, key=lambda e: e.name or ""):  # a tree entry has a name
            rel = f"{prefix}{entry.name}"
            if entry.type_str == "tree":
                yield from walk(cast(pygit2.Tree, repo[entry.id]), rel + "/")
            elif entry.type_str == "blob" and _is_source_file(rel):
                yield rel, cast(pygit2.Blob, repo[entry.id]).data

    def files() -> Iterator[tuple[str, bytes]]:
        for top in ("apps", "deployments"):
            if top in commit.tree:
                yield from walk(cast(pygit2.Tree, repo[commit.tree[top].id]), top + "/")

    return f"git:{commit.id}", files()


def _is_source_file(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    if parts[0] == "apps":
        return len(parts) >= 3 and parts[-1] == "margo.yaml"
    return len(parts) == 2 and parts[1].endswith((".yaml", ".yml"))


def _content_revision(files: list[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for rel, data in files:
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    return "sha256:" + digest.hexdigest()


def _add_application(source: FleetSource, rel: str, data: bytes) -> None:
    app_dir = PurePosixPath(rel).parts[1]
    found = _application(rel, data)
    if not isinstance(found, AppVersion):
        source.problems.extend(found)
        source.broken_apps.add(app_dir)
        return
    versions = source.applications.setdefault(app_dir, {})
    version = found.description.version
    if version in versions:
        source.problems.append(Problem(("metadata", "version"), f"version {version!r} of "
                                       f"{app_dir} is also defined in {versions[version].file}",
                                       file=rel))
        source.broken_apps.add(app_dir)
        return
    versions[version] = found


# A process that compiles again and again (the fleet server, ``margo compile --watch``)
# parses and validates only the files whose bytes changed: what one file gives is a pure
# function of its path and bytes, and parsing with positions and validating cost ~0.8 ms
# per file (40 ms of every recompile of a 50-file source, where one intent had changed).
# The results are frozen dataclasses, shared by the compiles that read the same bytes.
_PARSED_FILES = 4096


@functools.lru_cache(maxsize=_PARSED_FILES)
def _application(rel: str, data: bytes) -> AppVersion | tuple[Problem, ...]:
    """The application version a ``margo.yaml`` file defines, or its problems."""
    app_dir = PurePosixPath(rel).parts[1]
    try:
        loaded = load_document(data, file=rel)
    except DocumentError as exc:
        return tuple(exc.problems)
    report = validate_loaded(loaded, expect=Kind.APPLICATION_DESCRIPTION)
    if not report.valid:
        return tuple(report.problems)
    description: ApplicationDescription = report.model
    if description.id != app_dir:
        return (Problem(("id",), f"the application in apps/{app_dir}/ must have id "
                        f"{app_dir!r}", file=rel, expected=app_dir, found=description.id),)
    return AppVersion(description, "sha256:" + hashlib.sha256(data).hexdigest(), rel)


@functools.lru_cache(maxsize=_PARSED_FILES)
def _intent(rel: str, data: bytes) -> Intent | tuple[Problem, ...]:
    """The intent a ``deployments/*.yaml`` file defines, or its problems."""
    try:
        return load_intent(load_document(data, file=rel), expected_name=PurePosixPath(rel).stem)
    except DocumentError as exc:
        return tuple(exc.problems)


def _add_intent(source: FleetSource, rel: str, data: bytes) -> None:
    name = PurePosixPath(rel).stem
    found = _intent(rel, data)
    if not isinstance(found, Intent):
        source.problems.extend(found)
        source.broken_intents.add(name)
        return
    if name in source.intents:
        source.problems.append(Problem((), f"intent {name!r} is defined twice "
                                       f"({source.intents[name].file} and {rel})", file=rel))
        source.broken_intents.add(name)
        return
    source.intents[name] = found


def load_source(path: str | os.PathLike[str], *, ref: str | None = None) -> FleetSource:
    """Load a fleet source directory, or a Git repository at `ref` (bare repos: HEAD)."""
    root = Path(path)
    if not root.exists():
        raise SourceError(f"{root}: no such fleet source")
    is_bare_git = (root / "HEAD").is_file() and (root / "objects").is_dir()
    if ref is not None or is_bare_git:
        revision, files_iter = _git_files(root, ref or "HEAD")
        files = list(files_iter)
    else:
        if not root.is_dir():
            raise SourceError(f"{root}: a fleet source is a directory or a Git repository")
        files = list(_directory_files(root))
        revision = _content_revision(files)
    source = FleetSource(revision=revision)
    for rel, data in files:
        if rel.startswith("apps/"):
            _add_application(source, rel, data)
        else:
            _add_intent(source, rel, data)
    return source
