"""Desired state from the device's own Git repository (the GitOps transport).

The fleet server serves each device one repository whose `HEAD` points at the device's
branch; the device does not know the server's branch naming, so it follows `HEAD`. The
branch tip's root-level `*.yaml` / `*.yml` files are the ApplicationDeployments.

Polling is what a device does all day, so an unchanged poll must cost as little as
possible. Measured against `margo serve`: a shallow fetch always negotiates (two
upload-pack POSTs after the ref advertisement, about 120 ms even when nothing changed),
while reading the ref advertisement alone is one GET (about 20 ms with the Basic-auth
challenge). So `fetch` first reads the advertisement; only a tip it does not hold locally
is fetched, shallowly (depth 1), into a local ref. Trees and blobs are then read straight
from the bare repository: there is no work tree.

The bare repository in `cache_dir` is a cache and nothing more: the runner keeps the adopted
documents itself. libgit2 writes packs and refs crash-safely (a pack is renamed into place
once indexed), an unreadable cache is rebuilt, and since every changed fetch adds a pack,
the cache is rebuilt from scratch once it holds `MAX_PACKS` packs (a depth-1 fetch of one
device's state is a few kilobytes).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pygit2

from margo.errors import DocumentError
from reconciler.desired import (
    DesiredDeployment,
    DesiredState,
    index_deployments,
    parse_deployment,
)
from reconciler.errors import ErrorCode
from reconciler.sources import Adopted, IntegrityError, SourceError

__all__ = ["LOCAL_REF", "MAX_PACKS", "NO_BRANCH_VERSION", "GitSource"]

#: Where the fetched tip is kept in the cache repository.
LOCAL_REF = "refs/margo-gitops/desired"
#: The `version` of the empty state a device gets while its repository has no branch yet.
NO_BRANCH_VERSION = "no-branch"
#: Packs the cache may accumulate before it is rebuilt.
MAX_PACKS = 64

_T = TypeVar("_T")
_HTTP_STATUS = re.compile(r"http status code: (\d{3})")
_YAML_SUFFIXES = (".yaml", ".yml")
_REGULAR_FILES = frozenset({pygit2.enums.FileMode.BLOB, pygit2.enums.FileMode.BLOB_EXECUTABLE})
_UNREACHABLE_HINTS = ("failed to connect", "failed to resolve", "connection refused",
                      "timed out", "timeout", "could not resolve", "connection reset",
                      "early eof", "unexpected eof", "network is unreachable")


class _CredentialsRejected(Exception):
    """Raised from the credentials callback when the server refuses what we already sent:
    asking again with the same answer would only loop (libgit2 gives up after 15 replays)."""


class _Callbacks(pygit2.RemoteCallbacks):
    """Basic-auth credentials, offered once per operation."""

    def __init__(self, username: str | None, password: str | None) -> None:
        super().__init__()
        self._username, self._password = username, password
        self._offered = False

    def credentials(self, url: str, username_from_url: str | None,
                    allowed_types: pygit2.enums.CredentialType) -> pygit2.UserPass:
        if self._username is None or self._password is None or self._offered:
            raise _CredentialsRejected(url)
        self._offered = True
        return pygit2.UserPass(self._username, self._password)


class GitSource:
    """The device's repository at `url` as a `Source` (see the module docstring).

    `depth` is the history fetched per change (1: the tip only; None: everything, which
    libgit2 needs for local-path remotes since it cannot fetch shallowly from them).
    """

    name = "git"

    def __init__(self, url: str, *, cache_dir: Path, username: str | None = None,
                 password: str | None = None, depth: int | None = 1) -> None:
        self._url = url
        self._cache_dir = Path(cache_dir)
        self._username, self._password = username, password
        self._depth = depth
        self._repo: pygit2.Repository | None = None

    # --- the Source protocol -----------------------------------------------------------------

    def fetch(self, adopted: Adopted) -> DesiredState | None:
        """The new desired state, or None when the branch tip is the adopted commit.

        A repository without a branch (the server has compiled nothing for the device yet)
        is an empty desired state only for a device that never had one; a device that had
        state keeps it (`SourceError("NO_BRANCH")`, retryable) rather than removing every
        workload because the branch went missing. `margo serve` answers 404 for a device
        without a branch, and also for a path that names no device, so a mistyped URL looks
        like "nothing compiled yet" to a new device; it never removes anything."""
        tip = self._advertised_tip()
        if tip is None:
            if adopted.version is None:
                return DesiredState(source=self.name, version=NO_BRANCH_VERSION,
                                    manifest_version=None, etag=None, deployments=())
            if adopted.version == NO_BRANCH_VERSION:
                return None
            raise SourceError(ErrorCode.NO_BRANCH, "the repository lost its branch; keeping the "
                              "previous state")
        if tip == adopted.version:
            return None
        commit = self._local_commit(tip) or self._fetch_tip()
        if str(commit.id) == adopted.version:
            return None
        return DesiredState(source=self.name, version=str(commit.id), manifest_version=None,
                            etag=None, deployments=_deployments(commit))

    def close(self) -> None:
        if self._repo is not None:
            self._repo.free()
            self._repo = None

    def __enter__(self) -> GitSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- remote ------------------------------------------------------------------------------

    def _advertised_tip(self) -> str | None:
        """The commit the remote's HEAD names (one ref advertisement), None without one."""
        remote = self._repository().remotes.create_anonymous(self._url)
        heads = self._call(lambda callbacks: remote.list_heads(callbacks=callbacks))
        if heads is None:
            return None
        head = next((h for h in heads if h.name == "HEAD"), None)
        return None if head is None or not any(head.oid.raw) else str(head.oid)

    def _fetch_tip(self) -> pygit2.Commit:
        """Fetch HEAD (shallowly unless `depth` is None) into `LOCAL_REF` and return it."""
        repo = self._repository()
        if _pack_count(self._cache_dir) >= MAX_PACKS:
            repo = self._rebuild()
        remote = repo.remotes.create_anonymous(self._url)
        depth = self._depth or 0
        fetched = self._call(lambda callbacks: remote.fetch(
            [f"+HEAD:{LOCAL_REF}"], callbacks=callbacks, depth=depth))
        if fetched is None:
            raise SourceError(ErrorCode.NO_BRANCH, "the repository's branch disappeared while "
                              "fetching; keeping the previous state")
        try:
            commit = repo.revparse_single(LOCAL_REF).peel(pygit2.Commit)
        except (KeyError, pygit2.GitError, ValueError) as exc:
            raise SourceError(ErrorCode.GIT_ERROR, f"{self._url}: HEAD did not give a commit: "
                              f"{exc}") from None
        return commit

    def _call(self, operation: Callable[[pygit2.RemoteCallbacks], _T]) -> _T | None:
        """Run one network operation; None when the server has no branch for the device
        (it answers 404 once the credentials are accepted); every failure a `SourceError`."""
        try:
            return operation(_Callbacks(self._username, self._password))
        except (_CredentialsRejected, pygit2.AuthError):
            raise SourceError(ErrorCode.UNAUTHORIZED, f"{self._url}: the server refused the "
                              "credentials", retryable=False) from None
        except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
            error = _classify(self._url, exc)
            if error is None:
                return None
            raise error from None

    # --- cache -------------------------------------------------------------------------------

    def _repository(self) -> pygit2.Repository:
        if self._repo is None:
            self._repo = self._open_or_create()
        return self._repo

    def _open_or_create(self) -> pygit2.Repository:
        if (self._cache_dir / "HEAD").exists():
            try:
                return pygit2.Repository(str(self._cache_dir))
            except pygit2.GitError:
                return self._rebuild()
        self._cache_dir.mkdir(parents=True, exist_ok=True)
        return pygit2.init_repository(str(self._cache_dir), bare=True)

    def _rebuild(self) -> pygit2.Repository:
        """Start the cache over: it only ever held copies of what the server has."""
        if self._repo is not None:
            self._repo.free()
            self._repo = None
        shutil.rmtree(self._cache_dir, ignore_errors=True)
        self._cache_dir.mkdir(parents=True, exist_ok=True)
        self._repo = pygit2.init_repository(str(self._cache_dir), bare=True)
        return self._repo

    def _local_commit(self, oid: str) -> pygit2.Commit | None:
        """The commit if the cache already holds it with its tree (fetched earlier but not
        adopted, e.g. because applying it failed): no need to fetch it again."""
        repo = self._repository()
        try:
            commit = repo.get(oid)
            if not isinstance(commit, pygit2.Commit):
                return None
            _ = commit.tree.id
        except (KeyError, ValueError, pygit2.GitError):
            return None
        return commit


