"""Digests over exact bytes and reproducible, safe tar.gz bundles."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from margo.archive import deterministic_targz, read_targz
from margo.digests import DigestError, digest_of, parse_digest, verify_digest


def test_digest_is_sha256_of_exact_bytes() -> None:
    assert digest_of(b"") == ("sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b"
                              "7852b855")
    assert digest_of(b"a\n") != digest_of(b"a\r\n")


@pytest.mark.parametrize(
    ("text", "reason"),
    [("sha256:ABC", "expected a digest"), ("md5:" + "0" * 32, "unsupported digest algorithm"),
     ("sha256:" + "0" * 63, "64 hex digits"), ("sha256:" + "0" * 64 + " ", "expected a digest"),
     ("SHA256:" + "0" * 64, "expected a digest"), (None, "expected a digest")],
)
def test_bad_digests_say_what_is_wrong(text: str, reason: str) -> None:
    with pytest.raises(DigestError, match=reason):
        parse_digest(text)


def test_verify_digest_detects_a_mismatch() -> None:
    verify_digest(b"x", digest_of(b"x"))
    with pytest.raises(DigestError, match="digest mismatch"):
        verify_digest(b"y", digest_of(b"x"))


def test_bundles_are_reproducible_and_order_independent() -> None:
    a = deterministic_targz({"b.yaml": b"b\n", "a.yaml": b"a\n"})
    b = deterministic_targz({"a.yaml": b"a\n", "b.yaml": b"b\n"})
    assert a == b
    assert gzip.decompress(a)[:5] == b"a.yam"  # sorted entries
    assert a[4:8] == b"\x00\x00\x00\x00"  # gzip mtime 0
    with tarfile.open(fileobj=io.BytesIO(a)) as tar:
        for member in tar:
            assert (member.mtime, member.uid, member.gid, member.mode) == (0, 0, 0, 0o644)
            assert member.uname == member.gname == ""
    assert read_targz(a) == {"a.yaml": b"a\n", "b.yaml": b"b\n"}


def _streamed_targz(files: dict[str, bytes]) -> bytes:
    """The bundle as `tarfile` and `gzip.GzipFile` stream it (how bundles were built before
    they were built in one buffer): every digest already served depends on these bytes."""
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(files[name]), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(files[name]))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(tar_bytes.getvalue())
    return out.getvalue()


@pytest.mark.parametrize("files", [
    {},
    {"a.yaml": b""},
    {"a.yaml": b"x" * 511, "b.yaml": b"y" * 512, "c.yaml": b"z" * 513},
    {"dir/b\u00e9.yaml": b"kind: ApplicationDeployment\n" * 300},
    {f"{'d' * 90}/{'n' * 60}.yaml": b"long: name\n"},  # a USTAR prefix
    {"big.yaml": bytes(range(256)) * 40_000, "zeros": b"\0" * 3_000_000},
])
def test_bundles_are_the_bytes_tarfile_and_gzipfile_write(files: dict[str, bytes]) -> None:
    assert deterministic_targz(files) == _streamed_targz(files)


@pytest.mark.parametrize("name", ["/abs.yaml", "../up.yaml", "a/../b", "", "a//b", "./a"])
def test_unsafe_member_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="relative and normalised"):
        deterministic_targz({name: b"x"})


def _tar_with(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        tar.addfile(member, io.BytesIO(data) if data else None)
    return raw.getvalue()


def test_reading_refuses_links_and_escapes() -> None:
    link = tarfile.TarInfo("evil")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(ValueError, match="not a regular file"):
        read_targz(_tar_with(link))
    escape = tarfile.TarInfo("../evil.yaml")
    escape.size = 1
    with pytest.raises(ValueError, match="relative and normalised"):
        read_targz(_tar_with(escape, b"x"))


def test_reading_bounds_the_expanded_size() -> None:
    big = deterministic_targz({"big": b"\0" * 2_000_000})
    with pytest.raises(ValueError, match="expands to more than"):
        read_targz(big, max_total_bytes=1_000_000)
