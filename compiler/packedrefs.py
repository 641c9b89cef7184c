"""Move many refs of a repository at once by rewriting its ``packed-refs`` file.

Why not ``git update-ref --stdin``: Git 2.39 (Debian's) writes every updated ref as a loose
file, one lock file, write and rename each. Moving the 956 branches of a recompile that way
measured 0.27-0.47 s on this machine's ext4 disk (inode allocation, and the writeback a
rename over an existing file starts), more than compiling those devices. Rewriting the one
``packed-refs`` file of 10,000 refs takes milliseconds, and a single rename publishes every
move at once: readers never see half a compile, which the loose transaction cannot promise.
No library offers this (dulwich's packed write has no compare-and-swap and deletes loose refs
before it writes); the format is Git's documented one (``gitrepository-layout``), written
exactly as ``git pack-refs`` writes it and locked with Git's own ``packed-refs.lock`` protocol,
so Git, libgit2 and this module can take turns on the same repository.

The file this process wrote last (known by its identity, `FileIdentity`) is not checked and
parsed again: the moved lines are spliced into its bytes (`_merged`), which gives the bytes
a full rewrite gives; any other file is read in full.

A loose ref shadows its packed entry, so the refs being moved must not be loose: `move_refs`
reports those that are (`LooseRefsError`) and the caller packs them with ``git pack-refs``
(which keeps every value) before trying again.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from compiler.remembered import Remembered
from compiler.stalelocks import recover_stale_locks

__all__ = [
    "FileIdentity",
    "LooseRefsError",
    "PackedRefsError",
    "RefMovedError",
    "canonical_refs",
    "copy_refs",
    "follow_moves",
    "has_loose_refs",
    "install_refs",
    "move_refs",
    "packed_ref_names",
    "packed_refs_identity",
    "ref_names",
    "ref_targets",
    "rendered_refs",
    "replace_refs",
    "take_last_move",
]

PACKED_REFS = "packed-refs"
_LOCK_SUFFIX = ".lock"
_HEADER_PREFIX = b"# pack-refs with:"
# Written by `git pack-refs` since 2.x; "sorted" is what we guarantee, the peel traits are only
# claimed for a file that claimed them already (or a new one: branches at commits need no peel).
_TRAITS = (b"peeled", b"fully-peeled", b"sorted")
_OID = rb"[0-9a-f]{40}"
_REF_LINE = _OID + rb" refs/[^ \n]+"
_PEEL_LINE = rb"\^" + _OID
_OID_RE, _REF_RE, _PEEL_RE = (re.compile(p) for p in (_OID, _REF_LINE, _PEEL_LINE))
# Every line after the header: a ref line, each optionally followed by its peeled id.
_HEX_LINES_RE = re.compile(rb"[0-9a-f\n]*")
_ENTRIES_RE = re.compile(rb"(?:%s\n(?:%s\n)?)*" % (_REF_LINE, _PEEL_LINE))
# Git gives up on a held packed-refs.lock after one second (core.packedRefsTimeout).
LOCK_TIMEOUT = 1.0
#: What tells one ``packed-refs`` file from another without reading it: (device, inode,
#: size, mtime_ns, ctime_ns). Every writer (Git, libgit2, this module) replaces the file by
#: renaming a new one over it, so a rewrite is a new inode with new times: what Git's own
#: cache of the file checks (``stat_validity``).
FileIdentity = tuple[int, int, int, int, int]


def _identity(fd: int) -> FileIdentity:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: The ref names of the ``packed-refs`` this process last read or wrote, under the file's
#: identity: listing 100,000 refs costs 40-130 ms (libgit2, or parsing), a `stat` nothing.
_PACKED_NAMES: Remembered[frozenset[str]] = Remembered()
#: True under the identity of the ``packed-refs`` this process last wrote: a file in the
#: canonical form `_render` gives, which the next move can splice into (`_merged`).
_OWN: Remembered[bool] = Remembered()
#: The last `move_refs` of this process, under the identity of the file it wrote: the
#: identity of the file it replaced and the updates (`take_last_move`).
_MOVES: Remembered[tuple[FileIdentity | None, Mapping[str, tuple[str | None, str | None]]]] = (
    Remembered())
_FOLLOWED: set[Path] = set()


def ref_names(git_dir: str | os.PathLike[str]) -> frozenset[str]:
    """The name of every ref of the repository: those of ``packed-refs`` (remembered while
    the file keeps its identity, `FileIdentity`) and the loose files under ``refs/``,
    listed each time (usually none: this module writes packed refs). PackedRefsError for
    a ``packed-refs`` not in Git's format."""
    path = Path(git_dir) / PACKED_REFS
    identity = packed_refs_identity(git_dir)
    packed = frozenset() if identity is None else _PACKED_NAMES.get(path, identity)
    if packed is None:
        identity, packed = packed_ref_names(git_dir)
        _PACKED_NAMES.put(path, identity, packed)
    loose = _loose_ref_names(Path(git_dir))
    return packed | loose if loose else packed


