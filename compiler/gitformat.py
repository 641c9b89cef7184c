"""What the fleet-state store computes without touching a repository (`compiler.gitstore`):
device ids <-> branch names, Git's ids of blobs and trees, the plain files of a raw tree
object, the validation of a `DeviceCommit`, and the raw tree and commit objects that write
one (`compiler.packwriter` packs them).

Pure functions of their arguments, so the compiler can compute the tree id of what it
commits, and a commit is rejected before anything is written.
"""

from __future__ import annotations

import functools
import hashlib
import re
import urllib.parse
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

import pygit2

from compiler.packwriter import BLOB, COMMIT, TREE, PackedObjects
from margo.errors import short_repr
from margo.identifiers import (
    MAX_DEVICE_ID,
    MAX_REF_COMPONENT,
    branch_component,
    device_id_problem,
)

__all__ = [
    "DEVICE_ID_PATTERN",
    "DEVICE_REF_PREFIX",
    "FULL_OID_RE",
    "DeviceCommit",
    "GitStoreError",
    "InvalidCommitError",
    "PackedCommit",
    "all_plain_device_ids",
    "blob_id",
    "branch_problem",
    "changed_tree",
    "check_commit",
    "commit_object",
    "device_id_from_ref",
    "device_ids_from_refs",
    "device_ref",
    "flat_tree",
    "flat_tree_of",
    "packed_commit",
    "plain_files",
    "tree_entries",
    "tree_id_of",
]

DEVICE_REF_PREFIX = "refs/heads/devices/"
DEVICE_ID_PATTERN = r"[A-Za-z0-9._~-]+(?:/[A-Za-z0-9._~-]+)*"

_DEVICE_ID_RE = re.compile(DEVICE_ID_PATTERN)
# What an encoded device id may look like: kept characters and upper-case %XX escapes only.
_ENCODED_RE = re.compile(r"(?:[A-Za-z0-9._-]|%[0-9A-F]{2})+")
# An encoded device id that is the id itself: no dot, no escape (`branch_component` keeps
# every character of such an id, and it is a valid one).
_PLAIN_RE = re.compile(r"[A-Za-z0-9_-]+")
FULL_OID_RE = re.compile(r"[0-9a-f]{40}")
_FILE_MODE = b"100644"
_TREE_MODE = b"40000"


class GitStoreError(RuntimeError):
    """The fleet-state repository could not be opened, locked, read or written."""


class InvalidCommitError(GitStoreError, ValueError):
    """A `DeviceCommit` is malformed; raised before anything is written."""


@dataclass(frozen=True, slots=True)
class DeviceCommit:
    """One new commit on a device branch.

    `files` plus `kept` is the COMPLETE new tree: files absent from both are removed. `files`
    maps flat names to content; `kept` maps names to the ids of blobs already stored in the
    repository (e.g. from `tree_ids`), so files a compile leaves as they are need not be read
    or sent again. `message` is written verbatim (UTF-8), `timestamp` is the author and
    committer time (UTC).

    With `parent_known`, `parent` is the branch tip the caller computed this tree from
    (None: the device had no branch) and the commit builds on it; otherwise the store reads
    the tip itself. Either way the branch moves only if it still points there.

    With `on_parent` (which needs a known `parent`), the commit is a change to the parent's
    tree instead: `files` and `kept` are written into it and the names in `removed` are
    deleted; everything else stays as it is. Why: a compile that re-renders one intent
    changes one file of a device's tree, and sending only that costs less than the tree.

    With `branch_lost` (which needs a known `parent`), the device's branch is gone (its ref
    lost from the repository) and `parent` is the commit it was last left at, still stored:
    the commit builds on it and the branch is created (it must not exist). Why: a rebuilt
    branch that continues its history is a fast-forward for a device following it over
    Git, whose rollback protection would refuse a new history.
    """

    device_id: str
    files: Mapping[str, bytes]
    message: str
    timestamp: int
    kept: Mapping[str, str] = field(default_factory=dict)
    parent: str | None = None
    parent_known: bool = False
    on_parent: bool = False
    removed: Collection[str] = ()
    branch_lost: bool = False
    #: The commit's objects already made and deflated (`packed_commit`), `files`
    #: then empty: written as they are, on its known `parent`.
    packed: PackedCommit | None = None


