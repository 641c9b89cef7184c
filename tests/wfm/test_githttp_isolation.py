"""What a device can learn about OTHER devices' state through the Git endpoint (`wfm.git.githttp`):
nothing. Attacks with crafted upload-pack requests against a real uvicorn server, and a
hypothesis fuzz of the protocol lines; every pack that comes back is parsed here, its deltas
resolved, and each object and delta base checked against the caller's own branch."""

from __future__ import annotations

import gzip
import struct
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from hashlib import sha1
from pathlib import Path

import httpx
import pygit2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kits.fuzzing import examples
from kits.githttpkit import UPLOAD_PACK_REQUEST, basic_authorizer, git_env, pkt, serving, v2_request
from starlette.applications import Starlette
from starlette.routing import Mount

from compiler.gitstore import DeviceCommit, DeviceStore
from wfm.git.githttp import git_app

TOKENS = {"dev-a": "token-a", "dev-b": "token-b"}
#: Git's INFINITE_DEPTH: "deepen" with it asks the server to unshallow completely.
INFINITE_DEPTH = 0x7FFFFFFF


def document(name: str, secret: str) -> bytes:
    """An ApplicationDeployment-like YAML document of about 800 bytes: two devices' versions
    share almost every line, so Git would gladly delta one against the other."""
    lines = [f"  parameter{i:02d}: value-{i:02d}-shared-by-every-device" for i in range(18)]
    return (f"apiVersion: application.margo.org/v1alpha1\nkind: ApplicationDeployment\n"
            f"metadata:\n  name: {name}\nspec:\n" + "\n".join(lines)
            + f"\n  secret: {secret}\n").encode()


SECRET_A = "only-device-a-may-read-this-b3f1c7"
SECRET_A_OLD = "device-a-old-state-9c1e22"
FILES = {
    "dev-a": {"deployment.yaml": document("shared-app", SECRET_A)},
    "dev-b": {"deployment.yaml": document("shared-app", "device-b-value-42")},
}


# --- the server -------------------------------------------------------------------------


@dataclass
class Fleet:
    """Two devices with near-identical documents; dev-a has two commits (so it has history
    a shallow request could reach into)."""

    store: DeviceStore
    base: str
    tips: dict[str, str] = field(default_factory=dict)
    old_a: str = ""

    def reachable(self, device: str) -> set[str]:
        """Every object id on `device`'s branch: what the device may read."""
        return self.reachable_from(self.tips[device])

    def reachable_from(self, commit: str) -> set[str]:
        """The objects of `commit` and its history."""
        repo = pygit2.Repository(str(self.store.path))
        seen: set[str] = set()
        for found in repo.walk(pygit2.Oid(hex=commit)):
            seen.add(str(found.id))
            stack = [found.tree]
            while stack:
                tree = stack.pop()
                seen.add(str(tree.id))
                for entry in tree:
                    seen.add(str(entry.id))
                    if entry.type_str == "tree":
                        stack.append(repo[entry.id])
        return seen

    def post(self, device: str, body: bytes, *, protocol: int = 2) -> httpx.Response:
        headers = {"Content-Type": UPLOAD_PACK_REQUEST}
        if protocol:
            headers["Git-Protocol"] = f"version={protocol}"
        return httpx.post(f"{self.base}/git/devices/{device}.git/git-upload-pack",
                          content=body, headers=headers, auth=(device, TOKENS[device]),
                          timeout=30)


