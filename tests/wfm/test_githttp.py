"""Git smart-HTTP hosting (`wfm.git.githttp`) under a real uvicorn server, driven by the real `git`
CLI and by pygit2 (libgit2, protocol v0): each device sees and fetches only its own branch of
the shared fleet-state repository."""

from __future__ import annotations

import asyncio
import gzip
import os
import subprocess
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pygit2
import pytest
from kits.githttpkit import UPLOAD_PACK_REQUEST, basic_authorizer, git_env, pkt, serving, v2_request
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from compiler.gitstore import REPOSITORY_NAME, DeviceCommit, DeviceStore, device_ref
from wfm.git import backend, upload_gate
from wfm.git.githttp import git_app

TOKENS = {"dev-a": "token-a", "dev-b": "token-b", "gw1/child": "token-c", "dev-z": "token-z"}
FILES = {
    "dev-a": {"deployment-a.yaml": b"kind: ApplicationDeployment\nname: a\n", "a.txt": b"A\n"},
    "dev-b": {"deployment-b.yaml": b"kind: ApplicationDeployment\nname: b\n", "secret": b"B\n"},
    "gw1/child": {"child.yaml": b"kind: ApplicationDeployment\nname: child\n"},
}


# --- the server under test --------------------------------------------------------------


class ByteCounter:
    """ASGI middleware recording every exchange and its response BODY bytes (HTTP headers
    excluded): what a poll costs on the wire beyond the fixed HTTP overhead."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.exchanges: list[dict[str, Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record: dict[str, Any] = {"method": scope["method"], "path": scope["path"],
                                  "status": None, "bytes": 0, "ms": 0.0}
        self.exchanges.append(record)

        async def counting_send(message: Message) -> None:
            # counted before sending, so the client cannot finish before we counted
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
            elif message["type"] == "http.response.body":
                record["bytes"] += len(message.get("body", b""))
            await send(message)

        started = time.perf_counter()
        await self.app(scope, receive, counting_send)
        record["ms"] = (time.perf_counter() - started) * 1000

    @property
    def total(self) -> int:
        return sum(e["bytes"] for e in self.exchanges)


def make_app(repository: Path, *, git: str = "git") -> ByteCounter:
    """The fleet server's shape: the Git app mounted at /git, wrapped by a byte counter."""
    git_hosting = git_app(repository, basic_authorizer(TOKENS), git=git)
    inner = Starlette(routes=[Mount("/git", app=git_hosting)])
    return ByteCounter(inner)


@dataclass
class Fleet:
    """A fleet-state store with three device branches, served over HTTP."""

    store: DeviceStore
    base: str
    counter: ByteCounter
    tips: dict[str, str] = field(default_factory=dict)

    def url(self, device: str, *, user: str | None = None, password: str | None = None,
            credentials: bool = True) -> str:
        """The device's clone URL, with its own credentials unless told otherwise."""
        host = self.base.removeprefix("http://")
        if credentials:
            user = device if user is None else user
            password = TOKENS.get(user, "nope") if password is None else password
            host = f"{urllib.parse.quote(user, safe='')}:{password}@{host}"
        return f"http://{host}/git/devices/{device}.git"

    def commit(self, device: str, files: dict[str, bytes]) -> str:
        tip = self.store.write([DeviceCommit(device, files, "update", 1_700_000_100)])[device]
        self.tips[device] = tip
        return tip


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    store = DeviceStore(tmp_path / "repos")
    tips = store.write([DeviceCommit(d, f, f"state of {d}", 1_700_000_000)
                        for d, f in FILES.items()])
    counter = make_app(store.path)
    with serving(counter) as base:
        yield Fleet(store, base, counter, dict(tips))


# --- helpers ----------------------------------------------------------------------------


