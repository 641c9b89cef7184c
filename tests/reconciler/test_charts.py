"""ChartCache against a real OCI registry (Debian docker-registry on loopback).

Cache hits are shown without the registry by stopping a private registry after the first
fetch: a hit that contacted it would fail.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import helm_python as helm
import pytest
from kits.chartkit import chart_digest, publish_chart, publish_example_charts, write_chart
from kits.registrykit import running_registry

from reconciler.charts import ChartCache, parse_repository
from reconciler.errors import ApplyError
from reconciler.registry_credentials import RegistryCredential, docker_config_text


def published(registry: str, tmp_path: Path, repo_path: str, *versions: str) -> str:
    repository = ""
    for version in versions:
        repository = publish_chart(registry, write_chart(tmp_path / "src", version=version),
                                   repo_path=repo_path)
    return repository


def test_a_tag_is_pulled_once_and_stored_under_its_manifest_digest(registry: str,
                                                                   tmp_path: Path) -> None:
    repository = published(registry, tmp_path, "cache-tag", "1.0.0")
    with ChartCache(tmp_path / "cache") as charts:
        path = charts.fetch(repository, "1.0.0")
        digest = chart_digest(registry, repository, "1.0.0")
        assert path == tmp_path / "cache" / "sha256" / f"{digest.removeprefix('sha256:')}.tgz"
        chart = charts.load(path)
        assert (chart.name, chart.version) == ("greeter", "1.0.0")
        assert charts.load(path) is chart  # memoised: one native chart per file
        assert charts.fetch(repository, "1.0.0") == path
    # Nothing but the content-addressed files is left behind (no staging directories).
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["sha256"]


def test_cache_hits_do_not_contact_the_registry(tmp_path: Path) -> None:
    with running_registry(tmp_path / "private") as private:
        repository = published(private, tmp_path, "charts", "1.0.0")
        digest = chart_digest(private, repository, "1.0.0")
        charts = ChartCache(tmp_path / "cache")
        by_tag = charts.fetch(repository, "1.0.0")
    # The registry is gone now.
    with charts:
        assert charts.fetch(repository, "1.0.0") == by_tag
    with ChartCache(tmp_path / "cache") as restarted:
        # A digest is content-addressed: the file on disk is enough, even in a new process.
        assert restarted.fetch(repository, digest) == by_tag
        # A tag is resolved again by every new process (it may have moved), so it needs
        # the registry.
        with pytest.raises(ApplyError) as caught:
            restarted.fetch(repository, "1.0.0")
    assert caught.value.code == "PULL_FAILED"
    assert "connection refused" in caught.value.message
    assert caught.value.retryable


def test_a_damaged_cached_chart_is_pulled_again_never_installed(tmp_path: Path) -> None:
    """The archive is damaged in the cache directory itself (a bad disk, an edit behind the
    client's back): every use checks it, in the same process and after a restart."""
    with running_registry(tmp_path / "private") as private:
        repository = published(private, tmp_path, "charts", "1.0.0")
        digest = chart_digest(private, repository, "1.0.0")
        with ChartCache(tmp_path / "cache") as charts:
            path = charts.fetch(repository, digest)
            good = path.read_bytes()
            path.write_bytes(good[:-16] + b"\0" * 16)
            assert charts.fetch(repository, digest) == path  # a hit, checked: pulled again
            assert path.read_bytes() == good
            assert charts.load(path).version == "1.0.0"
            recorded = path.with_name(path.name.removesuffix(".tgz") + ".archive-digest")
            recorded.unlink()  # as a cache written before digests were recorded
        with ChartCache(tmp_path / "cache") as restarted:
            assert restarted.fetch(repository, digest) == path  # accepted, digest recorded
            assert recorded.is_file()
    path.write_bytes(b"not the chart any more")
    with ChartCache(tmp_path / "cache") as offline, pytest.raises(ApplyError) as caught:
        offline.fetch(repository, digest)  # the registry is gone: fail, never use the file
    assert caught.value.code == "PULL_FAILED" and caught.value.retryable
    assert f"the cached chart {path} was damaged and has been removed" in caught.value.message
    assert not path.exists()


def test_a_digest_revision_pulls_exactly_that_manifest(registry: str, tmp_path: Path) -> None:
    repository = published(registry, tmp_path, "cache-digest", "1.0.0", "2.0.0")
    first = chart_digest(registry, repository, "1.0.0")
    with ChartCache(tmp_path / "cache") as charts:
        chart = charts.load(charts.fetch(repository, first))
        assert chart.version == "1.0.0"
        assert charts.fetch(repository, "1.0.0") == charts.fetch(repository, first)
        assert charts.load(charts.fetch(repository, "2.0.0")).version == "2.0.0"


def test_a_moved_tag_is_seen_by_a_new_cache_only(registry: str, tmp_path: Path) -> None:
    repository = publish_chart(registry, write_chart(tmp_path / "a", greeting="first"),
                               repo_path="cache-moved")
    with ChartCache(tmp_path / "cache") as charts:
        before = charts.fetch(repository, "1.0.0")
        publish_chart(registry, write_chart(tmp_path / "b", greeting="second"),
                      repo_path="cache-moved")
        # Within one process a tag is immutable: the same file, no registry round trip.
        assert charts.fetch(repository, "1.0.0") == before
        assert charts.load(before).values["config"]["greeting"] == "first"
    with ChartCache(tmp_path / "cache") as restarted:
        after = restarted.fetch(repository, "1.0.0")
        assert after != before
        assert restarted.load(after).values["config"]["greeting"] == "second"


@pytest.mark.parametrize(("path", "revision"), [("cache-missing/greeter", "9.9.9"),
                                                 ("no-such/chart", "1.0.0")])
def test_a_missing_chart_or_version_is_a_retryable_pull_failure(
        registry: str, tmp_path: Path, path: str, revision: str) -> None:
    published(registry, tmp_path, "cache-missing", "1.0.0")
    with ChartCache(tmp_path / "cache") as charts, pytest.raises(ApplyError) as caught:
        charts.fetch(f"oci://{registry}/{path}", revision)
    assert caught.value.code == "PULL_FAILED"
    assert "not found" in caught.value.message
    assert f"{path}:{revision}" in caught.value.message
    assert caught.value.retryable


def test_a_missing_digest_is_a_pull_failure_and_leaves_nothing(registry: str,
                                                                tmp_path: Path) -> None:
    repository = published(registry, tmp_path, "cache-nodigest", "1.0.0")
    with ChartCache(tmp_path / "cache") as charts, pytest.raises(ApplyError) as caught:
        charts.fetch(repository, "sha256:" + "0" * 64)
    assert caught.value.code == "PULL_FAILED"
    assert "not found" in caught.value.message
    assert list((tmp_path / "cache").rglob("*.tgz")) == []
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["sha256"]


def test_a_registry_that_is_down_is_a_retryable_pull_failure(tmp_path: Path) -> None:
    with ChartCache(tmp_path / "cache") as charts, pytest.raises(ApplyError) as caught:
        charts.fetch("oci://127.0.0.1:1/charts/greeter", "1.0.0")
    assert caught.value.code == "PULL_FAILED"
    assert "127.0.0.1:1" in caught.value.message
    assert "connection refused" in caught.value.message
    assert caught.value.retryable


def test_plain_http_is_used_only_for_listed_hosts(registry: str, tmp_path: Path) -> None:
    repository = published(registry, tmp_path, "cache-tls", "1.0.0")
    with ChartCache(tmp_path / "cache", plain_http_hosts=frozenset()) as charts, \
            pytest.raises(ApplyError) as caught:
        charts.fetch(repository, "1.0.0")
    assert caught.value.code == "PULL_FAILED"
    assert "HTTPS" in caught.value.message  # Go: "server gave HTTP response to HTTPS client"


@pytest.mark.parametrize("repository", [
    "https://charts.example.com/greeter", "greeter", "oci://", "oci://registry.example.com",
    "oci://registry.example.com/Upper/Case", "oci://registry.example.com/../escape",
    "oci://registry.example.com/charts/greeter\n"])
def test_references_that_are_not_oci_repositories_are_refused(repository: str,
                                                              tmp_path: Path) -> None:
    with ChartCache(tmp_path / "cache") as charts, pytest.raises(ApplyError) as caught:
        charts.fetch(repository, "1.0.0")
    assert caught.value.code == "UNSUPPORTED_REPOSITORY"
    assert not caught.value.retryable
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("revision", ["", "sha256:abc", "1.0.0 beta", "-1", "1.0.0\n",
                                      "sha256:" + "a" * 64 + "\n"])
def test_revisions_must_be_a_tag_or_a_full_digest(revision: str, tmp_path: Path) -> None:
    with ChartCache(tmp_path / "cache") as charts, pytest.raises(ApplyError) as caught:
        charts.fetch("oci://127.0.0.1:1/charts/greeter", revision)
    assert caught.value.code == "INVALID_REVISION"
    assert not caught.value.retryable


def test_parse_repository_splits_host_and_path() -> None:
    reference = parse_repository("oci://localhost:5000/team/charts/greeter")
    assert (reference.host, reference.hostname, reference.path) == (
        "localhost:5000", "localhost", "team/charts/greeter")
    assert reference.pinned("sha256:" + "a" * 64) == (
        "oci://localhost:5000/team/charts/greeter@sha256:" + "a" * 64)
    assert parse_repository("oci://ghcr.io/org/greeter").hostname == "ghcr.io"


def test_a_file_that_is_not_a_chart_cannot_be_loaded(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.tgz"
    bogus.write_bytes(b"not a gzip archive")
    with ChartCache(tmp_path / "cache") as charts, pytest.raises(ApplyError) as caught:
        charts.load(bogus)
    assert caught.value.code == "CHART_INVALID"
    assert str(bogus) in caught.value.message


def test_the_example_fleet_charts_publish_and_fetch(registry: str, tmp_path: Path) -> None:
    repositories = publish_example_charts(registry)
    assert set(repositories) >= {"hello-world", "line-monitor", "inference-server",
                                 "model-cache"}
    with ChartCache(tmp_path / "cache") as charts:
        for name, (repository, version) in repositories.items():
            assert repository == f"oci://{registry}/charts/{name}"
            chart = charts.load(charts.fetch(repository, version))
            assert (chart.name, chart.version) == (name, version)
            manifests = chart.render({}, name="example", namespace="demo")
            assert any(text.strip() for text in manifests.values())


def test_closing_frees_loaded_charts(registry: str, tmp_path: Path) -> None:
    repository = published(registry, tmp_path, "cache-close", "1.0.0")
    charts = ChartCache(tmp_path / "cache")
    chart = charts.load(charts.fetch(repository, "1.0.0"))
    charts.close()
    assert chart.closed
    with pytest.raises(helm.HelmError):
        chart.render({})


def test_charts_from_a_registry_that_needs_credentials(tmp_path: Path) -> None:
    """A registry with htpasswd authentication: anonymous and wrong credentials are
    refused (PULL_FAILED naming the registry, never the password), the right ones pull, and
    the private credentials file is gone once the cache is closed."""
    def credential(password: str) -> RegistryCredential:
        secret = tmp_path / f"password-{password}"
        secret.write_text(password + "\n")
        secret.chmod(0o600)
        return RegistryCredential(host, "deployer", secret)

    with running_registry(tmp_path / "private", users={"deployer": "s3cret-pw"}) as host:
        config = tmp_path / "pusher" / "config.json"
        config.parent.mkdir()
        config.write_text(docker_config_text([credential("s3cret-pw")]))
        archive = helm.package(write_chart(tmp_path / "src"), destination=tmp_path)
        with helm.RegistryClient(plain_http=True, credentials_file=config) as client:
            helm.push(archive, f"oci://{host}/private", client=client, plain_http=True)
        repository = f"oci://{host}/private/greeter"
        for credentials in ([], [credential("wrong-pw")]):
            with ChartCache(tmp_path / "refused", credentials=credentials) as charts, \
                    pytest.raises(ApplyError) as caught:
                charts.fetch(repository, "1.0.0")
            assert caught.value.code == "PULL_FAILED"
            assert host in caught.value.message
            assert "wrong-pw" not in caught.value.message
        before = set(Path(tempfile.gettempdir()).glob("margo-helm-registry-*"))
        with ChartCache(tmp_path / "cache", credentials=[credential("s3cret-pw")]) as charts:
            chart = charts.load(charts.fetch(repository, "1.0.0"))
            assert chart.version == "1.0.0"
            during = set(Path(tempfile.gettempdir()).glob("margo-helm-registry-*")) - before
            [folder] = during
            assert oct((folder / "config.json").stat().st_mode & 0o777) == "0o600"
        assert not folder.exists()
