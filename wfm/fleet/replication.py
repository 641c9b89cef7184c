"""A bare Git repository replicated through the database: packs and refs per generation.

Replicas of the fleet server keep no shared file system. The replica holding the compile
lease compiles into a repository of its own, then *publishes*: one Git pack of every object
the new refs reach that the previously published refs do not (`git pack-objects --revs`),
and the refs that moved, under the next fleet generation, in one transaction fenced by its
lease epoch (`wfm.fleet.coordination`). Every replica (the compiling one too) *syncs* the
repository it serves: the packs of the generations it lacks go in with `git index-pack`,
then the refs move in one rewrite of `packed-refs` (`compiler.packedrefs`), and only then
does it say it serves that generation. A replica therefore serves exactly one published
generation at a time: Git and REST agree by construction, across replicas too.

Packs accumulate one per generation; every `COMPACT_AFTER` generations the publisher writes
one pack of everything the refs reach instead, and older packs are deleted (a replica that
lacks them starts from that one). The repository a replica serves is rebuilt from the
database alone, so a new replica, or one whose disk was lost, needs nothing else.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from compiler.forkgate import init_bare_repository
from compiler.packedrefs import (
    FileIdentity,
    LooseRefsError,
    RefMovedError,
    canonical_refs,
    copy_refs,
    follow_moves,
    has_loose_refs,
    install_refs,
    move_refs,
    packed_refs_identity,
    ref_targets,
    rendered_refs,
    replace_refs,
    take_last_move,
)
from margo.files import move_atomically, write_atomically
from wfm.store.pack_rows import PackData, mapped, pack_id
from wfm.store.replica_rows import PublishedPack, Snapshot

__all__ = ["COMPACT_AFTER", "Moved", "Published", "RepoReplica", "ref_moves"]

COMPACT_AFTER = 64
_GENERATION_FILE = "margo-generation"
_GIT = ("git", "-c", "core.warnAmbiguousRefs=false")
#: A folder's modification time this old is no longer moved by a file added in its tick.
_SETTLED_NS = 2_000_000_000
#: How a pack index of version 2 starts (Git's `pack-format.txt`).
_INDEX_V2 = b"\377tOc\0\0\0\2"


#: The refs a sync moved (None: deleted); None when the repository was there already.
Moved = Mapping[str, str | None] | None


@dataclass(frozen=True, slots=True)
class Published:
    generation: int
    refs: int
    pack_bytes: int


class RepoReplica:
    """One local bare repository (`path`) and its published history under `repo`."""

    def __init__(self, repo: str, path: Path) -> None:
        self.repo, self.path = repo, Path(path)
        self._generation: int | None = None
        #: Generations whose objects are here already (`link_objects_from`).
        self._linked: set[int] = set()
        #: Folders of another repository's objects, and their modification time when
        #: `link_objects_from` last listed them.
        self._listed: dict[Path, int] = {}
        #: The last listing of the refs, under the identity of the `packed-refs` it read.
        self._refs: tuple[FileIdentity | None, dict[str, str]] | None = None
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            init_bare_repository(self.path)
        follow_moves(self.path)  # (the compile's move of the work repository's branches)

    # --- the local side ----------------------------------------------------------------

    @property
    def generation(self) -> int:
        """The generation this repository holds (-1: none synced yet). Read from its file
        once, then remembered: every manifest a replica serves asks, and this process is
        the file's only writer (the data directory's lock, `wfm.server.datalock`)."""
        if self._generation is None:
            try:
                self._generation = int((self.path / _GENERATION_FILE).read_text().strip())
            except (OSError, ValueError):
                return -1
        return self._generation

    def mark_generation(self, generation: int) -> None:
        write_atomically(self.path / _GENERATION_FILE, f"{generation}\n")
        self._generation = generation

    def refs(self) -> dict[str, str]:
        """Every direct ref under refs/ and its target (`compiler.packedrefs.ref_targets`),
        remembered while `packed-refs` keeps its identity and no ref is a loose file. Why:
        after a full compile the refs were listed three times (the staging, the publication,
        the next compile's start) from the same file: 2-3 s each at a million devices, on
        the way to the first manifest."""
        return dict(self._listing()[1])

    def _listing(self) -> tuple[FileIdentity | None, dict[str, str]]:
        """`refs` and the identity of the `packed-refs` they were read from (the listing
        remembered: the caller must not change it)."""
        identity = packed_refs_identity(self.path)
        remembered = self._refs
        loose = has_loose_refs(self.path)
        if remembered is not None and not loose:
            if remembered[0] == identity:  # (None: still no `packed-refs`, nor a loose ref)
                return remembered
            move = take_last_move(self.path, identity)
            if move is not None and move[0] == remembered[0]:  # (a compile's branches moved)
                self._refs = (identity, _moved_refs(
                    remembered[1], {name: new for name, (_, new) in move[1].items()}))
                return self._refs
        refs = ref_targets(self.path)  # (read after the identity: never newer than it says)
        self._refs = None if loose else (identity, refs)
        return identity, refs

    def _git(self, *args: str, stdin: PackData | Path | None = None) -> bytes:
        """Git on this repository; `stdin` bytes, or a file to read them from."""
        with contextlib.ExitStack() as files:
            handle = files.enter_context(stdin.open("rb")) if isinstance(stdin, Path) else None
            done = subprocess.run([*_GIT, f"--git-dir={self.path}", *args],
                                  input=None if isinstance(stdin, Path) else stdin,
                                  stdin=handle, capture_output=True, check=False,
                                  timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"git {args[0]} in {self.path}: "
                               f"{done.stderr.decode(errors='replace').strip()}")
        return done.stdout

    # --- publishing --------------------------------------------------------------------

    def pack(self, new: Mapping[str, str], old: Iterable[str]
             ) -> tuple[PackData, PackData | None]:
        """A pack of every object `new` reaches that the `old` tips do not, and the index
        `git pack-objects` writes beside it, which replicas store as it is instead of
        running index-pack on the pack again (at 100,000 devices, 15 s on every replica).
        (b"", None) when the new tips add nothing. Both mapped, not read (`mapped`: a
        compaction's pack of a million devices is about 3.8 GB)."""
        wanted = sorted(set(new.values()))
        if not wanted:
            return b"", None
        lines = [*wanted, *(f"^{tip}" for tip in sorted(set(old)))]
        with tempfile.TemporaryDirectory(prefix="margo-publish-", dir=self.path) as folder:
            name = self._git("pack-objects", "--revs", "--quiet", "--delta-base-offset",
                             f"{folder}/pack", stdin=("\n".join(lines) + "\n").encode())
            written = Path(folder) / f"pack-{name.decode().strip()}"
            return (mapped(written.with_name(written.name + ".pack")),
                    mapped(written.with_name(written.name + ".idx")))

    def full_pack(self) -> tuple[PackData, PackData | None]:
        return self.pack(self.refs(), ())

    def pack_file(self, pack: PackData) -> Path:
        """Where the object store keeps `pack` (by the checksum it ends with)."""
        return self.path / "objects" / "pack" / f"pack-{pack_id(pack)}.pack"

    def pack_names(self) -> frozenset[str]:
        """The packs in the object store (their file names, without the extension)."""
        folder = self.path / "objects" / "pack"
        return frozenset(p.stem for p in folder.glob("pack-*.idx")) if folder.exists() \
            else frozenset()

    def compiled_pack(self, earlier: frozenset[str], created: Iterable[str] | None
                      ) -> tuple[PackData, PackData] | None:
        """The one pack a compile wrote since the store held the packs `earlier`, and its
        index, to publish as they are instead of `pack` (None: use `pack`).

        Why it holds what `pack` would: a compile writes every object of its commits into
        one pack (`compiler.packwriter`) except what the branches it builds on reach (the
        parent, the parent's tree, kept files: published before, as `pack`'s exclusion of
        the old tips assumes too). Three cases break that, and get `pack` instead: more
        than one new pack or any loose object (not a compile's single write), and a
        created branch whose first commit has a parent (a lost branch the compile restored
        on the commit it last left: no old tip reaches that). `created`: the new branches'
        tips, which are looked at for that; None when the compile said it restored none.
        MEASURED (100,000 devices): `git pack-objects` re-read the compile's 383 MB pack
        in about 11 s and wrote it out again the same size (the compile's objects are not
        deltified, and were reused); looking at 100,000 created tips takes Git 0.6 s.
        Both files come mapped into memory, not read (`mapped`)."""
        folder = self.path / "objects"
        new = sorted(self.pack_names() - earlier)
        if len(new) != 1 or any(len(d.name) == 2 and any(d.iterdir())
                                for d in folder.iterdir() if d.is_dir()):
            return None
        if created is not None and self._continued(created):
            return None
        base = folder / "pack" / new[0]
        return mapped(base.with_suffix(".pack")), mapped(base.with_suffix(".idx"))

    def _continued(self, tips: Iterable[str]) -> bool:
        """Whether any of these commits has a parent."""
        listed = "".join(f"{tip}\n" for tip in tips)
        return bool(listed) and bool(self._git("rev-list", "--no-walk", "--min-parents=1",
                                               "--stdin", stdin=listed.encode()).strip())

    # --- syncing -----------------------------------------------------------------------

    @contextlib.contextmanager
    def spooling(self) -> Iterator[Path]:
        """A folder for the packs a sync reads from the database (`read_snapshot`'s spool),
        removed afterwards: inside this repository, so that a pack moves into the object
        store by a rename instead of being written again."""
        with tempfile.TemporaryDirectory(prefix="margo-sync-", dir=self.path) as folder:
            yield Path(folder)

    def apply(self, snapshot: Snapshot) -> bool:
        """Bring this repository to `snapshot.generation`: objects first, then the refs in
        one rewrite, then the generation. False when it was there already."""
        if snapshot.generation <= self.generation and not snapshot.packs:
            return False
        self.add_objects(snapshot)
        return self.move_to(snapshot) is not None

    def add_objects(self, snapshot: Snapshot) -> None:
        """The snapshot's objects, which no ref names yet: invisible to readers, so this
        (the slow part) needs no lock against them. A pack published with its index is
        stored as it is; one without is indexed (`git index-pack`); a generation whose
        objects were linked in from the repository that compiled it (`link_objects_from`)
        needs neither."""
        for published in snapshot.packs:
            if not published.pack or published.generation in self._linked:
                continue
            if not self._store_pack(published):
                self._git("index-pack", "--stdin", stdin=published.path or published.pack)

    def _store_pack(self, published: PublishedPack) -> bool:
        """A pack and its index into the object store under the pack's checksum, the index
        last (Git sees a pack once its index is there): moved there when they were read
        into files (`spooling`), else written. False, storing nothing, without an index or
        when they do not belong together: a version 2 index ends with the checksum of its
        pack, which is what a pack ends with."""
        pack, index = published.pack, published.index
        checksum = bytes(pack[-20:])
        if index is None or not (pack[:4] == b"PACK" and index[:8] == _INDEX_V2
                                 and len(index) >= 48 and index[-40:-20] == checksum):
            return False
        folder = self.path / "objects" / "pack"
        folder.mkdir(parents=True, exist_ok=True)
        base = folder / f"pack-{checksum.hex()}"
        for suffix, data in ((".pack", pack), (".idx", index)):
            target = base.with_name(base.name + suffix)
            if target.exists():
                continue
            if published.path is not None:
                move_atomically(published.path.with_suffix(suffix), target)
            else:
                write_atomically(target, bytes(data))
        return True

    def link_objects_from(self, other: RepoReplica) -> bool:
        """Give this repository every object `other` has, by hard-linking `other`'s object
        files (packs, named by their checksum, and loose objects, named by their id: both
        immutable) that are not here yet: the compiling replica's own copy of what it is
        about to publish, which then needs no index-pack (`has_objects_of`; 10,000
        devices: 1-2 s of index-pack on 2 busy cores, the other replica's sync running at
        the same time). All of `other`'s objects, not only the compile's: a compile's pack
        need not hold an object an earlier pack of the repository has (perhaps from a
        compile that was never published), and objects Git wrote may be loose. False (the
        sync index-packs as usual) when a link fails."""
        source, target = other.path / "objects", self.path / "objects"
        try:
            if self._changed(source / "pack"):
                for index in sorted((source / "pack").glob("pack-*.idx")):
                    # The pack first, its index last: Git sees a pack once its .idx is there.
                    for part in (".pack", ".rev", ".idx"):
                        _link_missing(index.with_suffix(part), target / "pack")
            for folder in source.iterdir():
                if len(folder.name) == 2 and folder.is_dir() and self._changed(folder):
                    for loose in folder.iterdir():
                        _link_missing(loose, target / folder.name)
        except OSError:
            self._listed.clear()  # (a folder may be half linked)
            return False
        return True

    def _changed(self, folder: Path) -> bool:
        """Whether `folder` may hold files not linked yet: its modification time moved
        since it was last listed (read before listing it, so a file added meanwhile moves
        it again), or is too recent to tell (a file system's clock ticks coarser than its
        nanoseconds: a file added in the same tick leaves the time as it was). A fleet's
        first reports come as hundreds of small compiles, each leaving a few dozen loose
        objects: listing every folder at each publication made linking grow with
        everything ever written."""
        stamp = folder.stat().st_mtime_ns
        if self._listed.get(folder) == stamp:
            return False
        if time.time_ns() - stamp > _SETTLED_NS:
            self._listed[folder] = stamp
        return True

    def linked_generations(self) -> frozenset[int]:
        """The generations `has_objects_of` was told of: their packs need not be read."""
        return frozenset(self._linked)

    def has_objects_of(self, generation: int) -> None:
        """`generation`, published from the repository whose objects `link_objects_from`
        linked in just before, needs no index-pack here. Told only once it is published: had
        another replica published that generation meanwhile, its pack would be missing."""
        self._linked.add(generation)

    def move_to(self, snapshot: Snapshot) -> Moved:
        """The refs and generation of a snapshot whose objects are here (`add_objects`): the
        one visible step, a single rewrite of the refs (deleted ones removed). What moved;
        None when it was there already."""
        if snapshot.generation <= self.generation and not snapshot.packs:
            return None
        identity, current = self._listing()
        if snapshot.whole is not None:
            return self._move_to_list(identity, current, snapshot)
        # A None target is a ref deleted on purpose (a device its client deleted,
        # `wfm.fleet.deletions.publish_deletion`): it goes in the same rewrite, and a ref that
        # is not here is left absent.
        refs = _moved_refs(current, snapshot.refs)
        if refs != current:  # (compared in C: a million refs' own diff took 0.8 s)
            self._rewrite_refs(identity, refs, snapshot.refs)
        self.mark_generation(snapshot.generation)
        return snapshot.refs

    def _move_to_list(self, identity: FileIdentity | None, current: dict[str, str],
                      snapshot: Snapshot) -> Moved:
        """`move_to` a published list (`wfm.store.ref_lists`) and the refs moved after it:
        the list's file installed as it is when nothing moved after it (`install_refs`: a
        million refs are not written again), else written from both."""
        assert snapshot.whole is not None
        listed = canonical_refs(snapshot.whole)
        refs = _moved_refs(listed, snapshot.refs) if snapshot.refs else listed
        moved = ref_moves(refs, current)
        if moved and refs is listed:
            try:
                self._refs = (install_refs(self.path, identity, snapshot.whole), refs)
            except (LooseRefsError, RefMovedError):
                self._rewrite_refs(identity, refs, moved)
        elif moved:
            self._rewrite_refs(identity, refs, moved)
        self.mark_generation(snapshot.generation)
        return moved

    def move_like(self, other: RepoReplica, before: Mapping[str, str],
                  after: Mapping[str, str], snapshot: Snapshot) -> Moved:
        """`move_to(snapshot)`, whose refs are what moved `other`'s from `before` to
        `after`: when this repository's refs are `before` and `other`'s still `after`,
        `other`'s ``packed-refs`` is copied as it is (`copy_refs`: a million refs in a
        tenth of a second, against 2.7-3 s to write them) instead of written from them."""
        if snapshot.generation <= self.generation and not snapshot.packs:
            return None
        identity, current = self._listing()
        source, refs = other._listing()
        if source is None or current != before or refs != after:
            return self.move_to(snapshot)
        try:
            written = copy_refs(other.path, source, self.path, identity)
        except (LooseRefsError, RefMovedError):
            return self.move_to(snapshot)
        self._refs = (written, refs)  # (both listings are only read: one dict will do)
        self.mark_generation(snapshot.generation)
        return snapshot.refs

    def refs_file(self, refs: Mapping[str, str]) -> bytes:
        """A whole ``packed-refs`` file holding exactly `refs` in the form
        `compiler.packedrefs.canonical_refs` accepts: this repository's own file when it is
        (its listing is `refs`, and it is in that form), else written from them."""
        identity, current = self._listing()
        if identity is not None and current == refs:
            try:
                data = (self.path / "packed-refs").read_bytes()
            except FileNotFoundError:
                data = b""
            if (packed_refs_identity(self.path) == identity and b"^" not in data
                    and data.startswith(rendered_refs({}))):
                return data
        return rendered_refs(refs)

    def _rewrite_refs(self, identity: FileIdentity | None, refs: dict[str, str],
                      changed: Mapping[str, str | None]) -> None:
        """Make `refs` (the listing of `identity` with the `changed` refs moved, None:
        deleted) the refs: the whole file written from them (`replace_refs`, a million
        moved refs in about a second), else, when the file is not that one any more or a
        ref is a loose file, each changed ref moved in it (`move_refs`)."""
        try:
            self._refs = (replace_refs(self.path, identity, refs), refs)
            return
        except (LooseRefsError, RefMovedError):
            current = self.refs()  # (listed again)
        updates = {n: (current.get(n), t) for n, t in changed.items() if current.get(n) != t}
        try:
            move_refs(self.path, updates)
        except LooseRefsError:
            self._git("pack-refs", "--all", "--prune")
            move_refs(self.path, updates)


def ref_moves(after: Mapping[str, str], before: Mapping[str, str]) -> dict[str, str | None]:
    """The refs that moved from `before` to `after` (None: deleted)."""
    moved: dict[str, str | None] = {n: t for n, t in after.items() if before.get(n) != t}
    moved.update({n: None for n in before if n not in after})
    return moved


def _moved_refs(refs: Mapping[str, str], changed: Mapping[str, str | None]) -> dict[str, str]:
    """`refs` with the `changed` ones moved (None: deleted)."""
    moved = {**refs, **{name: new for name, new in changed.items() if new is not None}}
    for name in (name for name, new in changed.items() if new is None):
        moved.pop(name, None)
    return moved


def _link_missing(found: Path, folder: Path) -> None:
    """A hard link to `found` in `folder` under the same name, unless one is there."""
    linked = folder / found.name
    if found.exists() and not linked.exists():
        folder.mkdir(parents=True, exist_ok=True)
        os.link(found, linked)