def _classify(url: str, exc: Exception) -> SourceError | None:
    """libgit2 reports HTTP outcomes only as text (`unexpected http status code: 404`)."""
    text = str(exc)
    lowered = text.lower()
    status = _HTTP_STATUS.search(lowered)
    if status is not None and status.group(1) == "404":
        return None
    if "authentication replays" in lowered or (status is not None
                                               and status.group(1) == "401"):
        return SourceError(ErrorCode.UNAUTHORIZED, f"{url}: {text}", retryable=False)
    if status is not None and status.group(1) == "403":
        return SourceError(ErrorCode.FORBIDDEN, f"{url}: {text}", retryable=False)
    if status is not None:
        return SourceError(f"HTTP_{status.group(1)}", f"{url}: {text}")
    if any(hint in lowered for hint in _UNREACHABLE_HINTS):
        return SourceError(ErrorCode.UNREACHABLE, f"{url}: {text}")
    return SourceError(ErrorCode.GIT_ERROR, f"{url}: {type(exc).__name__}: {text}")


def _pack_count(cache_dir: Path) -> int:
    return sum(1 for _ in (cache_dir / "objects" / "pack").glob("*.pack"))


def _deployments(commit: pygit2.Commit) -> tuple[DesiredDeployment, ...]:
    """Every root-level YAML blob of the commit, parsed; any invalid one fails the whole
    state (a partial state would remove the deployments of the unreadable files)."""
    short = str(commit.id)[:12]
    parsed = []
    for entry in sorted(commit.tree, key=lambda e: e.name or ""):
        name = entry.name or ""
        if not isinstance(entry, pygit2.Blob) or entry.filemode not in _REGULAR_FILES:
            continue  # directories, symbolic links and submodules are not documents
        if not name.endswith(_YAML_SUFFIXES):
            continue
        file = f"{name}@{short}"
        try:
            parsed.append(parse_deployment(entry.data, file=file))
        except DocumentError as exc:
            raise IntegrityError(ErrorCode.INVALID_DOCUMENT, f"{file} is not a valid "
                                 f"ApplicationDeployment:\n{exc}") from None
        except ValueError as exc:
            raise IntegrityError(ErrorCode.INVALID_DOCUMENT, str(exc)) from None
    try:
        index_deployments(parsed)
    except ValueError as exc:
        raise IntegrityError(ErrorCode.INVALID_DOCUMENT, f"commit {short}: {exc}") from None
    return tuple(parsed)