def make_fleet(tmp: Path) -> Iterator[Fleet]:
    store = DeviceStore(tmp / "repos")
    old = store.write([DeviceCommit("dev-a", {"deployment.yaml": document("old", SECRET_A_OLD)},
                                    "old state of dev-a", 1_700_000_000)])["dev-a"]
    tips = store.write([DeviceCommit(d, f, f"state of {d}", 1_700_000_100)
                        for d, f in FILES.items()])
    app = Starlette(routes=[Mount("/git", app=git_app(store.path, basic_authorizer(TOKENS)))])
    with serving(app, log_level="critical") as base:
        yield Fleet(store, base, dict(tips), old)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One server for the whole module (hypothesis reuses it across examples); no test
    writes to the store."""
    yield from make_fleet(tmp_path_factory.mktemp("isolation"))


# --- speaking the protocol ----------------------------------------------------------------


def v0_fetch(wants: list[str], haves: list[str], *, shallows: tuple[str, ...] = (),
             deepen: int | None = None,
             capabilities: str = "multi_ack_detailed side-band-64k thin-pack ofs-delta "
                                 "no-progress") -> bytes:
    """A protocol-v0 stateless-RPC request (what one HTTP POST of `git fetch` carries)."""
    lines = [f"want {wants[0]} {capabilities}\n", *(f"want {w}\n" for w in wants[1:]),
             *(f"shallow {s}\n" for s in shallows)]
    if deepen is not None:
        lines.append(f"deepen {deepen}\n")
    return (b"".join(pkt(line) for line in lines) + b"0000"
            + b"".join(pkt(f"have {h}\n") for h in haves) + pkt("done\n"))


def packets(body: bytes) -> Iterator[bytes | None]:
    """The payloads of a pkt-line stream (None for flush/delim/response-end). What follows
    the last pkt-line (a v0 pack sent without side-band) comes last, as one payload."""
    offset = 0
    while offset + 4 <= len(body):
        head = body[offset:offset + 4]
        if not all(c in b"0123456789abcdefABCDEF" for c in head):
            break
        length = int(head, 16)
        if length < 4:
            yield None
            offset += 4
            continue
        yield body[offset + 4:offset + length]
        offset += length
    if offset < len(body):
        yield body[offset:]


def pack_data(body: bytes) -> bytes:
    """The pack of an upload-pack answer, b"" if there is none: on side-band 1 if it is
    multiplexed (v2, v0 with side-band), else the raw bytes after the pkt-lines."""
    payloads = [p for p in packets(body) if p]
    sideband = b"".join(p[1:] for p in payloads if p[:1] == b"\x01")
    data = sideband or next((p for p in payloads if p.startswith(b"PACK")), b"")
    start = data.find(b"PACK")
    return data[start:] if start >= 0 else b""


def text_lines(body: bytes) -> list[bytes]:
    """The protocol lines of an answer before its pack (ACK, NAK, shallow, unshallow...)."""
    lines = []
    for payload in packets(body):
        if payload is None or payload[:1] in (b"\x01", b"\x02", b"\x03"):
            continue
        lines.append(payload.rstrip(b"\n"))
    return lines


@dataclass
class PackedObject:
    kind: str
    data: bytes  # resolved content
    delta_base: str | None  # the id of the base this object was sent as a delta against


_KINDS = {1: "commit", 2: "tree", 3: "blob", 4: "tag"}


def _apply_delta(base: bytes, delta: bytes) -> bytes:
    def varint(at: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = delta[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value, at
    base_size, at = varint(0)
    assert base_size == len(base)
    _, at = varint(at)
    out = bytearray()
    while at < len(delta):
        op = delta[at]
        at += 1
        if op & 0x80:
            offset = size = 0
            for i in range(4):
                if op & (1 << i):
                    offset |= delta[at] << (8 * i)
                    at += 1
            for i in range(3):
                if op & (1 << (4 + i)):
                    size |= delta[at] << (8 * i)
                    at += 1
            out += base[offset:offset + (size or 0x10000)]
        else:
            out += delta[at:at + op]
            at += op
    return bytes(out)


def parse_pack(pack: bytes, store: Path, *, truncated: bool = False,
               ) -> dict[str, PackedObject]:
    """Every object of `pack` by id, deltas resolved. A REF_DELTA base outside the pack
    (a thin pack) is read from `store`: the test may look, the caller could not. With
    `truncated`, a pack that ends early (Git died while sending it) gives the objects that
    arrived complete."""
    assert pack[:4] == b"PACK", pack[:20]
    if len(pack) < 12 and truncated:
        return {}
    _, count = struct.unpack(">II", pack[4:12])
    objects: dict[str, PackedObject] = {}
    try:
        _read_objects(pack, count, pygit2.Repository(str(store)), objects)
    except (IndexError, zlib.error, KeyError):
        if not truncated:
            raise
    return objects


def _read_objects(pack: bytes, count: int, repo: pygit2.Repository,
                  objects: dict[str, PackedObject]) -> None:
    by_offset: dict[int, tuple[str, bytes, str]] = {}
    at = 12
    for _ in range(count):
        start = at
        byte = pack[at]
        at += 1
        kind, shift = (byte >> 4) & 7, 4
        while byte & 0x80:
            byte = pack[at]
            at += 1
            shift += 7
        base_kind = base_data = base_id = None
        if kind == 6:  # OFS_DELTA: a base earlier in this pack
            byte = pack[at]
            at += 1
            distance = byte & 0x7F
            while byte & 0x80:
                byte = pack[at]
                at += 1
                distance = ((distance + 1) << 7) | (byte & 0x7F)
            base_kind, base_data, base_id = by_offset[start - distance]
        elif kind == 7:  # REF_DELTA: a base named by id, in the pack or (thin) not
            base_id = pack[at:at + 20].hex()
            at += 20
            if base_id in objects:
                base_kind, base_data = objects[base_id].kind, objects[base_id].data
            else:
                found = repo[base_id]
                base_kind, base_data = found.type_str, found.read_raw()
        inflater = zlib.decompressobj()
        raw = inflater.decompress(pack[at:])
        if not inflater.eof:
            raise IndexError("the pack ends inside an object")
        at = len(pack) - len(inflater.unused_data)
        if base_data is not None:
            assert base_kind is not None
            data, name = _apply_delta(base_data, raw), base_kind
        else:
            data, name = raw, _KINDS[kind]
        oid = sha1(b"%s %d\0" % (name.encode(), len(data)) + data).hexdigest()
        by_offset[start] = (name, data, oid)
        objects[oid] = PackedObject(name, data, base_id)


def assert_nothing_foreign(fleet: Fleet, device: str, response: httpx.Response, *,
                           truncated: bool = False) -> dict[str, PackedObject]:
    """Every object in the answer's pack, and every base one was sent as a delta against,
    is on `device`'s branch; no other device's content appears anywhere in the answer."""
    body = response.content
    for secret in (SECRET_A, SECRET_A_OLD) if device != "dev-a" else ():
        assert secret.encode() not in body
    if not response.headers.get("content-type", "").startswith("application/x-git-"):
        return {}  # a problem answer: no pkt-lines
    own = fleet.reachable(device)
    pack = pack_data(body)
    objects = parse_pack(pack, fleet.store.path, truncated=truncated) if pack else {}
    assert set(objects) <= own, f"foreign objects sent: {set(objects) - own}"
    bases = {o.delta_base for o in objects.values() if o.delta_base is not None}
    assert bases <= own, f"deltas against foreign objects: {bases - own}"
    for secret in (SECRET_A, SECRET_A_OLD) if device != "dev-a" else ():
        assert all(secret.encode() not in o.data for o in objects.values())
    return objects


# --- attacks ------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [0, 2])
@pytest.mark.parametrize("shallow", ["none", "deepen", "own-shallow-line"])
def test_a_foreign_have_is_no_delta_base(fleet: Fleet, protocol: int, shallow: str) -> None:
    """dev-b claims to have dev-a's tip. MEASURED before the fix: in a shallow request
    (``deepen 1``, or a ``shallow`` line for its own tip), upload-pack ran pack-objects with
    ``--thin --shallow``, which makes every ``have`` a delta base, and the pack carried
    dev-b's document as a delta against dev-a's: copy instructions over dev-a's bytes (and
    dev-a's document size), from which dev-b rebuilt most of dev-a's document."""
    tip_a, tip_b = fleet.tips["dev-a"], fleet.tips["dev-b"]
    shallows = (tip_b,) if shallow == "own-shallow-line" else ()
    deepen = 1 if shallow == "deepen" else None
    if protocol == 2:
        extra = [f"shallow {s}" for s in shallows] + ([f"deepen {deepen}"] if deepen else [])
        body = v2_request(f"want {tip_b}", f"have {tip_a}", *extra, "thin-pack", "ofs-delta",
                        "no-progress", "done")
    else:
        body = v0_fetch([tip_b], [tip_a], shallows=shallows, deepen=deepen)
    response = fleet.post("dev-b", body, protocol=protocol)
    assert response.status_code == 200, response.text
    objects = assert_nothing_foreign(fleet, "dev-b", response)
    assert tip_b in objects  # the device still gets its whole state
    # and dev-a's commit was not acknowledged: "have" no longer tells what exists elsewhere
    assert not any(line.startswith(b"ACK") for line in text_lines(response.content))


@pytest.mark.parametrize("protocol", [0, 2])
def test_a_foreign_shallow_line_does_not_unshallow_into_another_device(fleet: Fleet,
                                                                       protocol: int) -> None:
    """``shallow <dev-a's tip>`` with an infinite ``deepen`` made upload-pack "unshallow" that
    commit: it added the commit's parents (dev-a's old state) to what it sends."""
    tip_a, tip_b = fleet.tips["dev-a"], fleet.tips["dev-b"]
    if protocol == 2:
        body = v2_request(f"want {tip_b}", f"shallow {tip_a}", f"deepen {INFINITE_DEPTH}",
                        "thin-pack", "ofs-delta", "no-progress", "done")
    else:
        body = v0_fetch([tip_b], [], shallows=(tip_a,), deepen=INFINITE_DEPTH)
    response = fleet.post("dev-b", body, protocol=protocol)
    assert response.status_code in (200, 400, 403), response.text
    objects = assert_nothing_foreign(fleet, "dev-b", response)
    assert fleet.old_a not in objects
    assert not any(tip_a.encode() in line for line in text_lines(response.content))


@pytest.mark.parametrize("protocol", [0, 2])
def test_own_haves_still_make_small_thin_packs(fleet: Fleet, protocol: int) -> None:
    """The gate keeps a device's own haves: an incremental shallow fetch of dev-a against
    its old state is acknowledged and sends the new objects only."""
    tip_a = fleet.tips["dev-a"]
    if protocol == 2:
        body = v2_request(f"want {tip_a}", f"have {fleet.old_a}", "deepen 1", "thin-pack",
                        "ofs-delta", "no-progress", "done")
    else:
        body = v0_fetch([tip_a], [fleet.old_a], deepen=1)
    response = fleet.post("dev-a", body, protocol=protocol)
    assert response.status_code == 200, response.text
    if protocol == 0:  # (v2 answers a "done" request without acknowledgments)
        assert f"ACK {fleet.old_a}".encode() in text_lines(response.content)
    objects = assert_nothing_foreign(fleet, "dev-a", response)
    assert set(objects) == fleet.reachable("dev-a") - fleet.reachable_from(fleet.old_a)


@pytest.mark.parametrize("protocol", [0, 2])
def test_foreign_wants_are_refused(fleet: Fleet, protocol: int) -> None:
    """The SHA1-in-want settings are off (v0) and every want is gated (v2): dev-b cannot ask
    for dev-a's objects by id."""
    repo = pygit2.Repository(str(fleet.store.path))
    tip_a = repo[fleet.tips["dev-a"]].peel(pygit2.Commit)
    for oid in (str(tip_a.id), str(tip_a.tree.id), str(tip_a.tree["deployment.yaml"].id),
                fleet.old_a):
        if protocol == 2:
            body = v2_request(f"want {fleet.tips['dev-b']}", f"want {oid}", "no-progress",
                            "done")
        else:
            body = v0_fetch([fleet.tips["dev-b"], oid], [])
        response = fleet.post("dev-b", body, protocol=protocol)
        assert response.status_code == 403, response.text
        assert_nothing_foreign(fleet, "dev-b", response)


