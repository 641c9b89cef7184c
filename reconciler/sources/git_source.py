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

Rollback protection. The REST source refuses a manifestVersion that does not grow; the
Git equivalent is a tip that does not descend from the commit the device adopted last (a
branch moved back, or history rewritten): such a tip is refused (`IntegrityError`,
`ROLLBACK`) and the adopted state kept. Proving descent needs history, which a shallow cache
lacks, so the walk reads each commit's raw `parent` lines (libgit2 hides a shallow commit's
parents) and deepens the fetch (8, 64, 512 commits, then the whole branch) only while the
adopted commit is neither found nor ruled out. A device that adopts every change finds its
adopted commit as the new tip's parent, with no extra fetch; a rewound tip that the cache
knows to be an ancestor of the adopted commit is refused with none either. An operator who
rewound the branch on purpose names the new tip in `accept_history_rewrite`
(`source.acceptHistoryRewrite`): a tip that is, or descends from, that commit is accepted
once, and the device's state records the override as spent (`Adopted.history_rewrite_accepted`)
so the same setting never lets a later rollback through.

Several URLs. The same repository may be reachable through several servers (replicas of the
fleet server: `server.fallbackUrls`, or `source.fallbackUrls`). Every network operation goes
to the URL in use and moves on to the next when that one gives no answer (unreachable, timed
out, or HTTP 502/503/504, as `reconciler.failover` says), staying on the one that answered
(`reconciler.failover.ServerList`, which the HTTP client shares when the URLs follow the
server's). Rollback protection holds whichever URL answers: a tip from any of them must
descend from the adopted commit.

Waiting polls. With `waiting` (`reconciler.sources.waiting`) and HTTP(S) URLs, the loop's
polls read the ref advertisement themselves (`reconciler.sources.git_refs`): conditional on
what they read last, and held by the fleet server until the branch moves; libgit2 then
fetches only a tip that moved.

The bare repository in `cache_dir` is a cache and nothing more: the runner keeps the adopted
documents itself. libgit2 writes packs and refs crash-safely (a pack is renamed into place
once indexed) and checks every object's hash when it reads it, so a damaged cache (an
unreadable repository, or objects that no longer match their ids) is rebuilt and fetched
again; and since every changed fetch adds a pack, the cache is rebuilt from scratch once it
holds `MAX_PACKS` packs (a depth-1 fetch of one device's state is a few kilobytes).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable, Sequence
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
from reconciler.failover import ServerList
from reconciler.sources import Adopted, IntegrityError, SourceError
from reconciler.sources.git_refs import RefProbe, RefsStatus, Unusable
from reconciler.sources.waiting import Interrupted, WaitingPolls

__all__ = ["COMMIT_ID", "LOCAL_REF", "MAX_PACKS", "NO_BRANCH_VERSION", "GitSource"]

log = logging.getLogger("margo.device")

#: Where the fetched tip is kept in the cache repository.
LOCAL_REF = "refs/margo-gitops/desired"
#: The `version` of the empty state a device gets while its repository has no branch yet.
NO_BRANCH_VERSION = "no-branch"
#: Packs the cache may accumulate before it is rebuilt.
MAX_PACKS = 64
#: A full commit id (SHA-1, or SHA-256 for repositories that use it), as `version` holds it.
COMMIT_ID = re.compile(r"^[0-9a-f]{40}(?:[0-9a-f]{24})?\Z")
#: Shallow depths tried in turn while proving that a tip descends from the adopted commit;
#: past the last, the whole branch is fetched (libgit2's GIT_FETCH_DEPTH_UNSHALLOW).
_DEEPEN = (8, 64, 512)
_UNSHALLOW = 2**31 - 1

_T = TypeVar("_T")
_HTTP_STATUS = re.compile(r"http status code: (\d{3})")
_YAML_SUFFIXES = (".yaml", ".yml")
_REGULAR_FILES = frozenset({pygit2.enums.FileMode.BLOB, pygit2.enums.FileMode.BLOB_EXECUTABLE})
#: Outcomes after which the next URL is tried (module docstring, "Several URLs").
_NO_ANSWER = frozenset({ErrorCode.UNREACHABLE, "HTTP_502", "HTTP_503", "HTTP_504"})
_UNREACHABLE_HINTS = ("failed to connect", "failed to resolve", "connection refused",
                      "timed out", "timeout", "could not resolve", "connection reset",
                      "early eof", "unexpected eof", "network is unreachable")


class _CredentialsRejected(Exception):
    """Raised from the credentials callback when the server refuses what we already sent:
    asking again with the same answer would only loop (libgit2 gives up after 15 replays)."""


class _BranchMoved(SourceError):
    """The branch moved while the history of the tip being checked was fetched: nothing is
    wrong with the cache, the next cycle checks the new tip."""


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
    `fallback_urls` are the same repository through other servers, tried in turn with the
    choice kept in `servers` (one entry per URL; a list of its own when not given).
    `waiting`: the loop's waiting polls, over HTTP(S) URLs (module docstring); `timeout`:
    what one request of those may take, besides its wait.
    """

    name = "git"

    def __init__(self, url: str, *, cache_dir: Path, username: str | None = None,
                 password: str | None = None, depth: int | None = 1,
                 accept_history_rewrite: str | None = None,
                 fallback_urls: Sequence[str] = (),
                 servers: ServerList | None = None, waiting: WaitingPolls | None = None,
                 timeout: float = 30.0) -> None:
        """`accept_history_rewrite`: the commit id of a tip an operator moved the branch to
        on purpose (see the module docstring); None refuses every non-descending tip."""
        if accept_history_rewrite is not None and not COMMIT_ID.match(accept_history_rewrite):
            raise ValueError(f"accept_history_rewrite must be a full commit id, not "
                             f"{accept_history_rewrite!r}")
        self._urls = (url, *fallback_urls)
        self._servers = servers or ServerList(self._urls)
        if len(self._servers) != len(self._urls):
            raise ValueError("the server list and the URLs differ in length")
        self._cache_dir = Path(cache_dir)
        self._username, self._password = username, password
        self._depth = depth
        self._accept_rewrite = accept_history_rewrite
        self._repo: pygit2.Repository | None = None
        #: The last history verdict, (tip, adopted) -> descends: a refused tip is refused
        #: again on every poll, at the cost of the ref advertisement only.
        self._verdict: tuple[str, str, bool] | None = None
        self._waiting = waiting
        self._probe = RefProbe(username=username, password=password, timeout=timeout) \
            if waiting is not None and all(u.startswith(("http://", "https://"))
                                           for u in self._urls) else None

    @property
    def _url(self) -> str:
        """The URL in use (the one messages name)."""
        return self._urls[self._servers.active]

    # --- the Source protocol -----------------------------------------------------------------

    def fetch(self, adopted: Adopted) -> DesiredState | None:
        """The new desired state, or None when the branch tip is the adopted commit.

        A repository without a branch (the server has compiled nothing for the device yet)
        is an empty desired state only for a device that never had one; a device that had
        state keeps it (`SourceError("NO_BRANCH")`, retryable) rather than removing every
        workload because the branch went missing. `margo serve` answers 404 for a device
        without a branch, and also for a path that names no device, so a mistyped URL looks
        like "nothing compiled yet" to a new device; it never removes anything.

        A tip that does not descend from the adopted commit raises `IntegrityError`
        (`ROLLBACK`) unless the operator accepted it (module docstring). With
        `adopted.damaged`, the adopted commit is read again even though the tip has not
        moved."""
        try:
            tip = self._advertised_tip()
        except Interrupted:
            return None  # the client is stopping: nothing changed
        if tip is None:
            if adopted.version is None:
                return DesiredState(source=self.name, version=NO_BRANCH_VERSION,
                                    manifest_version=None, etag=None, deployments=())
            if adopted.version == NO_BRANCH_VERSION:
                return None
            raise SourceError(ErrorCode.NO_BRANCH, "the repository lost its branch; keeping the "
                              "previous state")
        if tip == adopted.version and not adopted.damaged:
            return None
        try:
            return self._state(tip, adopted)
        except (pygit2.GitError, SourceError) as exc:
            # Objects that fail libgit2's hash check, or a fetch that fails for a reason
            # libgit2 gives no class to (a damaged local pack breaks the negotiation): the
            # cache is only a cache, so start it over once.
            if isinstance(exc, SourceError) and (exc.code != ErrorCode.GIT_ERROR
                                                 or isinstance(exc, _BranchMoved)):
                raise
            log.warning("the Git cache %s is damaged or unusable (%s); rebuilding it and "
                        "fetching again", self._cache_dir, exc)
            self._rebuild()
            try:
                return self._state(tip, adopted)
            except pygit2.GitError as again:
                raise SourceError(ErrorCode.GIT_ERROR, f"{self._url}: the fetched objects cannot "
                                  f"be read: {again}") from None

    def _state(self, tip: str, adopted: Adopted) -> DesiredState | None:
        """The desired state at `tip` (held locally or fetched), after the history check.
        Local reads that find damaged objects raise `pygit2.GitError`."""
        commit = self._local_commit(tip) or self._fetch_tip()
        version = str(commit.id)
        if version == adopted.version and not adopted.damaged:
            return None
        accepted = None if version == adopted.version else self._check_history(version, adopted)
        return DesiredState(source=self.name, version=version, manifest_version=None,
                            etag=None, deployments=_deployments(commit),
                            history_rewrite_accepted=accepted)

    # --- rollback protection -----------------------------------------------------------------

    def _check_history(self, tip: str, adopted: Adopted) -> str | None:
        """None when `tip` may be adopted because it descends from the adopted commit (or
        nothing was adopted from Git before); the override commit when only the operator's
        override allows it; `IntegrityError` otherwise."""
        previous = adopted.version
        if previous is None or not COMMIT_ID.match(previous):
            return None  # the first state, a branch that had not existed, or another source
        if self._verdict is not None and self._verdict[:2] == (tip, previous):
            descends = self._verdict[2]
        else:
            descends = self._descends(tip, previous)
            self._verdict = (tip, previous, descends)
        if descends:
            return None
        override = self._accept_rewrite
        spent = override is not None and override == adopted.history_rewrite_accepted
        if override is not None and not spent and (
                tip == override or self._descends(tip, override)):
            return override
        hint = (f"source.acceptHistoryRewrite {override} was used once already; "
                if spent else "")
        raise IntegrityError(ErrorCode.ROLLBACK, f"{self._url}: the branch tip {tip} does not "
                             f"descend from the adopted commit {previous}: the branch was moved "
                             f"back or its history rewritten; refusing it and keeping the "
                             f"adopted state. {hint}If the branch was moved on purpose, accept "
                             f"this tip once with `source: {{acceptHistoryRewrite: {tip}}}` in "
                             "the device configuration and restart the client")

    def _descends(self, tip: str, ancestor: str) -> bool:
        """Whether `ancestor` is `tip` or in its history, deepening the cache's history
        (module docstring) until the walk finds it or reaches the branch's root commits."""
        repo = self._repository()
        if tip == ancestor:
            return True
        if _reaches(repo, ancestor, tip):
            return False  # tip is an ancestor of the adopted commit: moved back
        depths = iter((*_DEEPEN, _UNSHALLOW) if self._depth else ())
        while True:
            found = _reaches(repo, tip, ancestor)
            if found is not None:
                return found
            depth = next(depths, None)
            if depth is None:
                raise SourceError(ErrorCode.GIT_ERROR, f"{self._url}: the history of {tip} is "
                                  "incomplete even fetched in full; cannot check that it "
                                  f"descends from {ancestor}")
            if self._depth is not None and depth <= self._depth:
                continue
            if str(self._fetch_tip(depth=depth).id) != tip:
                raise _BranchMoved(ErrorCode.GIT_ERROR, f"{self._url}: the branch moved while its "
                                   "history was read; checking again next cycle")

    def close(self) -> None:
        if self._repo is not None:
            self._repo.free()
            self._repo = None
        if self._probe is not None:
            self._probe.close()

    def __enter__(self) -> GitSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- remote ------------------------------------------------------------------------------

    def _advertised_tip(self) -> str | None:
        """The commit the remote's HEAD names (one ref advertisement), None without one:
        read by the loop's waiting polls themselves (module docstring), else by libgit2."""
        if self._probe is not None and self._waiting is not None and self._waiting.active:
            try:
                return self._each_url(self._probed_tip)
            except Unusable as exc:
                log.warning("%s: the ref advertisement cannot be read without Git (%s); "
                            "polling with Git from now on", self._url, exc)
                self._probe.close()
                self._probe = None
        heads = self._call(lambda remote, callbacks: remote.list_heads(callbacks=callbacks))
        if heads is None:
            return None
        head = next((h for h in heads if h.name == "HEAD"), None)
        return None if head is None or not any(head.oid.raw) else str(head.oid)

    def _fetch_tip(self, depth: int | None = None) -> pygit2.Commit:
        """Fetch HEAD into `LOCAL_REF` and return it: `depth` commits deep (default: the
        configured depth; 0 or None configured: the whole history)."""
        repo = self._repository()
        if _pack_count(self._cache_dir) >= MAX_PACKS:
            repo = self._rebuild()
        depth = depth or self._depth or 0
        fetched = self._call(lambda remote, callbacks: remote.fetch(
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

    def _probed_tip(self, url: str) -> str | None:
        """The advertised tip at `url`, read (and held) by `RefProbe`, its answers told as
        libgit2's are (`_classify`)."""
        assert self._probe is not None
        try:
            return self._probe.tip(url, self._waiting)
        except RefsStatus as status:
            offered = self._username if self._password is not None else None
            if status.status == 401:
                raise SourceError(ErrorCode.UNAUTHORIZED, _refused(url, offered),
                                  retryable=False) from None
            error = _classify(url, Exception(f"unexpected http status code: "
                                             f"{status.status}"))
            assert error is not None
            raise error from None

    def _call(self, operation: Callable[[pygit2.Remote, pygit2.RemoteCallbacks], _T]
              ) -> _T | None:
        """Run one network operation on the URL in use, moving on to the next while a URL
        gives no answer (module docstring); None when the server has no branch for the
        device (it answers 404 once the credentials are accepted); every failure a
        `SourceError` (when every URL failed, the first one's)."""
        return self._each_url(lambda url: self._call_at(url, operation))

    def _each_url(self, attempt: Callable[[str], _T | None]) -> _T | None:
        """`attempt(url)` on the URL in use, then on the next ones while a URL gives no
        answer (`_call`)."""
        if len(self._urls) == 1:
            return attempt(self._urls[0])
        failures: list[SourceError] = []
        for index in self._servers.order():
            try:
                result = attempt(self._urls[index])
            except SourceError as exc:
                if exc.code not in _NO_ANSWER:
                    raise
                self._servers.failed(index, exc.message)
                failures.append(exc)
                continue
            self._servers.answered(index)
            return result
        raise failures[0]

    def _call_at(self, url: str, operation: Callable[[pygit2.Remote, pygit2.RemoteCallbacks], _T]
                 ) -> _T | None:
        """`_call` on one URL."""
        remote = self._repository().remotes.create_anonymous(url)
        try:
            return operation(remote, _Callbacks(self._username, self._password))
        except (_CredentialsRejected, pygit2.AuthError):
            offered = self._username if self._password is not None else None
            raise SourceError(ErrorCode.UNAUTHORIZED, _refused(url, offered),
                              retryable=False) from None
        except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
            error = _classify(url, exc)
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


def _refused(url: str, username: str | None) -> str:
    """What a 401 means: our server answers it alike for a wrong token and for a device
    that is not one of the client's (so as to reveal nothing), and a device becomes the
    client's when its capabilities are first reported."""
    if username is None:
        return f"{url}: the server requires credentials"
    return (f"{url}: the server refused client {username!r} for this device: the client's "
            "token is wrong, or the server does not know the device as this client's (it "
            "learns a device from its capability report)")


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


def _raw_parents(repo: pygit2.Repository, oid: str) -> list[str] | None:
    """A commit's parents as its object says, None when the cache lacks the object. libgit2
    presents a shallow commit (the edge of a shallow fetch) as parentless; its object still
    names the real parents. A damaged object raises `pygit2.GitError`."""
    try:
        kind, data = repo.odb.read(oid)
    except KeyError:  # pygit2.NotFoundError is also a GitError: a missing object, not damage
        return None
    if kind != pygit2.enums.ObjectType.COMMIT:
        raise pygit2.GitError(f"{oid} is not a commit")
    header = data.split(b"\n\n", 1)[0]
    return [line[7:].decode("ascii") for line in header.split(b"\n")
            if line.startswith(b"parent ")]


def _reaches(repo: pygit2.Repository, start: str, target: str) -> bool | None:
    """Whether `target` is `start` or in its history among the cache's objects: True when
    found, False when the whole history is here and it is not, None when the walk met a
    commit the cache does not hold (a shallow edge) before finding it."""
    seen: set[str] = set()
    pending = [start]
    complete = True
    while pending:
        oid = pending.pop()
        if oid == target:
            return True
        if oid in seen:
            continue
        seen.add(oid)
        parents = _raw_parents(repo, oid)
        if parents is None:
            complete = False
            continue
        pending.extend(parents)
    return False if complete else None


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
