"""Compose Archive validation and extraction: every structure and safety rule, with crafted
tar.gz bytes built here with tarfile (the attacker's tool), and extraction on a real disk."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from margo.digests import digest_of
from reconciler.compose_package import (
    ComposePackage,
    UnsafePackageError,
    extract_package,
    restore_extracted,
    validate_package,
)

COMPOSE = b"""\
services:
  web:
    image: nginx:1.27
    env_file: [web.env]
    environment:
      GREETING: ${GREETING:-hello}
configs:
  site:
    file: ./configs/site.conf
secrets:
  token:
    file: /run/secrets/device-token
"""


@dataclass
class Entry:
    """One tar member to write: a regular file unless `kind` says otherwise."""

    name: str
    content: bytes = b""
    kind: bytes = tarfile.REGTYPE
    mode: int = 0o644
    linkname: str = ""
    extra: dict = field(default_factory=dict)


def targz(*entries: Entry) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.name)
            info.type = entry.kind
            info.mode = entry.mode
            info.linkname = entry.linkname
            info.size = len(entry.content) if entry.kind == tarfile.REGTYPE else 0
            for key, value in entry.extra.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(entry.content) if info.size else None)
    return gzip.compress(raw.getvalue())


def good_entries(top: str = "hello") -> list[Entry]:
    return [Entry(f"{top}/", kind=tarfile.DIRTYPE, mode=0o755),
            Entry(f"{top}/compose.yaml", COMPOSE),
            Entry(f"{top}/web.env", b"LEVEL=info\n"),
            Entry(f"{top}/configs/", kind=tarfile.DIRTYPE, mode=0o700),
            Entry(f"{top}/configs/site.conf", b"listen 80;\n", mode=0o600)]


def rejection(data: bytes, **limits: int) -> UnsafePackageError:
    with pytest.raises(UnsafePackageError) as caught:
        validate_package(data, **limits)
    return caught.value


# --------------------------------------------------------------------------- valid packages


def test_a_well_formed_package_is_read_completely_into_memory() -> None:
    data = targz(*good_entries())
    package = validate_package(data)
    assert package.digest == digest_of(data)
    assert package.top_directory == "hello"
    assert set(package.files) == {"compose.yaml", "web.env", "configs/site.conf"}
    assert package.files["configs/site.conf"] == b"listen 80;\n"
    assert package.directories == ("configs",)
    assert package.services == ("web",)
    assert package.compose["configs"]["site"]["file"] == "./configs/site.conf"


def test_a_dot_slash_prefix_and_missing_directory_entries_are_accepted() -> None:
    # `tar -C dir -czf x.tgz .` writes "./" and "./name/..." members; other tools write
    # no directory entries at all.
    data = targz(Entry("./", kind=tarfile.DIRTYPE, mode=0o755),
                 Entry("./app/compose.yaml", b"services: {db: {image: postgres}}\n"),
                 Entry("./app/sql/init/schema.sql", b"create table t (x int);\n"))
    package = validate_package(data)
    assert package.top_directory == "app"
    assert package.directories == ("sql", "sql/init")


def test_an_optional_env_file_may_be_missing() -> None:
    compose = b"services:\n  web:\n    image: x\n    env_file:\n      - path: local.env\n" \
              b"        required: false\n"
    package = validate_package(targz(Entry("app/compose.yaml", compose)))
    assert package.services == ("web",)


# --------------------------------------------------------------------------- unsafe packages

UNSAFE = {
    "absolute path": ([Entry("/hello/compose.yaml", COMPOSE)], "absolute-path",
                      "/hello/compose.yaml"),
    "dot-dot escape": ([*good_entries(), Entry("hello/../../etc/cron.d/x", b"* * * * * root")],
                       "path-traversal", "hello/../../etc/cron.d/x"),
    "dot-dot inside the tree": ([*good_entries(), Entry("hello/configs/../web.env", b"")],
                                "path-traversal", "hello/configs/../web.env"),
    "empty path component": ([*good_entries(), Entry("hello//x", b"")], "unnormalised-name",
                             "hello//x"),
    "symlink out of the package": (
        [*good_entries(), Entry("hello/passwd", kind=tarfile.SYMTYPE, linkname="/etc/passwd")],
        "link", "hello/passwd"),
    "symlink inside the package": (
        [*good_entries(), Entry("hello/alias.yaml", kind=tarfile.SYMTYPE,
                                linkname="compose.yaml")], "link", "hello/alias.yaml"),
    "hard link": ([*good_entries(), Entry("hello/shadow", kind=tarfile.LNKTYPE,
                                          linkname="etc/shadow")], "link", "hello/shadow"),
    "character device": ([*good_entries(), Entry("hello/null", kind=tarfile.CHRTYPE,
                                                 extra={"devmajor": 1, "devminor": 3})],
                         "special-file", "hello/null"),
    "block device": ([*good_entries(), Entry("hello/sda", kind=tarfile.BLKTYPE,
                                             extra={"devmajor": 8, "devminor": 0})],
                     "special-file", "hello/sda"),
    "fifo": ([*good_entries(), Entry("hello/pipe", kind=tarfile.FIFOTYPE)], "special-file",
             "hello/pipe"),
    "setuid file": ([*good_entries(), Entry("hello/run.sh", b"#!/bin/sh\n", mode=0o4755)],
                    "special-mode-bits", "hello/run.sh"),
    "setgid file": ([*good_entries(), Entry("hello/run.sh", b"#!/bin/sh\n", mode=0o2755)],
                    "special-mode-bits", "hello/run.sh"),
    "sticky directory": ([*good_entries(), Entry("hello/tmp/", kind=tarfile.DIRTYPE,
                                                 mode=0o1777)],
                         "special-mode-bits", "hello/tmp"),
    "file at the archive root": ([*good_entries(), Entry("README.md", b"hi")],
                                 "outside-top-directory", "README.md"),
    "two top-level directories": ([*good_entries(), Entry("other/compose.yaml", COMPOSE)],
                                  "single-top-level-directory", "other/compose.yaml"),
    "duplicate member": ([*good_entries(), Entry("hello/web.env", b"LEVEL=debug\n")],
                         "duplicate-member", "hello/web.env"),
    "a file where a directory is": ([*good_entries(), Entry("hello/web.env/x", b"")],
                                    "duplicate-member", "hello/web.env/x"),
    "a directory where a file is": ([*good_entries(), Entry("hello/web.env/",
                                                            kind=tarfile.DIRTYPE)],
                                    "duplicate-member", "hello/web.env"),
}


@pytest.mark.parametrize("case", list(UNSAFE), ids=list(UNSAFE))
def test_unsafe_members_are_refused_naming_member_and_rule(case: str) -> None:
    entries, rule, member = UNSAFE[case]
    error = rejection(targz(*entries))
    assert (error.rule, error.member) == (rule, member)
    assert error.code == "UNSAFE_PACKAGE" and error.retryable is False
    assert repr(member) in error.message and f"[{rule}]" in error.message


def test_an_empty_archive_has_no_top_level_directory() -> None:
    assert rejection(targz()).rule == "single-top-level-directory"


def test_the_compose_file_must_be_named_compose_yaml() -> None:
    error = rejection(targz(Entry("app/docker-compose.yml", COMPOSE)))
    assert (error.rule, error.member) == ("missing-compose-yaml", "app")
    assert "docker-compose.yml is not a valid name" in error.message


def test_a_compose_yaml_directory_is_not_a_compose_file() -> None:
    error = rejection(targz(Entry("app/compose.yaml/", kind=tarfile.DIRTYPE),
                            Entry("app/compose.yaml/x", b"")))
    assert error.rule == "missing-compose-yaml"


@pytest.mark.parametrize("data", [b"", b"plain text, not gzip", gzip.compress(b"x" * 1000),
                                  targz(*good_entries())[:-40]],
                         ids=["empty", "not gzip", "gzip of garbage", "truncated"])
def test_bytes_that_are_not_a_tar_gz_are_refused(data: bytes) -> None:
    assert rejection(data).rule == "not-a-tar-gz"


def test_a_gzip_bomb_stops_at_the_decompressed_limit() -> None:
    # 32 MiB of zeros inside one member compresses to about 32 KiB.
    bomb = targz(Entry("app/compose.yaml", COMPOSE), Entry("app/zeros", bytes(32 * 1024 * 1024)))
    assert len(bomb) < 100_000
    error = rejection(bomb, max_unpacked_bytes=1024 * 1024)
    assert error.rule == "too-large"


def test_file_contents_count_towards_the_unpacked_limit() -> None:
    entries = [Entry("app/compose.yaml", COMPOSE)] + [
        Entry(f"app/part{i}", bytes(300_000)) for i in range(4)]
    # The tar stream itself fits; the sum of the files does not.
    error = rejection(targz(*entries), max_unpacked_bytes=1_000_000 + 20_000)
    assert error.rule == "too-large"


def test_too_many_members_is_a_bomb() -> None:
    entries = [Entry("app/compose.yaml", COMPOSE)] + [Entry(f"app/f{i}") for i in range(10)]
    assert rejection(targz(*entries), max_members=5).rule == "too-many-members"


@pytest.mark.parametrize("compose", [b"services: [unclosed\n", b"- a list\n", b"name: x\n",
                                     b"services: {}\n", b"services: [web]\n",
                                     b"services: {web: [image]}\n", b"\xff\xfe\x00"],
                         ids=["bad yaml", "a list", "no services", "no service",
                              "services list", "service list", "not utf-8"])
def test_compose_yaml_must_be_a_mapping_with_services(compose: bytes) -> None:
    error = rejection(targz(Entry("app/compose.yaml", compose)))
    assert (error.rule, error.member) == ("compose-yaml-invalid", "app/compose.yaml")


def with_compose(compose: str, *extra: Entry) -> bytes:
    return targz(Entry("app/compose.yaml", compose.encode()), *extra)


@pytest.mark.parametrize("compose", [
    "services: {web: {image: x, env_file: /etc/environment}}",
    "services: {web: {image: x, env_file: [../outside.env]}}",
    "services: {web: {image: x, env_file: [missing.env]}}",
    "services: {web: {image: x, env_file: ['${HOME}/x.env']}}",
    "services: {web: {image: x, env_file: [{path: /etc/shadow, required: false}]}}",
    "services: {web: {image: x}}\nconfigs: {c: {file: ./missing.conf}}",
    "services: {web: {image: x}}\nconfigs: {c: {file: /etc/passwd}}",
    "services: {web: {image: x}}\nconfigs: {c: {file: conf/../../x}}",
], ids=["absolute env_file", "escaping env_file", "missing env_file", "interpolated env_file",
        "absolute optional env_file", "missing config", "absolute config", "escaping config"])
def test_files_compose_yaml_references_must_ship_inside_the_package(compose: str) -> None:
    error = rejection(with_compose(compose))
    assert (error.rule, error.member) == ("referenced-file", "app/compose.yaml")


def test_secret_files_must_not_ship_in_the_package() -> None:
    data = with_compose("services: {web: {image: x}}\nsecrets: {s: {file: ./token.txt}}",
                        Entry("app/token.txt", b"hunter2"))
    assert rejection(data).rule == "secret-in-archive"
    # A secret the device provisions outside the package is fine.
    validate_package(with_compose("services: {web: {image: x}}\n"
                                  "secrets: {s: {file: /run/secrets/token}}"))


# --------------------------------------------------------------------------- referenced paths

BASE = b"services:\n  a:\n    image: busybox\n    env_file: a.env\n"

ESCAPES = {
    "include up and out": ("include: ../x.yaml\nservices: {web: {image: x}}", [],
                           "compose.yaml", "include", "../x.yaml"),
    "include an absolute path": ("include: [{path: /etc/passwd}]\nservices: {web: {image: x}}",
                                 [], "compose.yaml", "include[0].path", "/etc/passwd"),
    "include with interpolation": ("include: ['${HOME}/x.yaml']\nservices: {web: {image: x}}",
                                   [], "compose.yaml", "include[0]", "${HOME}/x.yaml"),
    "include a bare variable": ("include: [$INC]\nservices: {web: {image: x}}", [],
                                "compose.yaml", "include[0]", "$INC"),
    "include from the home directory": ("include: ['~/x.yaml']\nservices: {web: {image: x}}",
                                        [], "compose.yaml", "include[0]", "~/x.yaml"),
    "include a list of paths": (
        "include: [{path: [base.yaml, ../../x.yaml]}]\nservices: {web: {image: x}}",
        [Entry("app/base.yaml", BASE), Entry("app/a.env", b"")], "compose.yaml",
        "include[0].path[1]", "../../x.yaml"),
    "include project_directory": (
        "include: [{path: base.yaml, project_directory: ..}]\nservices: {web: {image: x}}",
        [Entry("app/base.yaml", BASE)], "compose.yaml", "include[0].project_directory", ".."),
    "include env_file": (
        "include: [{path: base.yaml, env_file: [/etc/environment]}]\n"
        "services: {web: {image: x}}", [Entry("app/base.yaml", BASE), Entry("app/a.env", b"")],
        "compose.yaml", "include[0].env_file[0]", "/etc/environment"),
    "extends a file outside": (
        "services: {web: {image: x, extends: {file: ../../base.yaml, service: a}}}", [],
        "compose.yaml", "services.web.extends.file", "../../base.yaml"),
    "absolute env_file": ("services: {web: {image: x, env_file: /etc/shadow}}", [],
                          "compose.yaml", "services.web.env_file", "/etc/shadow"),
    "label_file outside": ("services: {web: {image: x, label_file: [../labels]}}", [],
                           "compose.yaml", "services.web.label_file[0]", "../labels"),
    "build context outside": ("services: {web: {build: ../..}}", [], "compose.yaml",
                              "services.web.build", "../.."),
    "absolute build context": ("services: {web: {build: {context: /}}}", [], "compose.yaml",
                               "services.web.build.context", "/"),
    "dockerfile outside the context": (
        "services: {web: {build: {context: src, dockerfile: ../../Dockerfile}}}",
        [Entry("app/src/Dockerfile", b"FROM busybox\n")], "compose.yaml",
        "services.web.build.dockerfile", "../../Dockerfile"),
    "additional build context outside": (
        "services: {web: {build: {context: ., additional_contexts: {etc: /etc}}}}", [],
        "compose.yaml", "services.web.build.additional_contexts.etc", "/etc"),
    "a context that only looks remote": ("services: {web: {build: 'file:///etc'}}", [],
                                         "compose.yaml", "services.web.build", "file:///etc"),
    "relative bind mount outside": (
        "services: {web: {image: x, volumes: ['../../..:/host']}}", [], "compose.yaml",
        "services.web.volumes[0]", "../../.."),
    "relative long-syntax bind mount outside": (
        "services: {web: {image: x, volumes: [{type: bind, source: ./../x, target: /x}]}}", [],
        "compose.yaml", "services.web.volumes[0].source", "./../x"),
    "secret file outside the package by a relative path": (
        "services: {web: {image: x}}\nsecrets: {s: {file: ../../token}}", [],
        "compose.yaml", "secrets.s.file", "../../token"),
    "nested include that escapes": (
        "include: [inc/one.yaml]\nservices: {web: {image: x}}",
        [Entry("app/inc/one.yaml", b"include: [two.yaml]\n"),
         Entry("app/inc/two.yaml", b"services: {b: {image: x, env_file: ../../../etc/x}}\n")],
        "inc/two.yaml", "services.b.env_file", "../../../etc/x"),
    "an extended file that escapes": (
        "services: {web: {extends: {file: lib/base.yaml, service: a}}}",
        [Entry("app/lib/base.yaml", b"services: {a: {image: x, extends: "
                                    b"{file: ../../up.yaml, service: b}}}\n")],
        "lib/base.yaml", "services.a.extends.file", "../../up.yaml"),
    "a missing included file": ("include: [nowhere.yaml]\nservices: {web: {image: x}}", [],
                                "compose.yaml", "include[0]", "nowhere.yaml"),
}


@pytest.mark.parametrize("case", list(ESCAPES), ids=list(ESCAPES))
def test_paths_that_leave_the_package_are_refused_with_their_location(case: str) -> None:
    compose, extra, file, where, value = ESCAPES[case]
    error = rejection(with_compose(compose, *extra))
    assert (error.rule, error.member, error.field) == ("referenced-file", f"app/{file}", where)
    assert error.code == "UNSAFE_PACKAGE" and error.retryable is False
    assert f"{where} {value!r}" in error.message


def test_an_include_cycle_is_refused() -> None:
    data = with_compose("include: [a.yaml]\nservices: {web: {image: x}}",
                        Entry("app/a.yaml", b"include: [sub/b.yaml]\n"),
                        Entry("app/sub/b.yaml", b"include: [../a.yaml]\n"))
    error = rejection(data)
    assert (error.rule, error.member) == ("reference-cycle", "app/sub/b.yaml")
    assert "a.yaml -> sub/b.yaml -> a.yaml" in error.message


def test_a_chain_of_includes_deeper_than_the_limit_is_refused() -> None:
    chain = [Entry(f"app/i{n}.yaml", f"include: [i{n + 1}.yaml]\n".encode())
             for n in range(20)]
    data = with_compose("include: [i0.yaml]\nservices: {web: {image: x}}", *chain,
                        Entry("app/i20.yaml", b"services: {b: {image: x}}\n"))
    assert rejection(data).rule == "reference-depth"


def test_an_included_file_must_be_a_compose_mapping() -> None:
    error = rejection(with_compose("include: [x.yaml]\nservices: {web: {image: x}}",
                                   Entry("app/x.yaml", b"- not a mapping\n")))
    assert (error.rule, error.member) == ("compose-yaml-invalid", "app/x.yaml")


def test_a_symlink_pointing_out_of_the_package_is_refused() -> None:
    # Links never get as far as the path check: the archive check refuses them all.
    data = with_compose("include: [x.yaml]\nservices: {web: {image: x}}",
                        Entry("app/x.yaml", kind=tarfile.SYMTYPE, linkname="../../etc/x.yaml"))
    assert (rejection(data).rule, rejection(data).member) == ("link", "app/x.yaml")


def test_includes_extends_and_files_inside_the_package_are_accepted() -> None:
    compose = """\