@dataclass(frozen=True, slots=True)
class PackedCommit:
    """A commit's new objects as pack entries (its files, its tree, itself) and its id."""

    commit: str
    objects: PackedObjects


# --- device ids <-> ref names -------------------------------------------------------------


# A *plain* device id: segments of ``[A-Za-z0-9_-]`` joined by single dots, not ending in
# ``.lock``, short enough for both bounds. Such an id is a valid `DEVICE_ID` and is its own
# branch component (`branch_component` keeps every character of it), which a regular
# expression tells in C. Why: the encoding and the checks cost a few microseconds per id in
# Python, and their memo (an LRU of 32,768 ids) misses on every id of a larger fleet, which
# made the id checks most of a no-op recompile of 100,000 devices (a test holds the
# shortcut to the full rules).
_PLAIN_MAX = min(MAX_DEVICE_ID, MAX_REF_COMPONENT)
_PLAIN_ID = (rf"(?=.{{1,{_PLAIN_MAX}}}\Z)(?!.*\.lock\Z)"
             r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
_PLAIN_ID_RE = re.compile(_PLAIN_ID, re.DOTALL)
_PLAIN_CHARS_RE = re.compile(r"[A-Za-z0-9_.\n-]*")


def all_plain_device_ids(device_ids: Collection[str]) -> bool:
    """Whether every id is a plain one (see `_PLAIN_ID`): valid, and its own branch
    component. Asked of a whole fleet at once with a few scans in C (one character class,
    substring searches over the ids joined by line breaks), so 100,000 ids cost
    milliseconds, where one regular expression with groups took 40 ms; False leaves the
    caller to check each id in full."""
    if not device_ids:
        return True
    try:
        text = "\n" + "\n".join(device_ids) + "\n"
    except TypeError:  # not all strings
        return False
    return (text.count("\n") == len(device_ids) + 1  # no id holds a line break
            and _PLAIN_CHARS_RE.fullmatch(text) is not None
            and max(map(len, device_ids)) <= _PLAIN_MAX
            and not any(part in text for part in ("\n\n", "\n.", ".\n", "..", ".lock\n")))


def device_ref(device_id: str) -> str:
    """The branch of `device_id`: ``refs/heads/devices/<encoded>``.

    The whole id becomes ONE ref component (`margo.identifiers.branch_component` has the
    encoding), so a gateway ``gw`` and its child ``gw/child`` can both have branches.
    Everything Git forbids in a ref name is thereby avoided. Any id of the standard's
    syntax has a name; the store only writes and reads the branches of ids that are also
    within `margo.identifiers.DEVICE_ID`'s bounds (see `branch_problem`).
    """
    if isinstance(device_id, str) and _PLAIN_ID_RE.fullmatch(device_id):
        return DEVICE_REF_PREFIX + device_id  # its own component: nothing to encode
    return _encoded_ref(device_id)


@functools.lru_cache(maxsize=32_768)  # ids with characters to encode, looked up again
def _encoded_ref(device_id: str) -> str:
    """`device_ref` of an id that is not plain (or not an id at all: ValueError)."""
    if not isinstance(device_id, str) or not _DEVICE_ID_RE.fullmatch(device_id):
        raise ValueError(f"not a Margo device id (expected {DEVICE_ID_PATTERN}): "
                         f"{short_repr(device_id)}")
    return DEVICE_REF_PREFIX + branch_component(device_id)


def branch_problem(device_id: object) -> str | None:
    """Why the store can hold no branch for `device_id`, or None: it must be a valid
    `margo.identifiers.DEVICE_ID`, whose bounds keep the branch name a file a clone can
    write (``<component>.lock``) and a ref libgit2 can look up (1,024 bytes at most).
    A plain id (`_PLAIN_ID`) is one without asking the full rules."""
    if not isinstance(device_id, str):
        return f"a device id must be a string, found {type(device_id).__name__}"
    if _PLAIN_ID_RE.fullmatch(device_id):
        return None
    return device_id_problem(device_id)


def device_id_from_ref(ref: str) -> str | None:
    """The device id a ref belongs to, or None for refs that are not device branches.

    Only the exact encoding `device_ref` produces is accepted (so ``%2f`` or a needless
    ``%41`` is not a device branch): every device has exactly one branch name.
    """
    if not ref.startswith(DEVICE_REF_PREFIX):
        return None
    encoded = ref[len(DEVICE_REF_PREFIX):]
    if _PLAIN_RE.fullmatch(encoded):  # (most ids: a million refs in 0.3 s instead of 3)
        return encoded
    if not _ENCODED_RE.fullmatch(encoded):
        return None
    try:
        device_id = urllib.parse.unquote(encoded, errors="strict")
    except UnicodeDecodeError:
        return None
    if not _DEVICE_ID_RE.fullmatch(device_id) or branch_component(device_id) != encoded:
        return None
    return device_id


def device_ids_from_refs(refs: Collection[str]) -> frozenset[str]:
    """`device_id_from_ref` of every ref, the refs that are no device branch left out.
    Why: a replica tells the devices of a million moved refs after each full compile (0.8 s
    one by one); when every ref is a device branch named by a plain id (its own branch
    component: `all_plain_device_ids`), the usual fleet, that id is the device, told with
    a few scans in C over the names joined by line breaks; otherwise one by one."""
    names = list(refs)
    joined = "\n" + "\n".join(names)
    if (joined.count("\n") == len(names)  # no name holds a line break
            and joined.count("\n" + DEVICE_REF_PREFIX) == len(names)):
        ids = [name[len(DEVICE_REF_PREFIX):] for name in names]
        if all_plain_device_ids(ids):
            return frozenset(ids)
    return frozenset(d for d in map(device_id_from_ref, names) if d is not None)


def blob_id(data: bytes) -> str:
    """The Git blob id of `data`, computed without writing anything.

    Compare ``{name: blob_id(content)}`` with `DeviceStore.tree_ids` to skip unchanged trees.
    """
    return str(pygit2.hash(data))


def tree_id_of(ids: Mapping[str, str]) -> str:
    """The id of the tree `DeviceStore.write` stores for flat files with these blob ids
    (name -> `blob_id`), computed without writing anything.

    Why: a compile learns the tree ids of the trees it commits without reading 10,000 refs
    back after the write. Entries are ordered by the bytes of their names, as Git orders
    the entries of a tree of plain files (names are validated flat: no ``/``).
    """
    return flat_tree_of(ids)[1].hex()


def flat_tree_of(ids: Mapping[str, str]) -> tuple[bytes, bytes]:
    """The raw flat tree of these blob ids (name -> hex id) and its binary id: what
    `tree_id_of` names and `packed_commit` packs, worked out once where a compile needs
    both (a device it commits)."""
    # Sorted as strings: UTF-8 keeps the order of code points, so it is the order of the
    # names' bytes (a name UTF-8 cannot encode fails, as it must).
    body = flat_tree({name: bytes.fromhex(oid) for name, oid in ids.items()})
    return body, hashlib.sha1(b"tree %d\0%s" % (len(body), body), usedforsecurity=False).digest()


#: Name -> the bytes its tree entry starts with (`tree_id_of`): a fleet's trees reuse a
#: few dozen names, and a compile works out two tree ids per device it compiles.
_TREE_ENTRY_PREFIXES: dict[str, bytes] = {}


def _tree_entry_prefix(name: str) -> bytes:
    """``100644 <name>\\0``, remembered (up to 4,096 names: then started afresh)."""
    prefix = b"100644 %s\0" % name.encode("utf-8")
    if len(_TREE_ENTRY_PREFIXES) >= 4096:
        _TREE_ENTRY_PREFIXES.clear()
    _TREE_ENTRY_PREFIXES[name] = prefix
    return prefix


# --- validation -------------------------------------------------------------------------


_BLOB_MODE = b"100644"


def plain_files(tree: bytes, oid_size: int) -> tuple[dict[str, str], bool]:
    """Name -> blob id of the plain files of a raw tree object, and whether it holds
    anything else (subtrees, executables, links, names a compile cannot write: not UTF-8,
    or with a newline).

    Why not pygit2's `Tree`: it builds an object per entry, three times the cost of
    reading the format, and a compile reads one tree per device. The format is Git's
    documented one: entries of ``<octal mode> <name>\\0<binary object id>``.
    """
    ids: dict[str, str] = {}
    foreign = False
    for mode, raw_name, oid in tree_entries(tree, oid_size):
        if mode == _BLOB_MODE:
            try:
                name = raw_name.decode("utf-8")
            except UnicodeDecodeError:
                name = ""
            if name and _file_name_problem(name) is None:
                ids[name] = oid.hex()
            else:
                foreign = True  # a name no compile writes (nor could send back to Git)
        else:
            foreign = True
    return ids, foreign


def tree_entries(tree: bytes, oid_size: int) -> Iterator[tuple[bytes, bytes, bytes]]:
    """(mode, name, binary id) of each entry of a raw tree object, in its order."""
    position, end = 0, len(tree)
    while position < end:
        space, nul = tree.find(b" ", position), tree.find(b"\0", position)
        oid_end = nul + 1 + oid_size
        if not 0 <= space < nul or oid_end > end:
            raise GitStoreError(f"malformed tree object (entry at byte {position})")
        yield tree[position:space], tree[space + 1:nul], tree[nul + 1:oid_end]
        position = oid_end


def check_commit(commit: DeviceCommit) -> None:
    """Reject what Git or a device's checkout could not represent faithfully (the first
    problem found, in this order: the branch, the commit's own fields, the files written,
    the parent, the names removed and kept)."""
    _check_branch(commit.device_id)
    where = f"device {commit.device_id!r}"
    _check_header(commit, where)
    _check_written(commit, where)
    _check_parent(commit, where)
    _check_removed(commit, where)
    _check_kept(commit, where)


def _check_branch(device_id: str) -> None:
    try:
        device_ref(device_id)
    except (ValueError, TypeError) as exc:
        raise InvalidCommitError(str(exc)) from None
    problem = branch_problem(device_id)
    if problem is not None:  # a branch nobody could fetch or look up again
        raise InvalidCommitError(f"no branch for device {short_repr(device_id)}: {problem}")


def _check_header(commit: DeviceCommit, where: str) -> None:
    if isinstance(commit.timestamp, bool) or not isinstance(commit.timestamp, int):
        raise InvalidCommitError(f"{where}: timestamp must be an int, got {commit.timestamp!r}")
    if commit.timestamp < 0:
        raise InvalidCommitError(f"{where}: timestamp must not be negative")
    if not isinstance(commit.message, str):
        raise InvalidCommitError(f"{where}: message must be a str")
    _check_utf8(commit.message, f"{where}: message")


def _check_written(commit: DeviceCommit, where: str) -> None:
    if not isinstance(commit.files, Mapping):
        raise InvalidCommitError(f"{where}: files must be a mapping of name -> bytes")
    for name, content in commit.files.items():
        _check_file_name(name, where)
        if not isinstance(content, bytes):
            raise InvalidCommitError(f"{where}: content of {name!r} must be bytes, "
                                     f"got {type(content).__name__}")


def _check_parent(commit: DeviceCommit, where: str) -> None:
    if commit.parent_known and commit.parent is not None and (
            not isinstance(commit.parent, str) or not FULL_OID_RE.fullmatch(commit.parent)):
        raise InvalidCommitError(f"{where}: parent must be a full commit id or None, "
                                 f"got {commit.parent!r}")
    if commit.branch_lost and (not commit.parent_known or commit.parent is None):
        raise InvalidCommitError(f"{where}: restoring a lost branch needs the commit it "
                                 "was at as a known parent")
    if commit.on_parent and (not commit.parent_known or commit.parent is None):
        raise InvalidCommitError(f"{where}: a change on the parent's tree needs a known parent")
    if commit.packed is not None and (not commit.parent_known or commit.files):
        raise InvalidCommitError(f"{where}: a packed commit needs a known parent and no "
                                 "files besides its objects")


def _check_removed(commit: DeviceCommit, where: str) -> None:
    if not commit.on_parent and commit.removed:
        raise InvalidCommitError(f"{where}: removed names need on_parent (otherwise files "
                                 "and kept are the whole tree)")
    if isinstance(commit.removed, str | bytes):
        raise InvalidCommitError(f"{where}: removed must be a collection of file names")
    for name in commit.removed:
        _check_file_name(name, where)
        if name in commit.files or name in commit.kept:
            raise InvalidCommitError(f"{where}: {name!r} is both removed and written")


def _check_kept(commit: DeviceCommit, where: str) -> None:
    if not isinstance(commit.kept, Mapping):
        raise InvalidCommitError(f"{where}: kept must be a mapping of name -> blob id")
    for name, oid in commit.kept.items():
        _check_file_name(name, where)
        if name in commit.files:
            raise InvalidCommitError(f"{where}: {name!r} is both written and kept")
        if not isinstance(oid, str) or not FULL_OID_RE.fullmatch(oid):
            raise InvalidCommitError(f"{where}: kept {name!r} must name a full blob id, "
                                     f"got {oid!r}")


def _check_file_name(name: object, where: str) -> None:
    """Flat names only; no names Git stores badly or a device's checkout would refuse."""
    if not isinstance(name, str) or not name:
        raise InvalidCommitError(f"{where}: file names must be non-empty strings, got {name!r}")
    problem = _file_name_problem(name)
    if problem is not None:
        raise InvalidCommitError(f"{where}: {problem}")


@functools.lru_cache(maxsize=4096)  # a fleet's trees reuse a few dozen names
def _file_name_problem(name: str) -> str | None:
    """What is wrong with a non-empty file name, or None."""
    bad = sorted({c for c in name if c in "/\0\n"})
    if bad:
        return f"file name {name!r} contains {bad!r}"
    if name in (".", "..") or name.lower() == ".git":
        return f"{name!r} cannot be a file name"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"file name {name!r} is not encodable as UTF-8: {exc}"
    return None


def _check_utf8(text: str, what: str) -> None:
    """Lone surrogates cannot be encoded; catch them before a half-written stream."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidCommitError(f"{what} is not encodable as UTF-8: {exc}") from None


# --- objects ------------------------------------------------------------------------------


def flat_tree(ids: Mapping[str, bytes]) -> bytes:
    """The raw tree object of plain files (name -> binary blob id): what `tree_id_of`
    names, ordered by the bytes of the names."""
    prefixes = _TREE_ENTRY_PREFIXES
    parts: list[bytes] = []
    for name in sorted(ids):
        prefix = prefixes.get(name)
        if prefix is None:
            prefix = _tree_entry_prefix(name)
        parts += (prefix, ids[name])
    return b"".join(parts)


def changed_tree(tree: bytes, oid_size: int, files: Mapping[str, bytes],
                 removed: Collection[str]) -> bytes:
    """A raw tree object changed: the names of `files` (name -> binary blob id) become
    plain files, whatever they were, the names in `removed` go; every other entry
    (subtrees, links, executables included) stays as it is, in Git's order (a subtree
    sorts as if its name ended in ``/``)."""
    entries = {name: (mode, oid) for mode, name, oid in tree_entries(tree, oid_size)}
    for name in removed:
        entries.pop(name.encode("utf-8"), None)
    for name, oid in files.items():
        entries[name.encode("utf-8")] = (_FILE_MODE, oid)
    order = sorted(entries, key=lambda n: n + b"/" if entries[n][0] == _TREE_MODE else n)
    return b"".join(b"%s %s\0%s" % (entries[n][0], n, entries[n][1]) for n in order)


def packed_commit(device_id: str, files: Mapping[str, bytes], ids: Mapping[str, str],
                  parent: str | None, message: str, timestamp: int,
                  author: tuple[str, str], *,
                  tree: tuple[bytes, bytes] | None = None) -> PackedCommit:
    """A commit's objects made and deflated: the blobs of `files`, the flat tree of `ids`
    (every file of it, name -> blob id) and the commit on `parent`. Why: a compile's worker
    processes make them, each on its own core, and the process writing the pack only
    copies them (`compiler.gitstore.DeviceStore.write_objects`, which validates the rest
    of the commit); the names are checked here, since only the objects cross. `tree`:
    `flat_tree_of(ids)`, when the caller has it already."""
    where = f"device {device_id!r}"
    for name in ids:
        _check_file_name(name, where)
    body, tree_id = flat_tree_of(ids) if tree is None else tree
    ident = f"{author[0]} <{author[1]}> {timestamp} +0000"
    objects = PackedObjects.of([
        *((BLOB, files[name], bytes.fromhex(ids[name])) for name in files),
        (TREE, body, tree_id),
        (COMMIT, commit_object(tree_id.hex(), parent, ident, message), None)])
    return PackedCommit(objects.last_id.hex(), objects)


def commit_object(tree: str, parent: str | None, ident: str, message: str) -> bytes:
    """A raw commit object as Git writes one: its tree, its parent if any, author and
    committer, a blank line, the message verbatim."""
    lines = [f"tree {tree}\n"]
    if parent is not None:
        lines.append(f"parent {parent}\n")
    lines.append(f"author {ident}\ncommitter {ident}\n\n")
    return "".join(lines).encode("utf-8") + message.encode("utf-8")