def packed_refs_identity(git_dir: str | os.PathLike[str]) -> FileIdentity | None:
    """The identity of the repository's ``packed-refs`` (None: there is none): what a
    listing of it is remembered under (a rewrite is a new file)."""
    try:
        st = os.stat(Path(git_dir) / PACKED_REFS)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def has_loose_refs(git_dir: str | os.PathLike[str]) -> bool:
    """Whether any ref is a loose file under ``refs/`` (which wins over its packed entry)."""
    return bool(_loose_ref_names(Path(git_dir)))


def _loose_ref_names(git_dir: Path) -> frozenset[str]:
    """The ref files under ``refs/`` (lock files aside), by name."""
    found: list[str] = []
    pending = ["refs"]
    while pending:
        directory = pending.pop()
        try:
            entries = os.scandir(git_dir / directory)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(f"{directory}/{entry.name}")
                elif not entry.name.endswith(_LOCK_SUFFIX):
                    found.append(f"{directory}/{entry.name}")
    return frozenset(found)


def packed_ref_names(git_dir: str | os.PathLike[str]) -> tuple[FileIdentity | None,
                                                              frozenset[str]]:
    """The identity of the ``packed-refs`` file (None: there is none) and the name of each
    ref it holds, read from one open file (name and identity agree, whoever replaces the
    file meanwhile). PackedRefsError for a file not in Git's format."""
    try:
        fd = os.open(Path(git_dir) / PACKED_REFS, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, frozenset()
    with os.fdopen(fd, "rb") as handle:
        identity, data = _identity(fd), handle.read()
    lines = data.split(b"\n")
    refs = [line for line in lines[:-1] if not line.startswith((b"^", b"#"))]
    if lines[-1] or not all(len(line) > 41 and line[40:41] == b" " for line in refs):
        raise PackedRefsError(f"{git_dir}/{PACKED_REFS}: not in Git's packed format")
    names = b"\n".join([line[41:] for line in refs])
    return identity, frozenset(names.decode().split("\n")) if names else frozenset()


class PackedRefsError(RuntimeError):
    """No ref was moved; the message says why."""


class RefMovedError(PackedRefsError):
    """A ref is not where the caller expected it: it moved, appeared or vanished."""


class LooseRefsError(PackedRefsError):
    """Some refs to move exist as loose files (which would shadow the packed entries)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(f"{len(names)} ref(s) are loose files, not packed: {shown}")


def move_refs(git_dir: str | os.PathLike[str],
              updates: Mapping[str, tuple[str | None, str | None]],
              *, timeout: float = LOCK_TIMEOUT,
              ) -> tuple[FileIdentity | None, FileIdentity] | None:
    """Point each ref name at its new object id if it still points at its old one (old
    None: the ref must not exist yet; new None: delete the ref), all or nothing: one atomic
    rename of ``packed-refs``. Returns the identity of the file it replaced (None: none)
    and of the one it wrote, which holds exactly the refs of the other with the updates
    applied (None: nothing to update).

    The new file reaches the disk before it replaces the old one, so a crash leaves the old
    refs or the new ones, never an empty file, and a caller recording the move afterwards
    (the compiler's state) never records one the disk could lose. Raises `LooseRefsError`,
    `RefMovedError` or `PackedRefsError` with nothing changed.
    """
    git_dir = Path(git_dir)
    _check_updates(updates)
    if not updates:
        return None
    with _locked(git_dir / PACKED_REFS, timeout) as lock_fd:
        _refuse_loose(git_dir, updates)
        replaced, current = _read(git_dir / PACKED_REFS)
        merged = _merged(git_dir / PACKED_REFS, replaced, current, updates)
        data, names = merged or _rewritten(git_dir / PACKED_REFS, current, updates)
        os.write(lock_fd, data)
        os.fsync(lock_fd)
        os.replace(git_dir / (PACKED_REFS + _LOCK_SUFFIX), git_dir / PACKED_REFS)
        written = _identity(lock_fd)  # (its times as renamed)
    # Its names and its form are known: what the next listing and move start from (the
    # same set as before when only moved, so what callers worked out from it stays valid).
    before = _PACKED_NAMES.get(git_dir / PACKED_REFS, replaced)
    if before is not None and before is not names and before == names:
        names = before
    if names is None:  # a name not in UTF-8, which only someone else could have written
        _PACKED_NAMES.forget()
        _OWN.forget()
    else:
        _PACKED_NAMES.put(git_dir / PACKED_REFS, written, names)
        _OWN.put(git_dir / PACKED_REFS, written, True)
    if (git_dir / PACKED_REFS).absolute() in _FOLLOWED:
        _MOVES.put(git_dir / PACKED_REFS, written, (replaced, updates))
    return replaced, written


def follow_moves(git_dir: str | os.PathLike[str]) -> None:
    """Remember each `move_refs` of this repository's refs until `take_last_move` takes
    it (only of repositories followed: the updates of a million moves are a hundred
    megabytes)."""
    _FOLLOWED.add((Path(git_dir) / PACKED_REFS).absolute())


def take_last_move(git_dir: str | os.PathLike[str], identity: FileIdentity | None,
                   ) -> tuple[FileIdentity | None, Mapping[str, tuple[str | None, str | None]]
                              ] | None:
    """The move (`move_refs`) by which this process wrote the ``packed-refs`` of
    `identity`: the identity of the file it replaced and its updates (old, new; None:
    absent), forgotten once taken; None when another move or writer came since, or the
    repository is not followed (`follow_moves`). Why: a caller that listed the replaced
    file's refs knows the new file's without reading it (a million refs: 1.3 s checked and
    parsed, 2-3 s beside a compile's end)."""
    move = _MOVES.get(Path(git_dir) / PACKED_REFS, identity)
    if move is not None:
        _MOVES.forget()
    return move


def replace_refs(git_dir: str | os.PathLike[str], expected: FileIdentity | None,
                 targets: Mapping[str, str], *, timeout: float = LOCK_TIMEOUT) -> FileIdentity:
    """Write `targets` (every ref name and its object id) as the whole ``packed-refs``, if
    the file is still the one of identity `expected` (None: there is none); the identity of
    the file written. One atomic rename, like `move_refs`, for a caller that knows every
    ref of that file (it listed them under that identity: `ref_targets`).

    Why: a replica moving its served copy to a million moved refs spent 2-3 s checking
    and parsing the file it had listed already, then each move against it; this renders
    the new file from the caller's refs. `RefMovedError` when the file is another one,
    `LooseRefsError` when any ref is a loose file (it would shadow its entry), nothing
    changed either way."""
    git_dir = Path(git_dir)
    if not _valid(targets, list(targets.values())):
        _check_updates({name: (None, target) for name, target in targets.items()})
    return _replace_file(git_dir, expected, lambda fd: _write_all(fd, _rendered(targets)),
                         timeout)


def copy_refs(source_dir: str | os.PathLike[str], source: FileIdentity,
              git_dir: str | os.PathLike[str], expected: FileIdentity | None, *,
              timeout: float = LOCK_TIMEOUT) -> FileIdentity:
    """Make the ``packed-refs`` of `source_dir`, while it is the file of identity `source`,
    the whole ``packed-refs`` of `git_dir`, if that is still the file of `expected` (None:
    there is none), byte for byte; the identity of the file written. One atomic rename,
    like `replace_refs`.

    Why: the replica that compiles serves a copy of the repository it compiles into, and
    after its publication both hold the same refs; rendering a million of them again took
    2.7-3 s beside the other replica's sync, where the kernel copies the file in a tenth of
    that. `RefMovedError` when either file is another one, `LooseRefsError` when a ref of
    either repository is a loose file (it would shadow its entry), nothing changed either
    way."""
    source_dir = Path(source_dir)

    def copy(lock_fd: int) -> None:
        try:
            fd = os.open(source_dir / PACKED_REFS, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RefMovedError(f"{source_dir / PACKED_REFS} is gone") from None
        try:
            if _identity(fd) != source:  # (every writer renames: this fd's file is fixed)
                raise RefMovedError(f"{source_dir / PACKED_REFS} was rewritten meanwhile")
            _copy_whole(fd, lock_fd, source[2])
        finally:
            os.close(fd)

    return _replace_file(git_dir, expected, copy, timeout, also=source_dir)


def rendered_refs(targets: Mapping[str, str]) -> bytes:
    """The whole ``packed-refs`` file holding `targets` (names and object ids), as
    `replace_refs` and `move_refs` write it: what `canonical_refs` accepts."""
    if not _valid(targets, list(targets.values())):
        _check_updates({name: (None, target) for name, target in targets.items()})
    return _rendered(targets)


def canonical_refs(data: bytes) -> dict[str, str]:
    """The refs of a whole ``packed-refs`` file in the form this module writes (its
    header, ref lines sorted by name, no peel lines), checked as a whole: `PackedRefsError`
    for anything else. Why: a replica installs a file another replica published as it is
    (`install_refs`) and must not hand Git one it would misread (an unsorted file claiming
    "sorted" makes Git's binary search miss refs)."""
    header = _header(_TRAITS)
    if not data.startswith(header):
        raise PackedRefsError("a published ref list does not start with the header "
                              f"{header.decode().strip()!r}")
    try:
        lines = data[len(header):].decode().split("\n")
    except UnicodeDecodeError as exc:
        raise PackedRefsError(f"a published ref list is not UTF-8: {exc}") from None
    ids, names = [line[:40] for line in lines[:-1]], [line[41:] for line in lines[:-1]]
    if lines[-1] or not _valid(names, ids) or any(line[40:41] != " " for line in lines[:-1]):
        raise PackedRefsError(_first_bad_line(data, Path("published ref list")))
    targets = dict(zip(names, ids, strict=True))
    if len(targets) != len(names) or sorted(names) != names:  # (C passes)
        raise PackedRefsError("a published ref list is not sorted by name, once each")
    return targets


def install_refs(git_dir: str | os.PathLike[str], expected: FileIdentity | None,
                 data: bytes, *, timeout: float = LOCK_TIMEOUT) -> FileIdentity:
    """Write `data`, a whole file `canonical_refs` accepted, as the ``packed-refs`` of
    `git_dir` if that is still the file of identity `expected` (None: there is none); the
    identity of the file written. One atomic rename, like `replace_refs`, with its
    errors."""
    return _replace_file(git_dir, expected, lambda fd: _write_all(fd, data), timeout)


def _replace_file(git_dir: str | os.PathLike[str], expected: FileIdentity | None,
                  write: Callable[[int], None], timeout: float, *,
                  also: Path | None = None) -> FileIdentity:
    """The whole ``packed-refs`` of `git_dir` replaced by what `write` writes to Git's
    lock file, if it is still the file of identity `expected` and no ref of `git_dir` (nor
    of the repository `also`) is a loose file; fsynced, then one rename. The identity of
    the file written; `RefMovedError` or `LooseRefsError` with nothing changed."""
    git_dir = Path(git_dir)
    with _locked(git_dir / PACKED_REFS, timeout) as lock_fd:
        loose = _loose_ref_names(git_dir) | (_loose_ref_names(also) if also else frozenset())
        if loose:
            raise LooseRefsError(sorted(loose))
        if packed_refs_identity(git_dir) != expected:
            raise RefMovedError(f"{git_dir / PACKED_REFS} was rewritten by someone else")
        write(lock_fd)
        os.fsync(lock_fd)
        os.replace(git_dir / (PACKED_REFS + _LOCK_SUFFIX), git_dir / PACKED_REFS)
        return _identity(lock_fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _copy_whole(source_fd: int, target_fd: int, size: int) -> None:
    """`size` bytes from the start of one file to the end of another, in the kernel."""
    offset = 0
    while offset < size:
        copied = os.copy_file_range(source_fd, target_fd, size - offset, offset)
        if copied == 0:
            raise RefMovedError("packed-refs ended before its size")  # (never renamed over)
        offset += copied


def _rendered(targets: Mapping[str, str]) -> bytes:
    """`_render` of refs given as names and ids (branches at commits: no peel lines)."""
    # (code point order is UTF-8's byte order: the order Git reads the file in)
    return _header(_TRAITS) + "".join(
        [f"{targets[name]} {name}\n" for name in sorted(targets)]).encode()


def _rewritten(path: Path, current: bytes, updates: Mapping[str, tuple[str | None, str | None]],
               ) -> tuple[bytes, frozenset[str] | None]:
    """The file with the updates applied, from `current` checked and parsed whole, and the
    names it holds (None if one is not UTF-8: a file nothing is remembered of)."""
    traits, entries = _parse(current, path)
    for name, (old, new) in updates.items():
        entry = entries.get(name.encode())
        _expect(name, None if entry is None else entry[:40].decode(), old)
        if new is None:
            entries.pop(name.encode(), None)
        else:
            entries[name.encode()] = f"{new} {name}\n".encode()
    try:
        names = b"\n".join(entries).decode()
    except UnicodeDecodeError:
        return _render(traits, entries), None
    return _render(traits, entries), frozenset(names.split("\n")) if names else frozenset()


def _expect(name: str, found: str | None, old: str | None) -> None:
    if found != old:
        raise RefMovedError(f"{name} is at {found or 'nothing'}, expected {old or 'nothing'}")


def _merged(path: Path, identity: FileIdentity | None, current: bytes,
            updates: Mapping[str, tuple[str | None, str | None]],
            ) -> tuple[bytes, frozenset[str]] | None:
    """What `_rewritten` gives, made by splicing the updated lines into `current`, or
    None when this cannot be done safely: `current` must be the file this module last
    wrote (`_OWN`, by identity), whose names it remembers (`_PACKED_NAMES`).

    Why: that file is already in the canonical form `_render` writes (checked, sorted,
    its header rewritten), so checking, parsing, sorting and joining its 100,000 lines
    again (0.15-0.3 s at 100,000 devices) would give back the same bytes for every ref
    but the moved ones. Each moved ref is found with one C search from where the previous
    one was (both in name order), a new one by bisecting the lines after it."""
    names = _PACKED_NAMES.get(path, identity)
    if names is None or not _OWN.get(path, identity):
        return None
    parts: list[bytes] = []
    cursor = current.find(b"\n") + 1  # past the header, copied as it is
    copied = 0
    for name in sorted(updates):  # UTF-8 keeps code point order: the file's byte order
        old, new = updates[name]
        encoded = name.encode()
        if name in names:
            at = current.find(b" " + encoded + b"\n", cursor)
            if at < 41 or current[at - 41] != 0x0A:  # not as remembered: trust nothing
                return None
            start, end = at - 40, at + len(encoded) + 2
            if current.startswith(b"^", end):  # its peel line goes with it
                end = current.index(b"\n", end) + 1
            _expect(name, current[start:at].decode(), old)
        else:
            _expect(name, None, old)
            start = end = _insertion_point(current, encoded, cursor, len(current))
            if current.startswith(b" " + encoded + b"\n", start + 40):  # there after all
                return None
        parts.append(current[copied:start])
        if new is not None:
            parts.append(f"{new} {name}\n".encode())
        copied = cursor = end
    parts.append(current[copied:])
    deleted = [name for name, (_, new) in updates.items() if new is None]
    if not deleted and names.issuperset(updates):  # moves only: the very same names, so
        return b"".join(parts), names  # what was worked out from them stays valid
    return b"".join(parts), names.union(updates).difference(deleted)


def _insertion_point(data: bytes, name: bytes, lo: int, hi: int) -> int:
    """The start of the first ref line of `data` in [lo, hi) whose name sorts after `name`
    (hi if none), by bisection over byte offsets; lo and hi start lines, and a peel line
    belongs to the ref line before it."""
    while lo < hi:
        start = data.rfind(b"\n", lo, (lo + hi) // 2) + 1 or lo
        if data.startswith(b"^", start):  # a peel line: its ref line is the one before
            start = data.rfind(b"\n", lo, start - 1) + 1 or lo
        end = data.index(b"\n", start) + 1
        below = data[start + 41:end - 1] < name
        if data.startswith(b"^", end):
            end = data.index(b"\n", end) + 1
        if below:
            lo = end
        else:
            hi = start
    return lo


def _check_updates(updates: Mapping[str, tuple[str | None, str | None]]) -> None:
    """PackedRefsError for a name this module does not write or an id that is not a full
    one. The ids are checked all at once (one match over them joined: 10,000 moves cost
    40 ms checked one by one), each update again only to name the bad one."""
    if not _valid(updates, [oid for pair in updates.values() for oid in pair
                            if oid is not None]):
        for name, (old, new) in updates.items():
            _check_update(name, old, new)


def _valid(names: Iterable[str], ids: list[str]) -> bool:
    """Whether every name is one this module writes and every id a full one, checked all
    at once."""
    if not all(isinstance(oid, str) and len(oid) == 40 for oid in ids):
        return False
    # Forty characters each, of [0-9a-f] only once the line breaks between them are the
    # only ones: one character class scanned in C (a structured pattern took 0.25 s for a
    # million ids, this 0.03 s).
    lines, joined = "\n".join([*ids, ""]).encode(), "".join(names)
    return (_HEX_LINES_RE.fullmatch(lines) is not None and lines.count(b"\n") == len(ids)
            and not any(c in joined for c in " \n\0")
            and all(name.startswith("refs/") for name in names))


def _check_update(name: str, old: str | None, new: str | None) -> None:
    if not name.startswith("refs/") or any(c in name for c in " \n\0"):
        raise PackedRefsError(f"not a ref name this module writes: {name!r}")
    for oid in (o for o in (old, new) if o is not None):
        if not isinstance(oid, str) or not _OID_RE.fullmatch(oid.encode()):
            raise PackedRefsError(f"{name}: not a full object id: {oid!r}")


def _refuse_loose(git_dir: Path, updates: Mapping[str, object]) -> None:
    """Raise `LooseRefsError` for refs to move that exist as files: one directory listing
    per directory involved (a recompile's refs share one), not one stat per ref."""
    by_directory: dict[str, list[str]] = {}
    for name in updates:
        directory, _, leaf = name.rpartition("/")
        by_directory.setdefault(directory, []).append(leaf)
    loose: list[str] = []
    for directory, leaves in by_directory.items():
        try:
            present = set(os.listdir(git_dir / directory))
        except (FileNotFoundError, NotADirectoryError):
            continue
        loose += [f"{directory}/{leaf}" for leaf in leaves if leaf in present]
    if loose:
        raise LooseRefsError(sorted(loose))


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[int]:
    """Hold ``<path>.lock`` (created exclusively, as Git does) and remove it unless it was
    renamed over `path`; retries while another process holds it, up to `timeout`. A lock
    its writer left behind when it was killed (`compiler.stalelocks`: open in no process,
    older than a few seconds) is removed and taken: otherwise one crash would stop every
    later write for good."""
    lock_path = Path(str(path) + _LOCK_SUFFIX)
    deadline = time.monotonic() + timeout
    recovered = False
    while True:
        try:
            fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            if time.monotonic() >= deadline:
                if not recovered and recover_stale_locks(path.parent, candidates=[lock_path]):
                    recovered = True
                    continue
                raise PackedRefsError(
                    f"{lock_path} exists: another Git process is writing the refs (one "
                    "left by a killed writer is removed once no process holds it open and "
                    "it is a few seconds old)") from None
            time.sleep(0.01)
        except OSError as exc:
            raise PackedRefsError(f"cannot create {lock_path}: {exc}") from None
    try:
        yield fd
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
        raise
    finally:
        os.close(fd)


def ref_targets(git_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Every ref under ``refs/`` that names an object, and the object's id: a loose file
    wins over its packed entry, as in Git; symbolic refs are left out. PackedRefsError for a
    ``packed-refs`` not in Git's format. Why not libgit2's listing: it resolves each ref
    again, 0.45 s for 100,000 refs where this reads one file (a replica's publication and
    each replica's sync list a full compile's refs)."""
    path = Path(git_dir) / PACKED_REFS
    _, data = _read(path)
    body = data.partition(b"\n")[2] if data.startswith(_HEADER_PREFIX) else data
    if not _ENTRIES_RE.fullmatch(body):
        raise PackedRefsError(_first_bad_line(data, path))
    targets = {line[41:]: line[:40] for line in body.decode().split("\n")
               if line and not line.startswith("^")}
    for name in _loose_ref_names(Path(git_dir)):
        try:
            content = (Path(git_dir) / name).read_bytes().strip()
        except FileNotFoundError:  # (deleted meanwhile)
            continue
        if _OID_RE.fullmatch(content):
            targets[name] = content.decode()
    return targets


def _read(path: Path) -> tuple[FileIdentity | None, bytes]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, b""
    with os.fdopen(fd, "rb") as handle:
        return _identity(fd), handle.read()


def _parse(data: bytes, path: Path) -> tuple[tuple[bytes, ...], dict[bytes, bytes]]:
    """The header's traits and each ref's lines (its own, plus a ``^`` peel line if any).

    One regular expression checks the whole file (a few ms for 10,000 refs, where checking
    line by line in Python took 15 ms); only a file it rejects is walked to name the line."""
    if not data:
        return _TRAITS, {}
    traits: tuple[bytes, ...] = ()  # a file without a header claims nothing
    body = data
    if data.startswith(_HEADER_PREFIX):
        header, _, body = data.partition(b"\n")
        traits = tuple(t for t in header[len(_HEADER_PREFIX):].split() if t in _TRAITS)
    if not _ENTRIES_RE.fullmatch(body):
        raise PackedRefsError(_first_bad_line(data, path))
    lines = body.splitlines(keepends=True)
    if b"^" not in body:
        return traits, {line[41:-1]: line for line in lines}
    entries: dict[bytes, bytes] = {}
    name = b""  # the pattern puts a ref line before any peel line
    for line in lines:
        if line.startswith(b"^"):
            entries[name] += line
        else:
            name = line[41:-1]
            entries[name] = line
    return traits, entries


def _first_bad_line(data: bytes, path: Path) -> str:
    after_ref = False
    for number, line in enumerate(data.split(b"\n"), start=1):
        if number == 1 and line.startswith(_HEADER_PREFIX):
            continue
        peel = after_ref and _PEEL_RE.fullmatch(line)
        after_ref = not peel and bool(_REF_RE.fullmatch(line))
        if not (peel or after_ref):
            return f"{path}:{number}: not a packed ref line: {line[:80]!r}"
    return f"{path}: does not end with a line break"


def _render(traits: tuple[bytes, ...], entries: Mapping[bytes, bytes]) -> bytes:
    """The file ``git pack-refs`` would write: header, then refs sorted by name bytes."""
    return _header(traits) + b"".join(entries[name] for name in sorted(entries))


def _header(traits: tuple[bytes, ...]) -> bytes:
    """The header line claiming `traits` (those this module knows) and "sorted"."""
    kept = [t for t in _TRAITS if t in traits or t == b"sorted"]
    return _HEADER_PREFIX + b" " + b" ".join(kept) + b" \n"