def git(*args: str, cwd: Path | None = None, check: bool = True,
        protocol: int | None = None) -> subprocess.CompletedProcess[str]:
    """The real git CLI, isolated from the caller's configuration and never prompting."""
    env = {**git_env(), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    options = ["-c", "credential.helper=", "-c", "init.defaultBranch=main"]
    if protocol is not None:
        options += ["-c", f"protocol.version={protocol}"]
    result = subprocess.run(["git", *options, *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {result.stderr}")
    return result


def work_tree_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.name != ".git"}


def clone(fleet: Fleet, device: str, dest: Path, *, protocol: int | None = None,
          branch: bool = True) -> Path:
    extra = ["--branch", device_ref(device).removeprefix("refs/heads/")] if branch else []
    git("clone", "-q", *extra, fleet.url(device), str(dest), protocol=protocol)
    return dest


def has_object(repo: Path, oid: str) -> bool:
    return git("cat-file", "-e", oid, cwd=repo, check=False).returncode == 0


def remote_refs(fleet: Fleet, device: str, protocol: int) -> dict[str, str]:
    out = git("ls-remote", fleet.url(device), protocol=protocol).stdout
    return {name: oid for oid, name in (line.split("\t") for line in out.splitlines())}


def post_upload_pack(fleet: Fleet, device: str, body: bytes | Iterator[bytes], *,
                     protocol: int = 2, headers: dict[str, str] | None = None) -> httpx.Response:
    all_headers = {"Content-Type": UPLOAD_PACK_REQUEST, **(headers or {})}
    if protocol:
        all_headers["Git-Protocol"] = f"version={protocol}"
    return httpx.post(f"{fleet.base}/git/devices/{device}.git/git-upload-pack", content=body,
                      headers=all_headers, auth=(device, TOKENS[device]), timeout=30)


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["type"] == "about:blank" and body["status"] == status
    assert body["title"] and body["detail"]
    return body


def wait_until_gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


# --- what a device sees ------------------------------------------------------------------


def test_clone_with_branch_gets_exactly_the_devices_files(fleet: Fleet, tmp_path: Path) -> None:
    repo = clone(fleet, "dev-a", tmp_path / "a")
    assert work_tree_files(repo) == FILES["dev-a"]
    assert git("rev-parse", "HEAD", cwd=repo).stdout.strip() == fleet.tips["dev-a"]
    remote_refs = git("for-each-ref", "--format=%(refname)", "refs/remotes", cwd=repo).stdout
    assert remote_refs.split() == ["refs/remotes/origin/HEAD", "refs/remotes/origin/devices/dev-a"]
    assert not has_object(repo, fleet.tips["dev-b"])


@pytest.mark.parametrize("protocol", [0, 2])
def test_fetching_the_branch_by_name_works(fleet: Fleet, tmp_path: Path, protocol: int) -> None:
    repo = tmp_path / "empty"
    git("init", "-q", str(repo))
    git("fetch", "-q", fleet.url("dev-a"), "refs/heads/devices/dev-a", cwd=repo,
        protocol=protocol)
    assert git("rev-parse", "FETCH_HEAD", cwd=repo).stdout.strip() == fleet.tips["dev-a"]
    failed = git("fetch", "-q", fleet.url("dev-a"), "refs/heads/devices/dev-b", cwd=repo,
                 protocol=protocol, check=False)
    assert failed.returncode != 0 and "couldn't find remote ref" in failed.stderr


@pytest.mark.parametrize("protocol", [0, 2])
def test_plain_clone_checks_out_the_device_branch(fleet: Fleet, tmp_path: Path,
                                                  protocol: int) -> None:
    """HEAD of the served view is a symref to the device branch, so no --branch is needed."""
    repo = clone(fleet, "dev-a", tmp_path / "a", protocol=protocol, branch=False)
    assert git("symbolic-ref", "HEAD", cwd=repo).stdout.strip() == "refs/heads/devices/dev-a"
    assert work_tree_files(repo) == FILES["dev-a"]


@pytest.mark.parametrize("protocol", [0, 2])
def test_ls_remote_shows_only_the_devices_branch(fleet: Fleet, protocol: int) -> None:
    fleet.counter.exchanges.clear()
    assert remote_refs(fleet, "dev-a", protocol) == {
        "HEAD": fleet.tips["dev-a"], "refs/heads/devices/dev-a": fleet.tips["dev-a"]}
    symref = git("ls-remote", "--symref", fleet.url("dev-a"), "HEAD", protocol=protocol).stdout
    assert symref.splitlines()[0] == "ref: refs/heads/devices/dev-a\tHEAD"
    # v2 lists refs with a POSTed ls-refs command, v0 in the GET advertisement: the protocol
    # really was the one asked for
    posts = [e for e in fleet.counter.exchanges if e["method"] == "POST"]
    assert bool(posts) == (protocol == 2)


def test_the_shared_repository_head_is_never_served(fleet: Fleet) -> None:
    """Even if the shared repository's HEAD pointed at another device, a device's HEAD is
    its own branch."""
    (fleet.store.path / "HEAD").write_text("ref: refs/heads/devices/dev-b\n")
    for protocol in (0, 2):
        assert remote_refs(fleet, "dev-a", protocol)["HEAD"] == fleet.tips["dev-a"]


@pytest.mark.parametrize("protocol", [0, 2])
@pytest.mark.parametrize("kind", ["commit", "tree", "blob"])
def test_another_devices_objects_cannot_be_fetched_by_id(fleet: Fleet, tmp_path: Path,
                                                         protocol: int, kind: str) -> None:
    repo = clone(fleet, "dev-a", tmp_path / "a")
    foreign = pygit2.Repository(str(fleet.store.path))[fleet.tips["dev-b"]]
    oid = {"commit": str(foreign.id), "tree": str(foreign.tree.id),
           "blob": str(foreign.tree["secret"].id)}[kind]
    result = git("fetch", "origin", oid, cwd=repo, check=False, protocol=protocol)
    assert result.returncode != 0
    assert not has_object(repo, oid)


def test_v0_requests_for_unadvertised_objects_are_refused(fleet: Fleet) -> None:
    """What a v0 client gets when it bypasses its own client-side check (Git itself would
    answer "not our ref"; the gate answers first)."""
    body = pkt(f"want {fleet.tips['dev-b']} side-band-64k ofs-delta\n") + b"0000" + pkt("done\n")
    assert_problem(post_upload_pack(fleet, "dev-a", body, protocol=0), 403)


def test_v2_fetch_of_own_objects_succeeds(fleet: Fleet) -> None:
    first = fleet.tips["dev-a"]
    fleet.commit("dev-a", {"a.txt": b"A2\n"})
    own_blob = str(pygit2.Repository(str(fleet.store.path))[fleet.tips["dev-a"]]
                   .peel(pygit2.Tree)["a.txt"].id)
    for wants in ([fleet.tips["dev-a"]], [first], [own_blob]):
        body = v2_request(*(f"want {w}" for w in wants), "no-progress", "done")
        response = post_upload_pack(fleet, "dev-a", body)
        assert response.status_code == 200 and b"packfile\n" in response.content


def chunked_by(data: bytes, size: int) -> Iterator[bytes]:
    """`data` as a chunked request body of `size`-byte pieces."""
    yield from (data[i:i + size] for i in range(0, len(data), size))


@pytest.mark.parametrize("case", [
    "want", "uppercase-want", "want-with-suffix", "gzip", "zlib", "byte-by-byte", "want-ref",
    "deepen-not", "object-info"])
def test_v2_requests_reaching_beyond_the_branch_are_refused(fleet: Fleet, case: str) -> None:
    tip_b = fleet.tips["dev-b"]
    body: bytes | Iterator[bytes] = v2_request(f"want {tip_b}", "done")
    headers: dict[str, str] = {}
    if case == "uppercase-want":
        body = v2_request(f"want {tip_b.upper()}", "done")
    elif case == "want-with-suffix":
        body = v2_request(f"want {tip_b} trailing", "done")
    elif case == "gzip":
        body, headers = gzip.compress(body), {"Content-Encoding": "gzip"}
    elif case == "zlib":
        body, headers = zlib.compress(body), {"Content-Encoding": "x-gzip"}
    elif case == "byte-by-byte":
        body = chunked_by(v2_request(f"want {fleet.tips['dev-a']}", f"want {tip_b}", "done"), 1)
    elif case == "want-ref":
        body = v2_request("want-ref refs/heads/devices/dev-b", "done")
    elif case == "deepen-not":
        body = v2_request(f"want {fleet.tips['dev-a']}", "deepen-not devices/dev-b", "done")
    elif case == "object-info":
        body = v2_request("size", f"oid {tip_b}", command="object-info")
    problem = assert_problem(post_upload_pack(fleet, "dev-a", body, headers=headers), 403)
    assert "not" in problem["detail"]


def test_v0_requests_naming_refs_are_refused(fleet: Fleet) -> None:
    """deepen-not names a ref; Git's "ambiguous deepen-not" error would tell which device
    branches exist."""
    body = (pkt(f"want {fleet.tips['dev-a']} side-band-64k\n") + pkt("deepen 1\n")
            + pkt("deepen-not refs/heads/devices/dev-b\n") + b"0000" + pkt("done\n"))
    assert_problem(post_upload_pack(fleet, "dev-a", body, protocol=0), 403)


@pytest.mark.parametrize("encoding", [None, "gzip"])
def test_large_legitimate_requests_stream_through(fleet: Fleet, encoding: str | None) -> None:
    """Thousands of have lines (a long negotiation), inflating to many 64 KiB pieces."""
    haves = [f"have {i:040x}" for i in range(6000)]
    body = v2_request(f"want {fleet.tips['dev-a']}", *haves, "no-progress", "done")
    headers: dict[str, str] = {}
    if encoding:
        body, headers = gzip.compress(body), {"Content-Encoding": encoding}
    response = post_upload_pack(fleet, "dev-a", chunked_by(body, 1000), headers=headers)
    assert response.status_code == 200 and b"packfile\n" in response.content


def test_oversized_requests_are_refused(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload_gate, "MAX_REQUEST_BYTES", 4096)
    haves = [f"have {i:040x}" for i in range(200)]
    body = gzip.compress(v2_request(f"want {fleet.tips['dev-a']}", *haves, "done"))
    response = post_upload_pack(fleet, "dev-a", body, headers={"Content-Encoding": "gzip"})
    assert_problem(response, 413)


@pytest.mark.parametrize(("encoding", "body", "status"), [
    ("gzip", b"not gzip at all", 400),
    ("deflate", b"whatever", 415),
    (None, b"zz!!" + b"0" * 10, 400),
])
def test_malformed_v2_requests_are_refused(fleet: Fleet, encoding: str | None, body: bytes,
                                           status: int) -> None:
    headers = {"Content-Encoding": encoding} if encoding else {}
    assert_problem(post_upload_pack(fleet, "dev-a", body, headers=headers), status)


def split_request(fleet: Fleet) -> tuple[bytes, bytes]:
    """A legitimate v2 fetch, cut in two where the command's arguments begin."""
    whole = v2_request(f"want {fleet.tips['dev-a']}", "no-progress", "done")
    cut = whole.index(b"0001") + 4
    return whole[:cut], whole[cut:]


@pytest.mark.parametrize("case", ["two-members", "garbage-after-the-end", "cut-short"])
def test_a_gzip_body_that_is_not_exactly_one_stream_is_refused(fleet: Fleet,
                                                                case: str) -> None:
    """Git inflates one gzip member and drops the rest, so a request sent as two members
    reached upload-pack cut short and was answered with an empty 200; a body that ends
    inside the stream as well: both are 400 problems now (Git's client sends one member)."""
    first, second = split_request(fleet)
    if case == "two-members":
        body = gzip.compress(first) + gzip.compress(second)
    elif case == "garbage-after-the-end":
        body = gzip.compress(first + second) + b"0000"
    else:
        body = gzip.compress(first + second)[:-6]
    for chunks in (body, chunked_by(body, 7)):
        problem = assert_problem(post_upload_pack(fleet, "dev-a", chunks,
                                                  headers={"Content-Encoding": "gzip"}), 400)
        assert "gzip" in problem["detail"]
    whole = gzip.compress(first + second)  # and one member of the same request is served
    response = post_upload_pack(fleet, "dev-a", whole, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 200 and b"packfile\n" in response.content


# --- who may read what -------------------------------------------------------------------


@pytest.mark.parametrize(("device", "user", "password", "credentials"), [
    ("dev-a", "dev-a", "wrong", True),
    ("dev-a", None, None, False),
    ("dev-b", "dev-a", "token-a", True),
    ("gw1/child", "gw1", "token-c", True),
])
def test_wrong_or_missing_credentials_are_refused(fleet: Fleet, device: str, user: str | None,
                                                  password: str | None,
                                                  credentials: bool) -> None:
    url = fleet.url(device, user=user, password=password, credentials=credentials)
    for protocol in (0, 2):
        result = git("ls-remote", url, protocol=protocol, check=False)
        assert result.returncode != 0 and "refs/heads" not in result.stdout
    auth = None if user is None else (user, password or "")
    for path in ("info/refs?service=git-upload-pack", "git-upload-pack"):
        method = "GET" if path.startswith("info") else "POST"
        response = httpx.request(method, f"{fleet.base}/git/devices/{device}.git/{path}",
                                 auth=auth, headers={"Content-Type": UPLOAD_PACK_REQUEST})
        assert_problem(response, 401)
        assert response.headers["www-authenticate"] == 'Basic realm="margo-gitops"'


def test_device_without_branch_is_404_only_for_its_owner(fleet: Fleet) -> None:
    url = f"{fleet.base}/git/devices/dev-z.git/info/refs?service=git-upload-pack"
    assert_problem(httpx.get(url), 401)
    assert_problem(httpx.get(url, auth=("dev-z", "wrong")), 401)
    assert_problem(httpx.get(url, auth=("dev-z", TOKENS["dev-z"])), 404)


def test_a_synchronous_authorize_hook_works(fleet: Fleet) -> None:
    seen: list[str] = []

    def allow_dev_a(_request: Request, device_id: str) -> bool:
        seen.append(device_id)
        return device_id == "dev-a"

    app = git_app(fleet.store.path, allow_dev_a)

    async def probe() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            ok = await client.get("/devices/dev-a.git/info/refs?service=git-upload-pack")
            no = await client.get("/devices/dev-b.git/info/refs?service=git-upload-pack")
        assert b"refs/heads/devices/dev-a" in ok.content
        return ok.status_code, no.status_code

    assert asyncio.run(probe()) == (200, 401)
    assert seen == ["dev-a", "dev-b"]


def test_push_and_dumb_http_are_refused(fleet: Fleet, tmp_path: Path) -> None:
    repo = clone(fleet, "dev-a", tmp_path / "a")
    (repo / "a.txt").write_bytes(b"tampered\n")
    git("commit", "-qam", "tamper", cwd=repo)
    push = git("push", "origin", "HEAD", cwd=repo, check=False)
    assert push.returncode != 0
    assert fleet.store.tip("dev-a") == fleet.tips["dev-a"]

    auth = ("dev-a", TOKENS["dev-a"])
    device = f"{fleet.base}/git/devices/dev-a.git"
    tip = fleet.tips["dev-a"]
    for method, path, status in [
        ("GET", "/info/refs?service=git-receive-pack", 403),
        ("POST", "/git-receive-pack", 403),
        ("GET", "/info/refs", 403),  # dumb HTTP: would list EVERY ref
        ("GET", "/HEAD", 404),
        ("GET", "/objects/info/packs", 404),
        ("GET", f"/objects/{tip[:2]}/{tip[2:]}", 404),
        ("PUT", "/info/refs?service=git-upload-pack", 405),
        ("GET", "/git-upload-pack", 405),
    ]:
        assert_problem(httpx.request(method, device + path, auth=auth), status)
    assert_problem(httpx.get(f"{fleet.base}/git/", auth=auth), 404)
    assert_problem(httpx.get(f"{fleet.base}/git/{REPOSITORY_NAME}/info/refs"), 404)


def test_concurrent_devices_each_see_only_their_own_branch(fleet: Fleet) -> None:
    devices = ["dev-a", "dev-b", "gw1/child"] * 4

    def refs(job: tuple[int, str]) -> tuple[str, dict[str, str]]:
        index, device = job
        return device, remote_refs(fleet, device, protocol=index % 3)

    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        results = list(pool.map(refs, enumerate(devices)))
    for device, seen in results:
        assert seen == {"HEAD": fleet.tips[device], device_ref(device): fleet.tips[device]}


# --- polling and incremental fetches -----------------------------------------------------


@pytest.mark.parametrize("protocol", [0, 2])
def test_a_no_change_poll_transfers_little(fleet: Fleet, tmp_path: Path, protocol: int) -> None:
    """The git CLI sends credentials only after a 401 challenge (curl's default), so each
    poll is that challenge plus v0's advertisement or v2's capabilities and ls-refs."""
    repo = clone(fleet, "dev-a", tmp_path / "a", protocol=protocol)
    fleet.counter.exchanges.clear()
    git("fetch", "origin", cwd=repo, protocol=protocol)
    poll = list(fleet.counter.exchanges)
    rounds = 10
    started = time.perf_counter()
    for _ in range(rounds):
        git("fetch", "origin", cwd=repo, protocol=protocol)
    ms = (time.perf_counter() - started) * 1000 / rounds
    parts = ", ".join(f"{e['method']} {e['path'].rsplit('/', 1)[-1]} {e['status']}: "
                      f"{e['bytes']} B" for e in poll)
    server_ms = sum(e["ms"] for e in fleet.counter.exchanges[len(poll):]) / rounds
    total = sum(e["bytes"] for e in poll)
    print(f"\ngit CLI protocol v{protocol} no-change poll: {total} response body bytes "
          f"({parts}); {ms:.1f} ms per poll with the git process, {server_ms:.1f} ms of it "
          f"in the server")
    assert total < 1024
    assert [e["status"] for e in poll] == [401] + [200] * (len(poll) - 1)
    assert len(poll) == (2 if protocol == 0 else 3)


def test_incremental_fetch_gets_a_new_commit(fleet: Fleet, tmp_path: Path) -> None:
    repo = clone(fleet, "dev-a", tmp_path / "a")
    first = fleet.tips["dev-a"]
    new_files = {**FILES["dev-a"], "a.txt": b"A2\n", "new.yaml": b"x: 1\n"}
    tip = fleet.commit("dev-a", new_files)
    fleet.counter.exchanges.clear()
    git("fetch", "origin", cwd=repo)
    print(f"\nincremental fetch of one commit: {fleet.counter.total} response body bytes")
    assert git("rev-parse", "origin/devices/dev-a", cwd=repo).stdout.strip() == tip
    git("merge", "-q", "--ff-only", "origin/devices/dev-a", cwd=repo)
    assert work_tree_files(repo) == new_files
    # and a device may fetch its own history by id
    git("fetch", "origin", first, cwd=repo)


def test_hierarchical_device_ids_work(fleet: Fleet, tmp_path: Path) -> None:
    ref = device_ref("gw1/child")
    for protocol in (0, 2):
        assert remote_refs(fleet, "gw1/child", protocol) == {"HEAD": fleet.tips["gw1/child"],
                                                             ref: fleet.tips["gw1/child"]}
    repo = clone(fleet, "gw1/child", tmp_path / "child")
    assert work_tree_files(repo) == FILES["gw1/child"]
    assert git("rev-parse", "HEAD", cwd=repo).stdout.strip() == fleet.tips["gw1/child"]


# --- pygit2 (libgit2 speaks protocol v0 only) --------------------------------------------


def callbacks(device: str, password: str | None = None) -> pygit2.RemoteCallbacks:
    """Credentials offered once: libgit2 asks again after a 401, and a second ask means the
    credentials were refused."""

    class Once(pygit2.RemoteCallbacks):
        asked = 0

        def credentials(self, url: str, username_from_url: str | None,
                        allowed_types: Any) -> pygit2.UserPass:
            self.asked += 1
            if self.asked > 1:
                raise pygit2.GitError("credentials refused")
            return pygit2.UserPass(device, TOKENS[device] if password is None else password)

    return Once()


def test_pygit2_clone_poll_and_incremental_fetch(fleet: Fleet, tmp_path: Path) -> None:
    url = fleet.url("dev-a", credentials=False)
    repo = pygit2.clone_repository(url, str(tmp_path / "a"), callbacks=callbacks("dev-a"))
    assert repo.head.name == "refs/heads/devices/dev-a"
    assert work_tree_files(tmp_path / "a") == FILES["dev-a"]
    remote = repo.remotes["origin"]
    heads = {h.name: str(h.oid) for h in remote.list_heads(callbacks=callbacks("dev-a"))}
    assert heads == {"HEAD": fleet.tips["dev-a"], "refs/heads/devices/dev-a": fleet.tips["dev-a"]}

    fleet.counter.exchanges.clear()
    rounds = 10
    started = time.perf_counter()
    for _ in range(rounds):
        remote.fetch(callbacks=callbacks("dev-a"))
    ms = (time.perf_counter() - started) * 1000 / rounds
    per_poll = fleet.counter.total / rounds
    server_ms = sum(e["ms"] for e in fleet.counter.exchanges) / rounds
    print(f"\npygit2 (protocol v0) no-change poll: {per_poll:.0f} response body bytes in "
          f"{len(fleet.counter.exchanges) / rounds:.0f} request(s), {ms:.1f} ms per poll, "
          f"{server_ms:.1f} ms of it in the server")
    assert per_poll < 1024

    tip = fleet.commit("dev-a", {"a.txt": b"A3\n"})
    remote.fetch(callbacks=callbacks("dev-a"))
    assert str(repo.references["refs/remotes/origin/devices/dev-a"].target) == tip

    with pytest.raises(pygit2.GitError):
        remote.fetch([fleet.tips["dev-b"]], callbacks=callbacks("dev-a"))
    assert fleet.tips["dev-b"] not in repo


def test_pygit2_with_wrong_credentials_fails(fleet: Fleet, tmp_path: Path) -> None:
    url = fleet.url("dev-a", credentials=False)
    with pytest.raises(pygit2.GitError):
        pygit2.clone_repository(url, str(tmp_path / "a"), callbacks=callbacks("dev-a", "bad"))
    with pytest.raises(pygit2.GitError):
        pygit2.clone_repository(url, str(tmp_path / "b"), callbacks=callbacks("dev-b"))


# --- process handling --------------------------------------------------------------------


def fake_git(tmp_path: Path, script: str) -> tuple[str, Path]:
    """An executable standing in for git: records its pid, then runs `script`."""
    pid_file = tmp_path / "fake-git.pid"
    program = tmp_path / "fake-git"
    program.write_text(f"#!/bin/sh\necho $$ > {pid_file}\n{script}\n")
    program.chmod(0o755)
    return str(program), pid_file


def test_git_running_too_long_is_killed(fleet: Fleet, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    program, pid_file = fake_git(tmp_path, "exec sleep 60")
    monkeypatch.setattr(backend, "PROCESS_TIMEOUT", 0.5)
    with serving(make_app(fleet.store.path, git=program)) as base:
        response = httpx.get(f"{base}/git/devices/dev-a.git/info/refs?service=git-upload-pack",
                             auth=("dev-a", TOKENS["dev-a"]), timeout=10)
    assert_problem(response, 504)
    assert wait_until_gone(int(pid_file.read_text()))


def test_git_is_killed_when_the_client_disconnects(fleet: Fleet, tmp_path: Path) -> None:
    program, pid_file = fake_git(
        tmp_path, r"printf 'Content-Type: text/plain\r\n\r\nfirst bytes\n'; exec sleep 60")
    with serving(make_app(fleet.store.path, git=program)) as base:
        url = f"{base}/git/devices/dev-a.git/info/refs?service=git-upload-pack"
        with httpx.stream("GET", url, auth=("dev-a", TOKENS["dev-a"]), timeout=10) as response:
            assert response.status_code == 200
            assert next(response.iter_raw()).startswith(b"first bytes")
        pid = int(pid_file.read_text())
        assert wait_until_gone(pid)


def test_git_without_a_cgi_answer_is_a_502(fleet: Fleet, tmp_path: Path) -> None:
    program, _ = fake_git(tmp_path, "echo 'not a header block'; exit 1")
    with serving(make_app(fleet.store.path, git=program)) as base:
        response = httpx.get(f"{base}/git/devices/dev-a.git/info/refs?service=git-upload-pack",
                             auth=("dev-a", TOKENS["dev-a"]))
    assert_problem(response, 502)


def test_git_missing_on_the_server_is_a_503(fleet: Fleet, tmp_path: Path) -> None:
    with serving(make_app(fleet.store.path, git=str(tmp_path / "no-such-git"))) as base:
        response = httpx.get(f"{base}/git/devices/dev-a.git/info/refs?service=git-upload-pack",
                             auth=("dev-a", TOKENS["dev-a"]))
    assert_problem(response, 503)
