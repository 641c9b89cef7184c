"""What a device's upload-pack request may name: parsed as it streams through.

`Gate` reads the pkt-lines of a request body (decompressing ``gzip``) on their way to Git
and refuses, before Git sees it, a ``want`` that is not a commit on the device's branch or
the tip's tree or one of its entries; ``have`` and ``shallow`` lines naming anything else
reach Git naming the null id instead. `wfm.git.githttp` says why (what Git itself lets
through, measured).
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pygit2

from compiler.forkgate import gated_steps

__all__ = ["CHUNK", "MAX_REQUEST_BYTES", "Gate", "Refused"]

#: Most (decompressed) bytes of an upload-pack request we parse; legitimate ones are far smaller.
MAX_REQUEST_BYTES = 64 * 1024 * 1024
#: The most bytes handled at once, decompressed or relayed.
CHUNK = 64 * 1024
_HEX4 = re.compile(rb"[0-9a-fA-F]{4}")
_OID_HEX = re.compile(rb"[0-9a-fA-F]{40}")
_V2_COMMANDS = frozenset({b"ls-refs", b"fetch"})
_REFUSED_V2_ARGS = (b"want-ref ", b"deepen-not ")


class Refused(Exception):
    """A request Git must not see; `status` and the message become the problem answer."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