def git(*args: str, cwd: Path | None = None, protocol: int = 2) -> str:
    """The real git CLI, isolated from the caller's configuration and never prompting."""
    result = subprocess.run(["git", "-c", "credential.helper=", "-c",
                             f"protocol.version={protocol}", *args], cwd=cwd, env=git_env(),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"git {' '.join(args)} failed: {result.stderr}"
    return result.stdout


def url(fleet: Fleet, device: str) -> str:
    host = fleet.base.removeprefix("http://")
    return f"http://{device}:{TOKENS[device]}@{host}/git/devices/{device}.git"


@pytest.mark.parametrize("protocol", [0, 2])
def test_stock_git_shallow_clone_deepens_and_unshallows(fleet: Fleet, tmp_path: Path,
                                                         protocol: int) -> None:
    """Shallow work keeps working: the device's own shallow and have lines pass the gate."""
    repo = tmp_path / "a"
    git("clone", "-q", "--depth", "1", url(fleet, "dev-a"), str(repo), protocol=protocol)
    assert git("rev-parse", "--is-shallow-repository", cwd=repo).strip() == "true"
    assert git("rev-list", "--all", cwd=repo).split() == [fleet.tips["dev-a"]]
    git("fetch", "-q", "--unshallow", cwd=repo, protocol=protocol)
    assert git("rev-parse", "--is-shallow-repository", cwd=repo).strip() == "false"
    assert git("rev-list", "HEAD", cwd=repo).split() == [fleet.tips["dev-a"], fleet.old_a]
    git("fsck", "--strict", cwd=repo)


@pytest.mark.parametrize("protocol", [0, 2])
def test_a_repository_holding_another_devices_history_still_fetches(
        fleet: Fleet, tmp_path: Path, protocol: int) -> None:
    """Someone allowed to read both devices keeps them in one repository: fetching dev-b
    sends dev-a's commits as haves, which the gate drops; the fetch still completes."""
    repo = tmp_path / "both"
    git("clone", "-q", url(fleet, "dev-a"), str(repo), protocol=protocol)
    git("fetch", "-q", url(fleet, "dev-b"), "refs/heads/devices/dev-b:refs/heads/b", cwd=repo,
        protocol=protocol)
    assert git("rev-parse", "b", cwd=repo).strip() == fleet.tips["dev-b"]
    git("fsck", "--strict", cwd=repo)


# --- fuzzing the protocol lines -----------------------------------------------------------

#: Request arguments and capabilities of both protocols, some refused, some unknown to Git.
ARGUMENTS = ["thin-pack", "ofs-delta", "no-progress", "include-tag", "done", "deepen 1",
             f"deepen {INFINITE_DEPTH}", "deepen 0", "deepen -1", "deepen-relative",
             "deepen-since 1700000050", "deepen-not refs/heads/devices/dev-a",
             "want-ref refs/heads/devices/dev-a", "filter blob:none", "filter tree:0",
             "sideband-all", "wait-for-done", "packfile-uris https", "symrefs", "peel",
             "unborn", "ref-prefix refs/", "agent=fuzz/1", "object-format=sha256",
             "server-option=x", "size", "multi_ack_detailed", "side-band-64k"]
COMMANDS = ["fetch", "ls-refs", "object-info", "bundle-uri", "push", "", "fetch\x00x"]


@dataclass(frozen=True)
class Pool:
    """Ids worth naming: the three commits (dev-b's tip, dev-a's tip, dev-a's old state),
    then their trees and documents, missing ids and malformed ones."""

    commits: tuple[str, ...]
    others: tuple[str, ...]

    @classmethod
    def of(cls, fleet: Fleet) -> Pool:
        repo = pygit2.Repository(str(fleet.store.path))
        commits = (fleet.tips["dev-b"], fleet.tips["dev-a"], fleet.old_a)
        others = []
        for commit in commits:
            found = repo[commit].peel(pygit2.Commit)
            others += [str(found.tree.id), str(found.tree["deployment.yaml"].id)]
        return cls(commits, (*others, "0" * 40, "f" * 40, commits[0].upper(), "z" * 40,
                             commits[1][:39]))

    @property
    def own_tip(self) -> str:
        return self.commits[0]


@st.composite
def lines(draw: st.DrawFn, pool: Pool) -> bytes:
    """One line of a request. Mostly from a small alphabet of meaningful lines (so that
    combinations such as a foreign have + thin-pack + deepen come up often), else
    object-naming lines with any pool id, commands, capabilities or arbitrary text."""
    if draw(st.integers(0, 9)) < 6:
        meaningful = [f"{keyword} {oid}" for keyword in ("want", "have", "shallow")
                      for oid in pool.commits]
        meaningful += ["thin-pack", "ofs-delta", "deepen 1", f"deepen {INFINITE_DEPTH}",
                       "deepen-relative", "filter blob:none", "include-tag", "no-progress"]
        return (draw(st.sampled_from(meaningful)) + "\n").encode()
    oid = draw(st.sampled_from([*pool.commits, *pool.others]))
    line = draw(st.one_of(
        st.sampled_from(["want", "have", "shallow"]).map(lambda keyword: f"{keyword} {oid}"),
        st.builds(lambda caps: f"want {oid} " + " ".join(caps),
                  st.lists(st.sampled_from(ARGUMENTS), max_size=4)),
        st.sampled_from(COMMANDS).map(lambda command: f"command={command}"),
        st.sampled_from(ARGUMENTS),
        st.text(max_size=30),
    )).encode("utf-8", "surrogatepass")
    raw = draw(st.binary(max_size=20)) if draw(st.integers(0, 9)) == 0 else b""
    return line + raw + (b"\n" if draw(st.booleans()) else b"")


@st.composite
def packet(draw: st.DrawFn, pool: Pool) -> bytes:
    """A pkt-line, mostly well formed: special packets and broken lengths too."""
    choice = draw(st.integers(0, 19))
    if choice == 0:
        return draw(st.sampled_from([b"0000", b"0001", b"0002"]))
    if choice == 1:  # a malformed or lying length
        head = draw(st.sampled_from([b"0003", b"ffff", b"fff1", b"zzzz", b"00 4", b"-001",
                                     b"0fff", b"1000"]))
        return head + draw(st.binary(max_size=40))
    if choice == 2:
        return draw(st.binary(min_size=1, max_size=64))
    return pkt(draw(lines(pool)))


@dataclass(frozen=True)
class Fetch:
    """A fetch request Git accepts: own want first, then haves, shallows, a depth and
    capabilities, and (v2) maybe no ``done`` (a negotiation round)."""

    protocol: int
    claims: tuple[tuple[str, str], ...]  # (have | shallow, oid)
    options: tuple[str, ...]  # v2 arguments or v0 capabilities
    deepen: int | None
    done: bool

    def body(self, own_tip: str, swap: dict[str, str] | None = None) -> bytes:
        """The request, with the ids in `swap` replaced."""
        claims = [(keyword, (swap or {}).get(oid, oid)) for keyword, oid in self.claims]
        if self.protocol == 2:
            arguments = [f"{keyword} {oid}" for keyword, oid in claims]
            arguments += [*self.options, *([f"deepen {self.deepen}"] if self.deepen else []),
                          *(["done"] if self.done else [])]
            return v2_request(f"want {own_tip}", *arguments)
        return v0_fetch([own_tip], [oid for keyword, oid in claims if keyword == "have"],
                        shallows=tuple(oid for keyword, oid in claims if keyword == "shallow"),
                        deepen=self.deepen, capabilities=" ".join(self.options))


@st.composite
def fetches(draw: st.DrawFn, pool: Pool) -> Fetch:
    """Fetches naming any of the three commits (foreign wants are left to
    `fuzzed_requests`: the gate refuses the whole request for them)."""
    protocol = draw(st.sampled_from([0, 2]))
    claims = st.tuples(st.sampled_from(["have", "shallow"]), st.sampled_from(pool.commits))
    options = (["thin-pack", "ofs-delta", "no-progress", "include-tag", "deepen-relative",
                "filter blob:none"] if protocol == 2 else
               ["thin-pack", "ofs-delta", "no-progress", "include-tag", "multi_ack_detailed",
                "side-band-64k", "deepen-relative", "filter"])
    return Fetch(protocol, tuple(draw(st.lists(claims, max_size=5))),
                 tuple(draw(st.lists(st.sampled_from(options), max_size=6, unique=True))),
                 draw(st.sampled_from([None, 1, 2, INFINITE_DEPTH])),
                 protocol == 0 or draw(st.booleans()))


def wellformed_requests(pool: Pool) -> st.SearchStrategy[tuple[int, bytes]]:
    return fetches(pool).map(lambda fetch: (fetch.protocol, fetch.body(pool.own_tip)))


@st.composite
def fuzzed_requests(draw: st.DrawFn, pool: Pool) -> tuple[int, bytes]:
    """(protocol version, upload-pack request body): the frame of a v0 or v2 fetch (own
    want first, done last) around random lines, some packets dropped, maybe cut short."""
    protocol = draw(st.sampled_from([0, 2]))
    middle = draw(st.lists(packet(pool), max_size=10))
    if protocol == 2:
        command = draw(st.sampled_from(["fetch", "fetch", "fetch", "ls-refs"]))
        parts = [pkt(f"command={command}\n"), pkt("object-format=sha1\n"), b"0001",
                 pkt(f"want {pool.own_tip}\n"), *middle, pkt("done\n"), b"0000"]
    else:
        parts = [pkt(f"want {pool.own_tip} side-band-64k thin-pack ofs-delta\n"), *middle,
                 b"0000", *(pkt(line) for line in draw(st.lists(lines(pool), max_size=4))),
                 pkt("done\n")]
    for _ in range(draw(st.integers(0, 2)) if draw(st.booleans()) else 0):
        del parts[draw(st.integers(0, len(parts) - 1))]
    body = b"".join(parts)
    if draw(st.integers(0, 9)) == 0:
        body = body[:draw(st.integers(0, len(body)))]
    return protocol, body


def requests(pool: Pool) -> st.SearchStrategy[tuple[int, bytes]]:
    """Half requests Git accepts (to reach pack building), half fuzzed ones."""
    return st.one_of(wellformed_requests(pool), fuzzed_requests(pool))


def assert_served_well(fleet: Fleet, response: httpx.Response) -> None:
    """Never a server error; Git's own answers carry only dev-b's objects."""
    assert response.status_code < 500, (response.status_code, response.text[:300])
    assert_nothing_foreign(fleet, "dev-b", response, truncated=True)


@pytest.fixture(scope="module")
def pool(fleet: Fleet) -> Pool:
    return Pool.of(fleet)


@settings(max_examples=examples(40, 300), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_upload_pack_requests(fleet: Fleet, pool: Pool, data: st.DataObject) -> None:
    """Random request bodies, plain or gzip-encoded (or claiming to be): never a 5xx, no
    other device's object or delta base in any pack, and the server answers the next
    legitimate request."""
    protocol, body = data.draw(requests(pool), label="request")
    headers = {"Content-Type": UPLOAD_PACK_REQUEST}
    encoding = data.draw(st.sampled_from([None, None, None, "gzip", "lying-gzip"]))
    if encoding == "gzip":
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    elif encoding == "lying-gzip":
        headers["Content-Encoding"] = "gzip"
    version = data.draw(st.sampled_from([f"version={protocol}", f"version={protocol}",
                                         "version=3", "version=2:version=0", "", "x=y:"]))
    if version:
        headers["Git-Protocol"] = version
    response = httpx.post(f"{fleet.base}/git/devices/dev-b.git/git-upload-pack", content=body,
                          headers=headers, auth=("dev-b", TOKENS["dev-b"]), timeout=30)
    assert_served_well(fleet, response)
    still = fleet.post("dev-b", v2_request(f"want {fleet.tips['dev-b']}", "no-progress", "done"))
    assert still.status_code == 200 and fleet.tips["dev-b"] in assert_nothing_foreign(
        fleet, "dev-b", still)


@settings(max_examples=examples(20, 150), deadline=None)
@given(data=st.data())
def test_foreign_ids_are_answered_like_missing_ones(fleet: Fleet, pool: Pool,
                                                    data: st.DataObject) -> None:
    """A fetch naming dev-a's commits in have and shallow lines gets the same protocol
    answer (acknowledgments, shallow and unshallow lines) as the same fetch naming ids that
    exist nowhere: have and shallow no longer tell what the shared repository holds. And
    the answer is complete: acknowledgments for a negotiation round, else a whole pack."""
    fetch = data.draw(fetches(pool))
    missing = {oid: f"{i + 1}" * 40 for i, oid in enumerate(pool.commits[1:])}
    answers = []
    for swap in (None, missing):
        response = fleet.post("dev-b", fetch.body(pool.own_tip, swap), protocol=fetch.protocol)
        assert response.status_code == 200, response.text
        answers.append(text_lines(response.content))
        assert_nothing_foreign(fleet, "dev-b", response)
        negotiating = not fetch.done and any(k == "have" for k, _ in fetch.claims)
        if negotiating:  # (and Git only answers with a pack for a round without haves)
            assert text_lines(response.content)[0] == b"acknowledgments"
        else:
            assert pack_data(response.content)  # (empty if the caller has it all)
    assert answers[0] == answers[1]


@settings(max_examples=examples(30, 150), deadline=None)
@given(query=st.lists(st.tuples(st.sampled_from(["service", "service", "Service", "x", ""]),
                                st.one_of(st.sampled_from(["git-upload-pack",
                                                           "git-receive-pack", "",
                                                           "git-upload-archive"]),
                                          st.text(max_size=20))), max_size=3),
       version=st.sampled_from(["", "version=0", "version=1", "version=2", "version=9"]))
def test_fuzzed_info_refs_queries(fleet: Fleet, query: list[tuple[str, str]],
                                  version: str) -> None:
    """Random ``service`` parameters: never a 5xx, and an advertisement never names another
    device's branch or commit."""
    headers = {"Git-Protocol": version} if version else {}
    response = httpx.get(f"{fleet.base}/git/devices/dev-b.git/info/refs", params=query,
                         headers=headers, auth=("dev-b", TOKENS["dev-b"]), timeout=30)
    assert response.status_code < 500, response.text
    assert b"dev-a" not in response.content
    assert fleet.tips["dev-a"].encode() not in response.content
    services = [value for key, value in query if key == "service"]
    if response.status_code == 200:
        assert services and services[-1] == "git-upload-pack"
