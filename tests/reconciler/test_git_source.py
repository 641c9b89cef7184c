"""The Git source against the device repositories a real `margo serve` hosts over smart HTTP
(and, for documents the server would never write, a local repository built with pygit2)."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pygit2
import pytest
from kits.fleetserver import FleetServer, capabilities, fleet_server, write_fleet
from kits.serverkit import free_port

from margo.digests import digest_of
from reconciler.desired import DesiredState
from reconciler.sources import Adopted, IntegrityError, SourceError
from reconciler.sources.git_source import LOCAL_REF, MAX_PACKS, NO_BRANCH_VERSION, GitSource
from reconciler.sources.rest_source import RestSource

GPU = "k8s-cluster-gpu"
_confidence = itertools.count(51)  # 0.51, 0.52, ...: inside the application's 0.1-0.99


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    root = tmp_path_factory.mktemp("git-source")
    with fleet_server(root, fleet=write_fleet(root / "fleet")) as running:
        running.put_capabilities(capabilities(GPU))
        running.wait_for_deployments(4)
        yield running


def git_source(server: FleetServer, cache: Path, *, device_id: str = GPU,
               password: str | None = None, username: str | None = None) -> GitSource:
    return GitSource(server.git_url(device_id), cache_dir=cache,
                     username=username or server.client_id, password=password or server.token)


def fetched(source: GitSource, adopted: Adopted | None = None) -> DesiredState:
    state = source.fetch(adopted or Adopted())
    assert state is not None
    return state


def ids_and_digests(state: DesiredState) -> list[tuple[str, str]]:
    return sorted((d.deployment_id, d.digest) for d in state.deployments)


def test_the_first_fetch_returns_the_branch_deployments(server: FleetServer,
                                                        tmp_path: Path) -> None:
    with git_source(server, tmp_path / "cache") as git:
        state = fetched(git)
    assert state.source == "git" and state.manifest_version is None and state.etag is None
    assert len(state.version) == 40 and int(state.version, 16) >= 0
    assert sorted(d.name for d in state.deployments) == [
        "ha-web", "hello-everywhere", "line-monitor", "vision-plant-a"]
    assert all(d.device_id == GPU and digest_of(d.document) == d.digest
               for d in state.deployments)
    history = server.device(GPU)["history"]
    assert state.version == history[0]["commit"]


def test_an_unchanged_poll_returns_none_and_reads_only_the_ref_advertisement(
        server: FleetServer, tmp_path: Path) -> None:
    with git_source(server, tmp_path / "cache") as git:
        state = fetched(git)
        packs = sorted((tmp_path / "cache" / "objects" / "pack").glob("*.pack"))
        started = time.perf_counter()
        assert git.fetch(Adopted(version=state.version)) is None
        elapsed = time.perf_counter() - started
        # nothing was fetched: no new pack (the wall time is printed, never asserted)
        assert sorted((tmp_path / "cache" / "objects" / "pack").glob("*.pack")) == packs
    print(f"unchanged git poll: {elapsed * 1000:.1f} ms")


def test_a_change_gives_a_new_commit_fetched_at_depth_one(server: FleetServer,
                                                         tmp_path: Path) -> None:
    with git_source(server, tmp_path / "cache") as git:
        before = fetched(git)
        history = len(server.device(GPU)["history"])
        server.set_parameter("vision-plant-a", "confidence", f"0.{next(_confidence)}")
        server.wait_for(lambda: len(server.device(GPU)["history"]) > history,
                        what="a new commit on the device branch")
        after = fetched(git, Adopted(version=before.version))
    assert after.version != before.version
    old, new = before.by_id(), after.by_id()
    assert old.keys() == new.keys()
    assert [new[i].name for i in new if new[i].digest != old[i].digest] == ["vision-plant-a"]
    repo = pygit2.Repository(str(tmp_path / "cache"))
    try:
        tip = repo.references[LOCAL_REF].target
        assert str(tip) == after.version
        assert [str(c.id) for c in repo.walk(tip)] == [after.version]  # one commit local
        assert repo.is_shallow
    finally:
        repo.free()


def test_a_fetched_but_unadopted_commit_is_read_from_the_cache(server: FleetServer,
                                                               tmp_path: Path) -> None:
    with git_source(server, tmp_path / "cache") as git:
        first = fetched(git)
        packs = sorted((tmp_path / "cache" / "objects" / "pack").glob("*.pack"))
        again = fetched(git)  # the runner did not adopt it (say, applying failed)
        assert sorted((tmp_path / "cache" / "objects" / "pack").glob("*.pack")) == packs
    assert ids_and_digests(again) == ids_and_digests(first)


def test_both_sources_give_the_same_deployments(server: FleetServer, tmp_path: Path) -> None:
    with git_source(server, tmp_path / "cache") as git:
        through_git = fetched(git)
    with server.client() as http:
        through_rest = RestSource(http, device_id=GPU).fetch(Adopted())
    assert through_rest is not None
    assert ids_and_digests(through_git) == ids_and_digests(through_rest)


def test_wrong_or_missing_credentials_are_unauthorized(server: FleetServer,
                                                       tmp_path: Path) -> None:
    for username, password in ((server.client_id, "wrong"), ("someone", server.token)):
        with git_source(server, tmp_path / "cache", username=username,
                        password=password) as git, pytest.raises(SourceError) as raised:
            git.fetch(Adopted())
        assert (raised.value.code, raised.value.retryable) == ("UNAUTHORIZED", False)
    anonymous = GitSource(server.git_url(GPU), cache_dir=tmp_path / "anonymous")
    with anonymous, pytest.raises(SourceError) as raised:
        anonymous.fetch(Adopted())
    assert raised.value.code == "UNAUTHORIZED"


def test_a_device_the_server_does_not_know_is_unauthorized(server: FleetServer,
                                                           tmp_path: Path) -> None:
    """The server answers 401 for a device no client has reported (it reveals nothing)."""
    with git_source(server, tmp_path / "cache", device_id="never-reported") as git, \
            pytest.raises(SourceError) as raised:
        git.fetch(Adopted())
    assert raised.value.code == "UNAUTHORIZED"


def test_a_stopped_server_is_unreachable(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/git/devices/{GPU}.git"
    with GitSource(url, cache_dir=tmp_path / "cache", username="u", password="p") as git, \
            pytest.raises(SourceError) as raised:
        git.fetch(Adopted())
    assert (raised.value.code, raised.value.retryable) == ("UNREACHABLE", True)


def test_a_broken_cache_is_rebuilt(server: FleetServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "HEAD").write_text("this is not a repository\n")
    with git_source(server, cache) as git:
        assert len(fetched(git).deployments) == 4


def test_damaged_local_copies_are_delivered_again_from_the_same_commit(
        server: FleetServer, tmp_path: Path) -> None:
    """The runner found that stored documents no longer match their digests: an unchanged
    tip must not be "nothing changed" then. And when the cache's own objects are damaged
    (their bytes overwritten on disk here), libgit2's hash checks notice, and the cache is
    rebuilt and fetched again."""
    cache = tmp_path / "cache"
    with git_source(server, cache) as git:
        state = fetched(git)
        damaged = Adopted(version=state.version,
                          damaged=(state.deployments[0].deployment_id,))
        again = fetched(git, damaged)
        assert again.version == state.version
        assert ids_and_digests(again) == ids_and_digests(state)
    for pack in (cache / "objects" / "pack").glob("*.pack"):
        data = bytearray(pack.read_bytes())
        data[12:-20] = b"\x5a" * (len(data) - 32)  # every object; header and trailer kept
        pack.chmod(0o644)
        pack.write_bytes(bytes(data))
    with git_source(server, cache) as git:
        repaired = fetched(git, damaged)
    assert ids_and_digests(repaired) == ids_and_digests(state)


# --- a device without a branch -------------------------------------------------------------


def test_a_device_without_a_branch(tmp_path: Path) -> None:
    """What the server does: with `--host-source` and nothing pushed yet, nothing is
    compiled, so a reported device has no branch; its repository answers 404 (after the
    credentials are accepted) while its REST manifest is empty. Only a device that never had
    state may read that as an empty desired state."""
    with fleet_server(tmp_path, extra_args=["--host-source"]) as server:
        server.put_capabilities(capabilities(GPU))
        manifest, _ = server.manifest()
        assert manifest["deployments"] == []
        with server.client() as http:
            refs = http.get(f"{server.git_url(GPU)}/info/refs",
                            params={"service": "git-upload-pack"},
                            auth=httpx.BasicAuth(server.client_id, server.token))
            assert refs.status_code == 404
        with git_source(server, tmp_path / "cache") as git:
            empty = fetched(git)
            assert (empty.version, empty.deployments) == (NO_BRANCH_VERSION, ())
            assert git.fetch(Adopted(version=NO_BRANCH_VERSION)) is None  # still nothing
            with pytest.raises(SourceError) as raised:
                git.fetch(Adopted(version="ab" * 20))
        assert (raised.value.code, raised.value.retryable) == ("NO_BRANCH", True)
        assert not isinstance(raised.value, IntegrityError)


def test_a_device_with_nothing_to_deploy_gets_an_empty_branch(tmp_path: Path) -> None:
    """Without a fleet source every device gets a branch with an empty tree: a commit."""
    with fleet_server(tmp_path) as server:
        server.put_capabilities(capabilities(GPU))
        server.wait_for(lambda: server.device(GPU)["history"], what="the device's branch")
        with git_source(server, tmp_path / "cache") as git:
            # adopted earlier: the state of a repository that had no branch yet
            state = fetched(git, Adopted(version=NO_BRANCH_VERSION))
    assert len(state.version) == 40 and state.deployments == ()


# --- documents the server would never write (a local repository) ---------------------------


def _commit(repo: pygit2.Repository, files: dict[str, bytes],
            directory: dict[str, bytes] | None = None) -> str:
    builder = repo.TreeBuilder()
    for name, data in files.items():
        builder.insert(name, repo.create_blob(data), pygit2.enums.FileMode.BLOB)
    if directory:
        sub = repo.TreeBuilder()
        for name, data in directory.items():
            sub.insert(name, repo.create_blob(data), pygit2.enums.FileMode.BLOB)
        builder.insert("nested", sub.write(), pygit2.enums.FileMode.TREE)
    builder.insert("link.yaml", repo.create_blob(b"hello-everywhere.yaml"),
                   pygit2.enums.FileMode.LINK)
    author = pygit2.Signature("test", "test@example.com", 0, 0)
    parents = [] if repo.head_is_unborn else [repo.head.target]
    oid = repo.create_commit("refs/heads/main", author, author, "state", builder.write(),
                             parents)
    return str(oid)


@pytest.fixture
def local_repo(tmp_path: Path) -> Iterator[pygit2.Repository]:
    repo = pygit2.init_repository(str(tmp_path / "remote.git"), bare=True,
                                  initial_head="main")
    yield repo
    repo.free()


def test_only_root_level_yaml_files_are_documents(server: FleetServer, tmp_path: Path,
                                                  local_repo: pygit2.Repository) -> None:
    with git_source(server, tmp_path / "from-server") as git:
        served = fetched(git)
    documents = {d.name: d.document for d in served.deployments}
    _commit(local_repo, {"a.yaml": documents["hello-everywhere"],
                         "b.yml": documents["line-monitor"], "README.md": b"# notes\n"},
            directory={"c.yaml": documents["vision-plant-a"]})
    with GitSource(local_repo.path, cache_dir=tmp_path / "cache", depth=None) as git:
        state = fetched(git)
    assert sorted(d.name for d in state.deployments) == ["hello-everywhere", "line-monitor"]


def test_an_invalid_document_fails_the_whole_state(server: FleetServer, tmp_path: Path,
                                                   local_repo: pygit2.Repository) -> None:
    with git_source(server, tmp_path / "from-server") as git:
        served = fetched(git)
    good = served.deployments[0].document
    commit = _commit(local_repo, {"good.yaml": good,
                                  "bad.yaml": good.replace(b"deploymentProfile:", b"profile:")})
    with GitSource(local_repo.path, cache_dir=tmp_path / "cache", depth=None) as git, \
            pytest.raises(IntegrityError) as raised:
        git.fetch(Adopted())
    assert raised.value.code == "INVALID_DOCUMENT"
    assert f"bad.yaml@{commit[:12]}" in raised.value.message
    _commit(local_repo, {"one.yaml": good, "two.yaml": good})  # the same id twice
    with GitSource(local_repo.path, cache_dir=tmp_path / "cache", depth=None) as git, \
            pytest.raises(IntegrityError) as raised:
        git.fetch(Adopted())
    assert raised.value.code == "INVALID_DOCUMENT" and "share deployment id" in raised.value.message


def test_an_empty_local_repository_has_no_branch(tmp_path: Path,
                                                 local_repo: pygit2.Repository) -> None:
    with GitSource(local_repo.path, cache_dir=tmp_path / "cache", depth=None) as git:
        assert fetched(git).version == NO_BRANCH_VERSION
        with pytest.raises(SourceError) as raised:
            git.fetch(Adopted(version="ab" * 20))
    assert raised.value.code == "NO_BRANCH"


def test_a_cache_full_of_packs_is_rebuilt_before_fetching(server: FleetServer, tmp_path: Path,
                                                          local_repo: pygit2.Repository) -> None:
    with git_source(server, tmp_path / "from-server") as git:
        document = fetched(git).deployments[0].document
    _commit(local_repo, {"a.yaml": document})
    cache = tmp_path / "cache"
    with GitSource(local_repo.path, cache_dir=cache, depth=None) as git:
        first = fetched(git)
        packs = cache / "objects" / "pack"
        (original,) = packs.glob("*.pack")
        for n in range(MAX_PACKS):  # what many changed fetches leave behind
            copy = f"pack-{n:040x}"
            shutil.copyfile(original, packs / f"{copy}.pack")
            shutil.copyfile(original.with_suffix(".idx"), packs / f"{copy}.idx")
        _commit(local_repo, {"a.yaml": document, "README.md": b"changed\n"})
        second = fetched(git, Adopted(version=first.version))
    assert second.version != first.version
    assert len(list(packs.glob("*.pack"))) == 1