class _PktLines:
    """Incremental pkt-line splitter: feed any chunking, get complete packets back.

    Stricter than Git (which dies on the same input), never more lenient: a length must be
    four hex digits, 0000/0001/0002 are the special packets, 0003 and lengths beyond 65520
    are malformed, and a body may not end inside a packet.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[bytes, bytes | None]]:
        """The packets completed by `data`: (its bytes as sent, its payload or None for a
        special packet). The bytes are what is forwarded, so Git sees exactly what was sent."""
        self._buffer += data
        while len(self._buffer) >= 4:
            head = bytes(self._buffer[:4])
            if not _HEX4.fullmatch(head):
                raise Refused(400, "malformed pkt-line in the request")
            length = int(head, 16)
            if length in (0, 1, 2):
                del self._buffer[:4]
                yield head, None
                continue
            if length == 3 or length > 65520:
                raise Refused(400, "malformed pkt-line length in the request")
            if len(self._buffer) < length:
                return
            packet = bytes(self._buffer[:length])
            del self._buffer[:length]
            yield packet, packet[4:]

    def finish(self) -> None:
        """Refuse a body that ended inside a packet (Git would hang up on it too)."""
        if self._buffer:
            raise Refused(400, "the request ends inside a pkt-line")


class _Inflater:
    """Streaming inverse of the request's Content-Encoding, in bounded pieces.

    It accepts gzip and zlib headers (``inflateInit2(.., 15 + 32)``) and exactly one
    compressed stream: ``git http-backend`` stops inflating at the end of the first one and
    drops the rest, so a body of two gzip members (or anything after the end) reached
    upload-pack cut short and was answered with an empty 200. Such a body, and one that
    ends inside the stream, is refused with 400 instead (Git's own client sends one member).
    """

    def __init__(self, gzipped: bool) -> None:
        self._inflate = zlib.decompressobj(15 + 32) if gzipped else None
        self.total = 0

    def feed(self, data: bytes, *, last: bool = False) -> Iterator[bytes]:
        """Decompressed pieces of at most `CHUNK` bytes; refuses oversized requests, and
        (`last`: the body ends with `data`) bodies that are not exactly one stream."""
        for piece in self._pieces(data):
            self.total += len(piece)
            if self.total > MAX_REQUEST_BYTES:
                raise Refused(413, f"upload-pack requests are limited to "
                                    f"{MAX_REQUEST_BYTES} bytes")
            yield piece
        if last and self._inflate is not None and not self._inflate.eof:
            raise Refused(400, "the gzip-encoded request ends inside its compressed stream")

    def _pieces(self, data: bytes) -> Iterator[bytes]:
        if self._inflate is None:
            yield data
            return
        pending = data
        try:
            while not self._inflate.eof:
                piece = self._inflate.decompress(pending, CHUNK)
                yield piece
                pending = self._inflate.unconsumed_tail
                if not pending and len(piece) < CHUNK:
                    break
        except zlib.error as exc:
            raise Refused(400, f"the gzip-encoded request is corrupt: {exc}") from None
        if self._inflate.eof and (self._inflate.unused_data or pending):
            raise Refused(400, "the gzip-encoded request has data after the end of its "
                                "compressed stream (a second gzip member?); Git reads one")


class Gate:
    """What of an upload-pack request Git may see: refuses requests that want objects that
    are not the device's, and makes ``have`` and ``shallow`` lines naming anything but a
    commit on the device's branch name a missing object instead (see the module docstring
    for what they leaked).

    Each chunk is decompressed and split into packets; only complete, checked packets are
    forwarded, so Git never receives a line that was not checked (nor a partial one).
    """

    def __init__(self, repository: Path, tip: str, *, gzipped: bool) -> None:
        self.branch = _Branch(repository, tip)
        self._inflater = _Inflater(gzipped)
        self._lines = _PktLines()
        #: The request wants the branch's tip: the exchange hands the device its newest state.
        self.wants_tip = False

    async def check(self, chunk: bytes, *, last: bool) -> bytes:
        """The part of the request completed by `chunk` that Git may see (decompressed);
        raises `Refused` for a request Git must not see at all."""
        packets: list[tuple[bytes, bytes | None]] = []
        for piece in self._inflater.feed(chunk, last=last):
            packets.extend(self._lines.feed(piece))
        if last:
            self._lines.finish()
        wants: set[str] = set()
        claimed: set[str] = set()
        kept: list[tuple[bytes, _Line]] = []
        for packet, payload in packets:
            line = _Line.parse(payload)
            wants |= line.wants
            if line.claims is not None:
                claimed.add(line.claims)
            kept.append((packet, line))
        self.wants_tip = self.wants_tip or self.branch.tip in wants
        if not wants and not claimed:
            return b"".join(packet for packet, _ in kept)
        foreign, own = await asyncio.to_thread(self.branch.sort, wants, claimed)
        if foreign:
            raise Refused(403, f"object {min(foreign)} is not part of this device's state")
        return b"".join(packet if line.claims is None or line.claims in own
                        else _pkt_line(line.keyword + _MISSING) for packet, line in kept)


def _pkt_line(payload: bytes) -> bytes:
    return b"%04x" % (len(payload) + 4) + payload


#: What a ``have`` or ``shallow`` line naming another device's object becomes: the null id,
#: which no object has, so Git answers exactly as for any id it lacks. (Not dropped: a v2
#: request whose haves all vanished would get a pack where the client expects
#: acknowledgments.)
_MISSING = b" " + b"0" * 40 + b"\n"


@dataclass(frozen=True, slots=True)
class _Line:
    """What one request line asks of upload-pack: the objects it `wants`, the object it
    `claims` the caller has (``have``) or is shallow at (``shallow``), that `keyword`."""

    wants: frozenset[str] = frozenset()
    claims: str | None = None
    keyword: bytes = b""

    @classmethod
    def parse(cls, payload: bytes | None) -> _Line:
        """Refuses v2 commands and arguments that could reach beyond the device's branch,
        and malformed lines naming objects (Git would die on them)."""
        if payload is None:
            return _NOTHING
        line = payload[:-1] if payload.endswith(b"\n") else payload  # PACKET_READ_CHOMP_NEWLINE
        if line.startswith(b"command=") and line[len(b"command="):] not in _V2_COMMANDS:
            raise Refused(403, f"protocol v2 {line.decode('ascii', 'replace')!r} is not served")
        if line.startswith(_REFUSED_V2_ARGS):
            raise Refused(403, f"{line.split(b' ')[0].decode()!r} is not served")
        keyword, _, rest = line.partition(b" ")
        if keyword not in _NAMING_OBJECTS:
            return _NOTHING
        # Git's get_oid_hex reads 40 hex digits of either case, ignores the rest (v0 want
        # lines carry capabilities after the id)
        oid = rest[:40]
        if not _OID_HEX.fullmatch(oid):
            raise Refused(400, f"malformed {keyword.decode()} line in the request")
        name = oid.decode("ascii").lower()
        if keyword == b"want":
            return cls(wants=frozenset({name}))
        return cls(claims=name, keyword=keyword)


_NOTHING = _Line()
_NAMING_OBJECTS = frozenset({b"want", b"have", b"shallow"})


class _Branch:
    """The objects of one device branch, for the gate's questions. Used from one worker
    thread at a time (the gate awaits each answer), with its own Repository.

    The branch's commits are walked lazily from the tip and remembered: clients send their
    haves newest first, so a fetch that shares history walks only down to the newest common
    commit; a foreign id costs one walk of the whole branch per request, never more.
    """

    def __init__(self, repository: Path, tip: str) -> None:
        self.repository, self.tip = repository, tip
        self._repo: pygit2.Repository | None = None
        self._walk: Iterator[pygit2.Commit] | None = None
        self._commits: set[str] = set()
        self._current: set[str] | None = None

    def sort(self, wants: Iterable[str], claimed: Iterable[str]) -> tuple[set[str], set[str]]:
        """(the wanted ids that are not the device's, the claimed ids that are commits on
        its branch). A want may be a commit on the branch, or the tip's tree or one of its
        (flat) entries: what a partial clone fetches lazily."""
        foreign = {w for w in wants if not self._on_branch(w) and w not in self._tip_tree()}
        return foreign, {c for c in claimed if self._on_branch(c)}

    def _on_branch(self, oid: str) -> bool:
        while oid not in self._commits:
            if self._walk is None:
                # (each step outside a compile's forks: `compiler.forkgate`)
                self._walk = gated_steps(self._repository().walk(pygit2.Oid(hex=self.tip)))
            commit = next(self._walk, None)
            if commit is None:
                return False
            self._commits.add(str(commit.id))
        return True

    def _tip_tree(self) -> set[str]:
        if self._current is None:
            tree = self._repository()[pygit2.Oid(hex=self.tip)].peel(pygit2.Tree)
            self._current = {str(tree.id)} | {str(entry.id) for entry in tree}
        return self._current

    def _repository(self) -> pygit2.Repository:
        if self._repo is None:
            self._repo = pygit2.Repository(str(self.repository))
        return self._repo
