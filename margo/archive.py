"""Deterministic tar.gz archives: the same files always give the same bytes (and digest).

Used for State Manifest bundles. Entries are sorted by name; every header has mtime 0,
uid/gid 0, empty user/group names and mode 0644; the gzip header has mtime 0 and no
file name; compression level is fixed. Only regular files at the archive root or in
sub-directories given by name are written — no directories, links or special files.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Mapping

__all__ = ["deterministic_targz", "read_targz"]

_COMPRESS_LEVEL = 9


def _check_name(name: str) -> None:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"archive member names must be relative and normalised, found {name!r}")


def deterministic_targz(files: Mapping[str, bytes]) -> bytes:
    """A reproducible gzip-compressed tar (USTAR) holding exactly `files`."""
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            _check_name(name)
            info = tarfile.TarInfo(name)
            info.size = len(files[name])
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(files[name]))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0,
                       compresslevel=_COMPRESS_LEVEL) as gz:
        gz.write(tar_bytes.getvalue())
    return out.getvalue()


def read_targz(data: bytes, *, max_members: int = 10_000,
               max_total_bytes: int = 64 * 1024 * 1024) -> dict[str, bytes]:
    """Regular files of a tar.gz, refusing links, special files, unsafe names and bombs."""
    out: dict[str, bytes] = {}
    total = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for count, member in enumerate(tar, start=1):
            if count > max_members:
                raise ValueError(f"archive has more than {max_members} members")
            if member.isdir():
                _check_name(member.name.rstrip("/"))
                continue
            if not member.isreg():
                raise ValueError(f"archive member {member.name!r} is not a regular file")
            _check_name(member.name)
            if member.name in out:
                raise ValueError(f"archive member {member.name!r} appears twice")
            total += member.size
            if total > max_total_bytes:
                raise ValueError(f"archive expands to more than {max_total_bytes} bytes")
            extracted = tar.extractfile(member)
            assert extracted is not None
            out[member.name] = extracted.read()
    return out
