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

import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pygit2

from compiler.packedrefs import LooseRefsError, move_refs
from margo.files import write_atomically
from wfm.store.replica_rows import Snapshot

__all__ = ["COMPACT_AFTER", "Published", "RepoReplica"]

COMPACT_AFTER = 64
_GENERATION_FILE = "margo-generation"
_GIT = ("git", "-c", "core.warnAmbiguousRefs=false")


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
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            pygit2.init_repository(str(self.path), bare=True)

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
        """Every direct ref under refs/ and its target."""
        repo = pygit2.Repository(str(self.path))
        out = {}
        for name in repo.listall_references():
            target = repo.references[name].target
            if isinstance(target, pygit2.Oid):
                out[name] = str(target)
        return out

    def _git(self, *args: str, stdin: bytes | None = None) -> bytes:
        done = subprocess.run([*_GIT, f"--git-dir={self.path}", *args], input=stdin,
                              capture_output=True, check=False, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"git {args[0]} in {self.path}: "
                               f"{done.stderr.decode(errors='replace').strip()}")
        return done.stdout

    # --- publishing --------------------------------------------------------------------

    def pack(self, new: Mapping[str, str], old: Iterable[str]) -> bytes:
        """A pack of every object `new` reaches that the `old` tips do not (b"" when the
        new tips add nothing)."""
        wanted = sorted(set(new.values()))
        if not wanted:
            return b""
        lines = [*wanted, *(f"^{tip}" for tip in sorted(set(old)))]
        return self._git("pack-objects", "--revs", "--stdout", "--quiet", "--delta-base-offset",
                         stdin=("\n".join(lines) + "\n").encode())

    def full_pack(self) -> bytes:
        return self.pack(self.refs(), ())

    # --- syncing -----------------------------------------------------------------------

    def apply(self, snapshot: Snapshot) -> bool:
        """Bring this repository to `snapshot.generation`: objects first, then the refs in
        one rewrite, then the generation. False when it was there already."""
        if snapshot.generation <= self.generation and not snapshot.packs:
            return False
        self.add_objects(snapshot)
        return self.move_to(snapshot)

    def add_objects(self, snapshot: Snapshot) -> None:
        """The snapshot's objects, which no ref names yet: invisible to readers, so this
        (the slow part, an index-pack per pack) needs no lock against them."""
        for _, pack in snapshot.packs:
            if pack:
                self._git("index-pack", "--stdin", stdin=pack)

    def move_to(self, snapshot: Snapshot) -> bool:
        """The refs and generation of a snapshot whose objects are here (`add_objects`): the
        one visible step, a single rewrite of the refs (deleted ones removed). False when it
        was there already."""
        if snapshot.generation <= self.generation and not snapshot.packs:
            return False
        current = self.refs()
        # A None target is a ref deleted on purpose (a device its client deleted,
        # `wfm.fleet.coordination.publish_deletion`): it goes in the same rewrite, and a ref that
        # is not here is left absent.
        updates = {name: (current.get(name), target) for name, target in snapshot.refs.items()
                   if current.get(name) != target}
        if updates:
            try:
                move_refs(self.path, updates)
            except LooseRefsError:
                self._git("pack-refs", "--all", "--prune")
                move_refs(self.path, updates)
        self.mark_generation(snapshot.generation)
        return True