include:
  - lib/db.yaml
  - path: [lib/cache.yaml, ./lib/cache-override.yaml]
    project_directory: lib
    env_file: lib/cache.env
services:
  web:
    extends: {file: ./lib/base.yaml, service: base}
    env_file: [web.env, {path: ./local.env, required: false}]
    label_file: web.labels
    build: {context: ., dockerfile: docker/Dockerfile, additional_contexts: {img: "docker-image://busybox"}}
    volumes: [./data:/data, named:/named, /var/run/docker.sock:/var/run/docker.sock]
  worker:
    extends: web
    build: https://github.com/example/worker.git
  common:
    image: busybox
    env_file: web.env
configs:
  site: {file: ./lib/../configs/site.conf}
secrets:
  token: {file: /run/secrets/device-token}
volumes:
  named: {}
"""
    package = validate_package(with_compose(
        compose,
        Entry("app/lib/db.yaml", b"services: {db: {image: postgres, env_file: ../db.env}}\n"),
        Entry("app/db.env", b""),
        Entry("app/lib/cache.yaml", b"services: {cache: {image: redis, env_file: c.env}}\n"),
        Entry("app/lib/cache-override.yaml", b"services: {cache: {extends: "
                                              b"{file: ../lib/base.yaml, service: base}}}\n"),
        Entry("app/lib/c.env", b""), Entry("app/lib/cache.env", b""),
        Entry("app/lib/base.yaml", b"services: {base: {image: x, env_file: base.env, "
                                   b"extends: {file: ../compose.yaml, service: common}}}\n"),
        Entry("app/lib/base.env", b""), Entry("app/web.env", b""), Entry("app/web.labels", b""),
        Entry("app/docker/Dockerfile", b"FROM busybox\n"),
        Entry("app/configs/site.conf", b"")))
    assert package.services == ("web", "worker", "common")


# --------------------------------------------------------------------------- extraction


@contextmanager
def umask(value: int) -> Iterator[None]:
    previous = os.umask(value)
    try:
        yield
    finally:
        os.umask(previous)


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode)
            for p in sorted(root.rglob("*"))}


def test_extraction_writes_normalised_permissions_whatever_the_archive_and_umask(
        tmp_path: Path) -> None:
    package = validate_package(targz(*good_entries()))
    with umask(0o077):
        compose_file = extract_package(package, tmp_path / "pkg")
    assert compose_file == tmp_path / "pkg" / "compose.yaml"
    assert compose_file.read_bytes() == COMPOSE
    assert tree(tmp_path / "pkg") == {"compose.yaml": 0o644, "configs": 0o755,
                                      "configs/site.conf": 0o644, "web.env": 0o644}
    assert stat.S_IMODE((tmp_path / "pkg").stat().st_mode) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]  # no staging left behind


def test_extraction_refuses_an_existing_destination(tmp_path: Path) -> None:
    package = validate_package(targz(*good_entries()))
    (tmp_path / "pkg").mkdir()
    with pytest.raises(FileExistsError):
        extract_package(package, tmp_path / "pkg")


def test_a_failed_extraction_leaves_nothing_behind(tmp_path: Path) -> None:
    # A package value whose directory list omits a parent: writing fails half-way.
    broken = ComposePackage(digest="sha256:" + "0" * 64, top_directory="app",
                            files={"compose.yaml": COMPOSE, "missing/dir/file": b"x"},
                            directories=(), compose={"services": {"web": {}}})
    with pytest.raises(FileNotFoundError):
        extract_package(broken, tmp_path / "pkg")
    assert list(tmp_path.iterdir()) == []


def test_an_extracted_package_that_no_longer_matches_is_restored_before_use(
        tmp_path: Path) -> None:
    """The extracted files are changed on disk, as a bad disk or someone with access to the
    data directory would: the next step must run the verified package, not them."""
    package = validate_package(targz(*good_entries()))
    dest = tmp_path / "pkg"
    assert restore_extracted(package, dest) == ["compose.yaml", "configs/site.conf", "web.env"]
    assert restore_extracted(package, dest) == []  # intact: nothing written

    (dest / "compose.yaml").write_bytes(COMPOSE.replace(b"nginx:1.27", b"evil:latest"))
    (dest / "web.env").unlink()
    (dest / "data").mkdir()  # what a service wrote into a bind-mounted package directory
    (dest / "data" / "state").write_bytes(b"kept")
    assert restore_extracted(package, dest) == ["compose.yaml", "web.env"]
    assert (dest / "compose.yaml").read_bytes() == COMPOSE
    assert (dest / "web.env").is_file() and (dest / "data" / "state").read_bytes() == b"kept"

    outside = tmp_path / "outside"
    outside.mkdir()
    (dest / "compose.yaml").unlink()
    (dest / "compose.yaml").symlink_to(outside / "target")  # a planted link is replaced
    assert restore_extracted(package, dest) == ["compose.yaml"]
    assert not (dest / "compose.yaml").is_symlink() and list(outside.iterdir()) == []

    shutil.rmtree(dest / "configs")
    (dest / "configs").symlink_to(outside)  # a directory turned into a link: start over
    assert restore_extracted(package, dest) == ["compose.yaml", "configs/site.conf", "web.env"]
    assert tree(dest) == {"compose.yaml": 0o644, "configs": 0o755, "configs/site.conf": 0o644,
                          "web.env": 0o644}
    assert list(outside.iterdir()) == []
