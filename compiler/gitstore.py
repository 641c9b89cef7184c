"""Per-device desired state in ONE shared bare Git repository, one branch per device.

Layout: ``<repos_dir>/fleet-state.git`` holds ``refs/heads/devices/<encoded device id>``; each
branch's tip tree is exactly that device's desired state (flat file names -> bytes) and its
history is linear and never rewritten. Why one shared repository rather than one per device:
creating 10,000 repositories dominates a first compile (≈ 60-80 s measured) while streaming all
writing all their objects into one pack takes a few seconds; the fleet server hides the other
devices' refs (``uploadpack.hideRefs``) so each device still sees only its own branch
(the figures: docs/benchmarks.md, `bench/compile.py`).

How a write publishes (`DeviceStore.write_objects`, then `DeviceStore.move_branches`; `write`
does both), and why:

1. every commit is validated before it is written: a list is validated whole before
   anything is written; a lazily produced iterable commit by commit, so a bad commit stops
   the write before any branch moves;
2. ONE new pack receives every object (`compiler.packwriter`; writing loose objects one at a
   time is too slow at fleet scale). A compile's worker processes make and deflate each
   commit's objects on their own cores (`gitformat.packed_commit`) and this process only
   copies them into the pack, while later devices still compile; the pack is published
   (renamed into place, its index last) once every commit is in it. Every object a commit
   names without writing it (its parent, kept files) must be stored already;
3. ONE rewrite of ``packed-refs`` then moves every device branch, each with its expected old
   value (compare-and-swap), published by a single rename (`compiler.packedrefs`: Git's
   ``update-ref`` would write one loose file per branch, slower than compiling them). If any
   branch moved in the meantime, or the file is locked, no branch is changed. The
   unreferenced objects of a failed write are harmless and are pruned by a later ``git gc``.

The pack is not deltified (about 1.6 times the bytes of one ``git fast-import`` writes,
which this store used before: `compiler.packwriter` says why); a ``git gc`` deltifies it.

What the store computes without touching the repository (device ids <-> branch names, blob
and tree ids, validating a commit, the raw tree and commit objects) is `compiler.gitformat`;
its names are re-exported here, the store's face.

Readers (the server, the next compile) only use pygit2 and never block on writers. Writers
serialise with `DeviceStore.lock`, which must be held from reading the tips a compile builds on
until its branches have moved.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, ClassVar, cast

import pygit2

from compiler.branchset import carry_components
from compiler.forkgate import init_bare_repository
from compiler.gitformat import (
    DEVICE_ID_PATTERN,
    DEVICE_REF_PREFIX,
    FULL_OID_RE,
    DeviceCommit,
    GitStoreError,
    InvalidCommitError,
    PackedCommit,
    blob_id,
    branch_problem,
    changed_tree,
    check_commit,
    commit_object,
    device_id_from_ref,
    device_ref,
    flat_tree,
    plain_files,
    tree_id_of,
)
from compiler.packedrefs import LooseRefsError, PackedRefsError, move_refs, ref_names
from compiler.packwriter import BLOB, COMMIT, TREE, PackWriter
from compiler.stalelocks import recover_stale_locks

__all__ = [
    "DEVICE_ID_PATTERN",
    "DEVICE_REF_PREFIX",
    "LOCK_FILE_NAME",
    "REPOSITORY_NAME",
    "CommitInfo",
    "DeviceCommit",
    "DeviceStore",
    "GitStoreError",
    "InvalidCommitError",
    "PackedCommit",
    "PendingMove",
    "StoredTree",
    "blob_id",
    "branch_problem",
    "device_id_from_ref",
    "device_ref",
    "tree_id_of",
]

REPOSITORY_NAME = "fleet-state.git"
#: Git config key holding the repository's random identity (see `DeviceStore.identity`).
IDENTITY_KEY = "margo.repositoryid"
LOCK_FILE_NAME = "margo-compile.lock"

# Every object name we give git is a full hex id. Git still looks for refs spelled like each
# one (to warn that the name is ambiguous): ~12 failed stat() calls per id (measured in the
# fast-import this store once wrote with). The ids resolve the same without it.
_GIT_OPTIONS = ("-c", "core.warnAmbiguousRefs=false")
# What a compile's commit writes, for sizing the pack's table of objects up front: its
# files (5.4 in `bench/compile.py`'s fleets), its tree and itself. More only costs a
# rehash of the table.
_OBJECTS_PER_COMMIT = 8
# Server-side settings a fleet-state repository needs (why: see `DeviceStore._configure`).
_REPO_CONFIG: Mapping[str, str] = {
    "uploadpack.allowFilter": "true",
    "uploadpack.allowAnySHA1InWant": "false",
    "receive.denyNonFastForwards": "true",
    "core.logAllRefUpdates": "false",
    "gc.auto": "0",
}
# Variables that would make a child `git` look at another repository than the one we name.
_GIT_LOCATION_VARIABLES = (
    "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_COMMON_DIR", "GIT_NAMESPACE",
)



class StoredTree:
    """A device's tip as a compile needs it (see `DeviceStore.tree`): `tree` is the tree id and
    `ids` maps the names of its plain files to blob ids; `read` loads a file's content only
    when asked, since a compile that re-renders one intent compares one file, not all of them.
    `foreign` says the tree also holds entries no compile writes (subtrees, executables,
    links): it then equals no tree of plain files, whatever `ids` says."""

    __slots__ = ("_store", "commit", "foreign", "ids", "tree")

    def __init__(self, store: DeviceStore | None, tree: str, ids: dict[str, str], *,
                 foreign: bool = False, commit: str | None = None) -> None:
        """`store` may be None only for a tree without files (nothing to read); `commit` is
        the commit the tree was read from."""
        self._store, self.tree, self.ids, self.foreign = store, tree, ids, foreign
        self.commit = commit

    def __repr__(self) -> str:
        return f"StoredTree({self.tree!r}, {self.ids!r})"

    def read(self, name: str) -> bytes:
        """The content of file `name` of this tree (KeyError if it has none)."""
        return self.blob(self.ids[name])

    def blob(self, oid: str) -> bytes:
        """The content of a blob of the store this tree was read from (a file the tree
        held at another commit, e.g. the one a rollout rolls a device back to)."""
        assert self._store is not None
        return self._store._blob(oid)


@dataclass(frozen=True, slots=True)
class PendingMove:
    """Commits `DeviceStore.write_objects` wrote and no branch points to yet: device id ->
    the new tip, and the tip each branch must still be at when it moves (None: no branch)."""

    new_tips: Mapping[str, str]
    old_tips: Mapping[str, str | None]


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """A commit of a device branch as `DeviceStore.history` reports it."""

    id: str
    timestamp: int
    message: str
    parent: str | None


# --- the store --------------------------------------------------------------------------


class DeviceStore:
    """The shared bare repository holding every device's desired state."""

    AUTHOR: ClassVar[tuple[str, str]] = ("margo-gitops compiler",
                                         "compiler@margo-gitops.invalid")
    #: The `git` program used for writing; an instance may override it (tests use ``false``).
    git_executable: str = "git"

    def __init__(self, repos_dir: str | os.PathLike[str], *, create: bool = True) -> None:
        """Open ``<repos_dir>/fleet-state.git``, creating it (bare) when `create` is true."""
        self.path = Path(repos_dir) / REPOSITORY_NAME
        self._repo = self._open(create)
        self._pid = os.getpid()
        self._configure()

    def __repr__(self) -> str:
        return f"DeviceStore({str(self.path)!r})"

    def _open(self, create: bool) -> pygit2.Repository:
        if not self.path.exists():
            if not create:
                raise GitStoreError(f"no fleet-state repository at {self.path}")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return init_bare_repository(self.path)
        try:
            repo = pygit2.Repository(str(self.path))
        except pygit2.GitError as exc:
            raise GitStoreError(f"{self.path} is not a Git repository: {exc}") from None
        if not repo.is_bare:
            raise GitStoreError(f"{self.path} must be a bare repository")
        return repo

    def _configure(self) -> None:
        """Serve partial clones but no unadvertised commits; never rewrite a branch; keep
        no reflogs (10,000 of them are waste); let the server decide when to gc."""
        config = self._repo.config
        for key, value in _REPO_CONFIG.items():
            if key not in config or config[key] != value:
                config[key] = value

    @property
    def identity(self) -> str:
        """A random id given to this repository when it was first opened: caches keyed on
        the repository (the compiler's state) notice when it was replaced."""
        config = self._repo.config
        if IDENTITY_KEY not in config:
            config[IDENTITY_KEY] = str(uuid.uuid4())
        return str(config[IDENTITY_KEY])

    # --- reading -------------------------------------------------------------------------

    def device_ids(self) -> list[str]:
        """Every device that has a branch, sorted; foreign refs are ignored."""
        ids = (device_id_from_ref(ref) for ref in self._repo.listall_references()
               if ref.startswith(DEVICE_REF_PREFIX))
        return sorted(i for i in ids if i is not None)

    def branch_names(self) -> frozenset[str]:
        """The name of every ref, read in one listing: a recompile that skips most devices
        tells from it which recorded devices lost their branch (one set lookup each, not
        one ref lookup each). Read from the files (`compiler.packedrefs.ref_names`: those
        of ``packed-refs`` are remembered while the file is the same one), or by libgit2
        from a ``packed-refs`` that module does not read."""
        try:
            return ref_names(self.path)
        except PackedRefsError:
            return frozenset(self._own_repo().listall_references())

    def tip(self, device_id: str) -> str | None:
        """The id of the newest commit of the device's branch; None when it has none."""
        commit = self._tip_commit(device_id)
        return None if commit is None else str(commit.id)

    def branch_target(self, device_id: str) -> str | None:
        """What the device's branch points at, read from the ref alone (no object is
        read); None without a branch, or when the ref is symbolic. Cheap enough to tell,
        for every device a recompile touches, whether its branch is where a compile left
        it (see `compiler.state.CompilerState.trees_of`)."""
        ref = self._branch(device_id)
        target = None if ref is None else ref.target
        return str(target) if isinstance(target, pygit2.Oid) else None

    def tree_id(self, device_id: str) -> str | None:
        """The id of the tree at the tip (what the compiler remembers), or None."""
        commit = self._tip_commit(device_id)
        return None if commit is None else str(commit.tree_id)

    def tree_ids(self, device_id: str) -> dict[str, str] | None:
        """File name -> blob id at the tip, read without loading any blob (cheap enough to
        call for every device of a fleet); None when the device has no branch."""
        commit = self._tip_commit(device_id)
        if commit is None:
            return None
        return {cast(str, entry.name): str(entry.id) for entry in commit.tree}

    def tree(self, device_id: str) -> StoredTree | None:
        """The tip's tree id and blob ids, with contents read on demand (None without a
        branch): what `tree_id`, `tree_ids` and `read_files` say, from one ref lookup
        instead of three, loading no blob up front."""
        return self._stored_tree(self._tip_commit(device_id))

    def commit_tree(self, commit: str) -> StoredTree | None:
        """`tree` of a commit given by its full id instead of a branch tip; None when the
        repository has no such commit. For a branch whose ref was lost: the compiler's
        state still names the commit it was at, and its objects usually survive."""
        if not isinstance(commit, str) or not FULL_OID_RE.fullmatch(commit):
            return None
        try:
            found = self._own_repo()[pygit2.Oid(hex=commit)]
        except (KeyError, ValueError, pygit2.GitError):
            return None
        if not isinstance(found, pygit2.Commit):
            return None
        return self._stored_tree(found)

    def _stored_tree(self, commit: pygit2.Commit | None) -> StoredTree | None:
        if commit is None:
            return None
        tree_id = commit.tree_id
        kind, data = self._own_repo().odb.read(tree_id)
        if kind != pygit2.enums.ObjectType.TREE:
            raise GitStoreError(f"{tree_id} is not a tree in {self.path}")
        ids, foreign = plain_files(data, len(tree_id.raw))
        return StoredTree(self, str(tree_id), ids, foreign=foreign, commit=str(commit.id))

    def _own_repo(self) -> pygit2.Repository:
        """The libgit2 handle of this process: compile workers are forked, and libgit2
        handles are not shared across fork, so a child opens the repository again."""
        if os.getpid() != self._pid:
            self._repo, self._pid = self._open(create=False), os.getpid()
        return self._repo

    def _blob(self, oid: str) -> bytes:
        """A blob's content (also in a forked child process)."""
        try:
            kind, data = self._own_repo().odb.read(pygit2.Oid(hex=oid))
        except (KeyError, ValueError, pygit2.GitError):
            raise GitStoreError(f"no object {oid} in {self.path}") from None
        if kind != pygit2.enums.ObjectType.BLOB:
            raise GitStoreError(f"{oid} is not a file in {self.path}")
        return data

    def read_files(self, device_id: str, commit: str | None = None) -> dict[str, bytes] | None:
        """File name -> content at the tip, or at `commit` (which must be on the device's
        branch, so one device's id can never be used to read another's state); None when the
        device has no branch."""
        tip = self._tip_commit(device_id)
        if tip is None:
            return None
        target = tip if commit is None else self._commit_on_branch(device_id, tip, commit)
        return {cast(str, entry.name): entry.data for entry in target.tree
                if isinstance(entry, pygit2.Blob)}

    def history(self, device_id: str, limit: int = 50) -> list[CommitInfo]:
        """Up to `limit` commits of the device's branch, newest first ([] without a branch)."""
        if limit < 0:
            raise ValueError("limit must not be negative")
        commit = self._tip_commit(device_id)
        out: list[CommitInfo] = []
        while commit is not None and len(out) < limit:
            parent = commit.parents[0] if commit.parents else None
            out.append(CommitInfo(
                id=str(commit.id), timestamp=commit.commit_time,
                message=commit.raw_message.decode("utf-8", errors="replace"),
                parent=None if parent is None else str(parent.id)))
            commit = parent
        return out

    def _tip_commit(self, device_id: str) -> pygit2.Commit | None:
        ref = self._branch(device_id)
        return None if ref is None else ref.peel(pygit2.Commit)

    def _branch(self, device_id: str) -> pygit2.Reference | None:
        """The device's branch; None also for an id no branch can be named for (an id
        stored before the server bounded them: it has no desired state, never a 500)."""
        if branch_problem(device_id) is not None:
            return None
        return self._own_repo().references.get(device_ref(device_id))

    def _commit_on_branch(self, device_id: str, tip: pygit2.Commit,
                          commit: str) -> pygit2.Commit:
        if not isinstance(commit, str) or not FULL_OID_RE.fullmatch(commit):
            raise GitStoreError(f"not a full commit id: {commit!r}")
        oid = pygit2.Oid(hex=commit)
        try:
            on_branch = oid == tip.id or self._repo.descendant_of(tip.id, oid)
        except pygit2.GitError:  # no such object
            on_branch = False
        if not on_branch:
            raise GitStoreError(f"commit {commit} is not on the branch of device {device_id!r}")
        return self._repo[oid].peel(pygit2.Commit)

    # --- locking -------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, timeout: float = 0.0) -> Iterator[None]:
        """Hold the exclusive compile lock (``flock`` on ``<repo>/margo-compile.lock``).

        Two compilers writing at once would build on each other's stale tips; `write`'s
        compare-and-swap would then reject one of them after all its work, so contention is
        reported up front instead: GitStoreError after `timeout` seconds (default: at once).
        Not re-entrant: a second `lock` while holding one fails like any other contender.

        Holding it, Git's lock files that a killed writer left in the repository are
        removed first (`compiler.stalelocks`): no writer of ours can be running, and one
        left by a crash would otherwise make every later compile fail.
        """
        lock_path = self.path / LOCK_FILE_NAME
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            _acquire(fd, lock_path, timeout)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                recover_stale_locks(self.path)
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # --- writing -------------------------------------------------------------------------

    def delete_branches(self, device_ids: Iterable[str]) -> dict[str, str]:
        """Delete the branches of these devices (those that have one), all or none; device
        id -> the commit its branch was at. Hold `lock`.

        Why: a device id that its client deleted may be registered again, by another
        client; its branch must then start from nothing, or a clone would show the previous
        owner's history. Git's own ``update-ref`` transaction removes the ref wherever it
        is stored (``packed-refs`` or a loose file) with its reflog, each only if it still
        points where it was read. The commits become unreachable: the Git hosting serves
        only what a device's own branch reaches (`wfm.githttp`), and ``git gc`` prunes them.
        """
        doomed = {}
        for device_id in dict.fromkeys(device_ids):
            target = self.branch_target(device_id)
            if target is not None:
                doomed[device_id] = target
        if not doomed:
            return {}
        lines = [b"start\n", *(f"delete {device_ref(d)} {old}\n".encode()
                               for d, old in doomed.items()), b"commit\n"]
        with tempfile.TemporaryDirectory(prefix="margo-gitstore-") as scratch:
            self._run_git(["update-ref", "--stdin"], lines, Path(scratch),
                          "no device branch was deleted")
        return doomed

    def write(self, commits: Iterable[DeviceCommit]) -> dict[str, str]:
        """Append one commit per `DeviceCommit` to its device's branch; device id -> new tip.

        `write_objects` then `move_branches`: for a caller with no bookkeeping of its own
        to stage between the two (a compile has: `compiler.writing`). Every commit is
        written even when its tree equals the tip's: the caller decides. Callers should
        skip unchanged devices by comparing ``{name: blob_id(content)}`` with `tree_ids`, so
        a compile commits only what changed. All branches move in one transaction: on
        GitStoreError (InvalidCommitError included) no branch has changed. Hold `lock`
        around the read-compile-write cycle.
        """
        pending = self.write_objects(commits)
        self.move_branches(pending)
        return dict(pending.new_tips)

    def write_objects(self, commits: Iterable[DeviceCommit],
                      meanwhile: Callable[[Mapping[str, str]], object] | None = None, *,
                      expected_commits: int = 0) -> PendingMove:
        """Write every object of these commits, moving no branch: what `move_branches` then
        moves, all at once. Several commits for one device are chained in the given order.

        `commits` is consumed lazily: a generator's commits are written into the new pack
        (`compiler.packwriter`) while it still produces them, so memory holds one at a
        time. A sequence is validated whole before anything is written; a generator commit
        by commit (an invalid commit, or an exception raised by the generator itself, aborts
        the write and removes the unfinished pack). Each device's old tip is read when its
        first commit arrives. Why two steps: a caller records what was written between them
        (its records ready to commit the moment the branches have moved), with no callback.
        `expected_commits` (how many a generator will give at most) sizes the pack's table.

        `meanwhile`, if given, runs once every commit is written, given each device's new
        tip, while the pack is finished (read back and hashed, indexed, synced to disk) on
        another thread, whose I/O and hashing leave the interpreter to it (not at all
        without commits).
        """
        if isinstance(commits, Sequence):
            for commit in commits:
                check_commit(commit)
        pending = iter(commits)
        first = next(pending, None)
        if first is None:
            return PendingMove({}, {})
        check_commit(first)  # a bad first commit never starts a pack
        if isinstance(commits, Sequence):
            expected_commits = len(commits)
        try:
            writer = PackWriter(self.path / "objects",
                                expected=_OBJECTS_PER_COMMIT * expected_commits)
        except OSError as exc:
            raise GitStoreError(f"cannot write objects into {self.path}; no device branch "
                                f"was changed: {exc}") from None
        try:
            new_tips: dict[str, str] = {}
            old_tips: dict[str, str | None] = {}
            for commit in itertools.chain([first], pending):
                check_commit(commit)
                parent = self._parent_of(commit, new_tips, old_tips)
                new_tips[commit.device_id] = self._write_commit(writer, commit, parent)
            writer.publish_while(None if meanwhile is None else
                                 functools.partial(meanwhile, new_tips))
        except OSError as exc:
            writer.discard()
            raise GitStoreError(f"writing the objects into {self.path} failed; no device "
                                f"branch was changed: {exc}") from None
        except BaseException:
            writer.discard()
            raise
        return PendingMove(new_tips, old_tips)

    def _parent_of(self, commit: DeviceCommit, new_tips: Mapping[str, str],
                   old_tips: dict[str, str | None]) -> str | None:
        """The commit `commit` builds on: the device's previous commit in this write, else
        its current tip (read now, into `old_tips`), else none."""
        device_id = commit.device_id
        previous = new_tips.get(device_id)
        if previous is not None:
            if commit.on_parent:
                raise InvalidCommitError(f"device {device_id!r}: a change on the parent's "
                                         "tree must be the device's first commit of a write")
            return previous
        parent = commit.parent if commit.parent_known else self.tip(device_id)
        old_tips[device_id] = None if commit.branch_lost else parent
        return parent

    def _write_commit(self, writer: PackWriter, commit: DeviceCommit,
                      parent: str | None) -> str:
        """Write the commit's new files, its tree and itself; the commit's id. Every object
        it names that it does not write must be stored already (its parent, kept files,
        the parent's tree): otherwise GitStoreError, and nothing is published."""
        where = f"device {commit.device_id!r}"
        kept = {name: self._stored(bytes.fromhex(oid), BLOB, writer,
                                   f"{where}: kept file {name!r}")
                for name, oid in commit.kept.items()}
        if commit.packed is not None:
            # Its parent is the tip its worker read the tree of: stored. Asking libgit2
            # again would read one page of the pack per commit, which at a million devices'
            # undeltified pack made 1.7 GB of the process resident (measured).
            if parent != commit.parent:
                raise InvalidCommitError(f"{where}: a packed commit must be the device's "
                                         "first commit of a write")
            writer.add_packed(commit.packed.objects)
            return commit.packed.commit
        if parent is not None:
            self._stored(bytes.fromhex(parent), COMMIT, writer, f"{where}: parent")
        ids = {name: writer.add(BLOB, content) for name, content in commit.files.items()}
        ids.update(kept)
        if commit.on_parent:
            assert parent is not None  # check_commit: on_parent needs a known parent
            tree = changed_tree(self._tree_of(parent), 20, ids, commit.removed)
        else:
            tree = flat_tree(ids)
        tree_id = writer.add(TREE, tree).hex()
        ident = f"{self.AUTHOR[0]} <{self.AUTHOR[1]}> {commit.timestamp} +0000"
        return writer.add(COMMIT, commit_object(tree_id, parent, ident, commit.message)).hex()

    def _stored(self, oid: bytes, kind: int, writer: PackWriter, what: str) -> bytes:
        """`oid`, which this write or the repository must hold as an object of `kind`."""
        if writer.holds(oid):
            return oid
        try:
            found = self._own_repo().odb.read_header(pygit2.Oid(raw=oid))[0]
        except (KeyError, pygit2.GitError):
            found = None
        if found != kind:
            held = "no such object" if found is None else f"a {found.name.lower()}"
            raise GitStoreError(f"{what} names {oid.hex()}, which {self.path} holds as "
                                f"{held}; no device branch was changed")
        return oid

    def _tree_of(self, commit: str) -> bytes:
        """The raw tree object of a stored commit."""
        repo = self._own_repo()
        found = repo.get(commit)
        if not isinstance(found, pygit2.Commit):
            raise GitStoreError(f"{commit} is not a commit in {self.path}; no device "
                                "branch was changed")
        return repo.odb.read(found.tree_id)[1]

    def move_branches(self, pending: PendingMove) -> None:
        """Move every branch `write_objects` wrote at once, each only if it still points
        where the writer saw it (None: must not exist yet), in one rewrite of
        ``packed-refs`` (`compiler.packedrefs` says why): all of them, or (GitStoreError)
        none."""
        if not pending.new_tips:
            return
        refs = {d: device_ref(d) for d in pending.new_tips}
        updates = {refs[d]: (pending.old_tips[d], new) for d, new in pending.new_tips.items()}
        created = {d: ref for d, ref in refs.items() if pending.old_tips[d] is None}
        before = self.branch_names() if created else None  # moves only: the same listing
        try:
            try:
                move_refs(self.path, updates)
            except LooseRefsError:  # written by git or libgit2, or by an older compiler
                self._pack_refs()
                move_refs(self.path, updates)
        except PackedRefsError as exc:
            raise GitStoreError(f"moving the device branches in {self.path} failed; no "
                                f"device branch was changed: {exc}") from None
        if before is not None:
            carry_components(before, self.branch_names(), created)

    def _pack_refs(self) -> None:
        """Fold loose refs into ``packed-refs`` with Git itself (every ref keeps its value;
        symbolic refs stay loose)."""
        with tempfile.TemporaryDirectory(prefix="margo-gitstore-") as scratch:
            self._run_git(["pack-refs", "--all", "--prune"], [], Path(scratch),
                          "no device branch was changed")

    def _run_git(self, args: Sequence[str], stdin: Iterable[bytes], scratch: Path,
                 consequence: str) -> None:
        """Run ``git --git-dir=<repo> <args>`` fed from `stdin`; GitStoreError with its
        stderr unless it exits 0. Stderr goes to a file, so a chatty failure cannot
        deadlock us."""
        command = [self.git_executable, *_GIT_OPTIONS, f"--git-dir={self.path}", *args]
        with open(scratch / "stderr", "w+b") as err:
            try:
                process = subprocess.Popen(command, stdin=subprocess.PIPE,
                                           stdout=subprocess.DEVNULL, stderr=err, env=_git_env())
            except OSError as exc:
                raise GitStoreError(f"cannot run {command[0]!r}: {exc}") from None
            _feed(process, stdin)
            status = process.wait()
            err.seek(0)
            stderr = err.read().decode("utf-8", errors="replace").strip()
        if status != 0:
            raise GitStoreError(f"git {args[0]} failed in {self.path} (exit status {status}); "
                                f"{consequence}: {stderr or '(no message)'}")


def _acquire(fd: int, lock_path: Path, timeout: float) -> None:
    """flock `fd` exclusively, polling until `timeout`; say who holds it when giving up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                holder = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
                raise GitStoreError(
                    f"another compiler is writing the fleet state ({lock_path} is locked"
                    f"{f' by process {holder}' if holder else ''}); try again when it is done"
                ) from None
            time.sleep(min(0.05, remaining))


def _feed(process: subprocess.Popen[bytes], chunks: Iterable[bytes]) -> None:
    """Stream `chunks` to the process; if it dies early its exit status tells why."""
    stdin: IO[bytes] | None = process.stdin
    assert stdin is not None
    try:
        for chunk in chunks:
            stdin.write(chunk)
        stdin.close()
    except BrokenPipeError:
        with contextlib.suppress(BrokenPipeError):
            stdin.close()
    except BaseException:  # e.g. the producer of a lazy stream failed: git must not finish
        process.kill()
        with contextlib.suppress(BrokenPipeError):
            stdin.close()
        process.wait()
        raise


def _git_env() -> dict[str, str]:
    """Our environment minus variables that would redirect git to another repository."""
    return {k: v for k, v in os.environ.items() if k not in _GIT_LOCATION_VARIABLES}

