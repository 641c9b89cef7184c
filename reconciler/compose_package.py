"""Compose Archives: validated in memory, then extracted atomically.

A Compose component's package (spec section 1, compose-oci SUP) is a tar.gz with exactly
one top-level directory holding `compose.yaml`. The device MUST validate the archive's
structure and safety before extracting it, so `validate_package` reads the whole archive
into memory first (bounded: compressed bytes come size-checked from `reconciler.oci`, the
decompressed stream, member count and member sizes are capped here) and refuses, naming the
member and the rule, anything that could escape or surprise:

* `not-a-tar-gz`: bytes that are not a readable gzip-compressed tar;
* `absolute-path`: a member name starting with `/`;
* `path-traversal`: a `..` component;
* `unnormalised-name`: empty or `.` components (`a//b`, `a/./b`); a leading `./` is fine;
* `link`: symbolic and hard links. Stricter than the spec, which allows links that stay
  inside the top directory: a Compose package never needs one, and refusing all of them
  leaves nothing to resolve or audit;
* `special-file`: devices, FIFOs, sparse files and any other non-regular member;
* `special-mode-bits`: setuid, setgid or sticky bits (files and directories);
* `outside-top-directory`: a file at the archive root;
* `single-top-level-directory`: zero, or more than one, top-level directory;
* `duplicate-member`: a name that appears twice, or a file where a directory is;
* `too-many-members`, `too-large`: bombs (more than `MAX_MEMBERS` entries, or more than
  `MAX_UNPACKED_BYTES` of decompressed tar stream or file content);
* `missing-compose-yaml`: no regular file `<top>/compose.yaml` (the spec makes
  `compose.yml`, `docker-compose.yaml` and `docker-compose.yml` invalid names);
* `compose-yaml-invalid`: `compose.yaml` is not a YAML mapping with a `services` mapping;
* `referenced-file`: a path in `compose.yaml`, or in a file it includes or extends, that
  Compose would read from outside the package: `include` (paths, `project_directory`,
  `env_file`), `extends.file`, `env_file`, `label_file`, `configs.<name>.file`, `build`
  contexts, Dockerfiles, additional contexts, relative bind-mount sources. Absolute, `~`,
  `$`-interpolated or escaping paths, and referenced files missing from the package, are
  refused, naming the file, the YAML path and the value (`reconciler.compose_paths`);
* `reference-cycle`, `reference-depth`: an include cycle, or included and extended files
  nested more than `compose_paths.MAX_REFERENCE_DEPTH` deep (or too many of them);
* `secret-in-archive`: a `secrets.<name>.file` shipped inside the package.

Extraction never uses tarfile's extraction: files are written from the validated bytes with
mode 0644 (directories 0755) into a temporary sibling directory that is renamed into place,
so the destination either holds the complete package or does not exist.

An extracted package is reused by every later step of the same archive, so before each use
`restore_extracted` compares it with the archive just pulled and verified: a file whose bytes
differ, or that is missing, is written again (one bad sector or one edit behind the client's
back must not be what `docker compose up` runs).
"""

from __future__ import annotations

import gzip
import io
import os
import secrets
import shutil
import stat
import tarfile
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from margo.digests import digest_of
from reconciler.compose_paths import PathRefused, check_compose_paths
from reconciler.errors import ApplyError, ErrorCode

__all__ = ["COMPOSE_FILE", "MAX_COMPOSE_BYTES", "MAX_MEMBERS", "MAX_UNPACKED_BYTES",
           "ComposePackage", "UnsafePackageError", "extract_package", "restore_extracted",
           "validate_package"]

COMPOSE_FILE = "compose.yaml"
MAX_MEMBERS = 2000
MAX_UNPACKED_BYTES = 64 * 1024 * 1024  # the decompressed tar stream, headers included
MAX_COMPOSE_BYTES = 1024 * 1024
_OTHER_COMPOSE_NAMES = ("compose.yml", "docker-compose.yaml", "docker-compose.yml")
_SPECIAL_BITS = 0o7000

try:  # libyaml is bundled in PyYAML wheels; the pure-Python loader is the fallback.
    _Loader: type = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - depends on the PyYAML build
    _Loader = yaml.SafeLoader


class UnsafePackageError(ApplyError):
    """A Compose Archive broke a structure or safety rule; `rule` is one of the names in the
    module docstring, `member` the archive entry at fault (None for whole-archive rules) and
    `field` the YAML path inside it when a Compose file's field is at fault."""

    def __init__(self, rule: str, message: str, *, member: str | None = None,
                 field: str | None = None) -> None:
        where = f"member {member!r}: " if member is not None else ""
        super().__init__(ErrorCode.UNSAFE_PACKAGE, f"{where}{message} [{rule}]", retryable=False)
        self.rule = rule
        self.member = member
        self.field = field


@dataclass(frozen=True)
class ComposePackage:
    """A validated Compose Archive, held in memory. Paths are relative to the top-level
    directory, so `files["compose.yaml"]` is the Compose file."""

    digest: str  # sha256 over the archive bytes
    top_directory: str
    files: Mapping[str, bytes]
    directories: tuple[str, ...]  # every directory below the top one, parents first
    compose: Mapping[str, Any]  # compose.yaml, parsed

    @property
    def services(self) -> tuple[str, ...]:
        return tuple(self.compose["services"])


# --------------------------------------------------------------------------- reading


def _decompress(data: bytes, limit: int) -> bytes:
    """The tar stream inside the gzip, refusing more than `limit` bytes before buffering
    them (a gzip bomb expands about 1000 times)."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb") as stream:
            tar = stream.read(limit + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise UnsafePackageError("not-a-tar-gz", f"cannot decompress the archive: {exc}") from None
    if len(tar) > limit:
        raise UnsafePackageError("too-large", f"the archive expands to more than {limit} bytes")
    return tar


def _members(tar_bytes: bytes, max_members: int) -> Iterator[tuple[tarfile.TarInfo, bytes]]:
    """Each member with its content (empty for non-files); TarErrors become `not-a-tar-gz`."""
    try:
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            for count, member in enumerate(tar, start=1):
                if count > max_members:
                    raise UnsafePackageError("too-many-members",
                                             f"the archive has more than {max_members} members")
                content = b""
                if member.isreg() and member.type != tarfile.GNUTYPE_SPARSE:
                    extracted = tar.extractfile(member)
                    content = extracted.read() if extracted is not None else b""
                yield member, content
    except tarfile.TarError as exc:
        raise UnsafePackageError("not-a-tar-gz", f"cannot read the tar stream: {exc}") from None


def _member_parts(member: tarfile.TarInfo) -> tuple[str, ...]:
    """The normalised name components of a member, or an `UnsafePackageError`."""
    name = member.name
    if name.startswith("/"):
        raise UnsafePackageError("absolute-path", "absolute paths are not allowed", member=name)
    relative = name.removeprefix("./")
    if relative in ("", "."):
        return ()
    parts = tuple(relative.rstrip("/").split("/")) if member.isdir() else tuple(
        relative.split("/"))
    if ".." in parts:
        raise UnsafePackageError("path-traversal", "'..' components are not allowed",
                                 member=name)
    if any(part in ("", ".") for part in parts):
        raise UnsafePackageError("unnormalised-name", "empty or '.' path components are not "
                                 "allowed", member=name)
    return parts


def _check_type_and_mode(member: tarfile.TarInfo) -> None:
    if member.issym() or member.islnk():
        kind = "symbolic" if member.issym() else "hard"
        raise UnsafePackageError("link", f"{kind} links are not allowed (target "
                                 f"{member.linkname!r})", member=member.name)
    if member.type == tarfile.GNUTYPE_SPARSE or not (member.isreg() or member.isdir()):
        kind = ("character device" if member.ischr() else "block device" if member.isblk()
                else "FIFO" if member.isfifo() else "sparse file" if member.issparse()
                else f"type {member.type!r} entry")
        raise UnsafePackageError("special-file", f"a {kind} is not allowed; only regular files "
                                 "and directories", member=member.name)
    if member.mode & _SPECIAL_BITS:
        raise UnsafePackageError("special-mode-bits", f"mode {member.mode:o} has setuid, setgid "
                                 "or sticky bits", member=member.name)


@dataclass
class _Tree:
    """What has been read so far, keyed by the path inside the top directory."""

    tops: set[str]
    files: dict[str, bytes]
    directories: set[str]
    unpacked: int = 0

    def add(self, member: tarfile.TarInfo, parts: tuple[str, ...], content: bytes,
            limit: int) -> None:
        if member.isreg() and len(parts) == 1:
            raise UnsafePackageError("outside-top-directory", "files must be inside the single "
                                     "top-level directory", member=member.name)
        self.tops.add(parts[0])
        if len(self.tops) > 1:
            raise UnsafePackageError("single-top-level-directory", "a second top-level "
                                     f"directory (found {sorted(self.tops)})",
                                     member=member.name)
        inner = "/".join(parts[1:])
        parents = ["/".join(parts[1:depth]) for depth in range(2, len(parts))]
        for parent in parents:
            if parent in self.files:
                raise UnsafePackageError("duplicate-member", f"{parent!r} is a file and a "
                                         "directory", member=member.name)
        if member.isdir():
            if inner in self.files:
                raise UnsafePackageError("duplicate-member", "a directory with the name of a "
                                         "file", member=member.name)
            if inner:
                self.directories.add(inner)
            self.directories.update(parents)
            return
        if inner in self.files or inner in self.directories:
            raise UnsafePackageError("duplicate-member", "the name appears twice",
                                     member=member.name)
        self.unpacked += len(content)
        if self.unpacked > limit:
            raise UnsafePackageError("too-large", f"files total more than {limit} bytes",
                                     member=member.name)
        self.files[inner] = content
        self.directories.update(parents)


# --------------------------------------------------------------------------- compose.yaml


def _parse_document(text: bytes, where: str) -> dict[str, Any]:
    """A Compose file as a mapping (any file of the package: `compose.yaml` or one it
    includes or extends), or `compose-yaml-invalid`."""
    if len(text) > MAX_COMPOSE_BYTES:
        raise UnsafePackageError("compose-yaml-invalid", f"larger than {MAX_COMPOSE_BYTES} "
                                 "bytes", member=where)
    try:
        document = yaml.load(text.decode("utf-8"), Loader=_Loader)  # a safe loader
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UnsafePackageError("compose-yaml-invalid", f"not valid YAML: {exc}",
                                 member=where) from None
    if not isinstance(document, dict):
        raise UnsafePackageError("compose-yaml-invalid", "must be a YAML mapping", member=where)
    return document


def _parse_compose(text: bytes, where: str) -> dict[str, Any]:
    document = _parse_document(text, where)
    services = document.get("services")
    if not isinstance(services, dict) or not services:
        raise UnsafePackageError("compose-yaml-invalid", "must have a non-empty 'services' "
                                 "mapping", member=where)
    for name, service in services.items():
        if not isinstance(name, str) or not isinstance(service, dict | None):
            raise UnsafePackageError("compose-yaml-invalid", f"service {name!r} must be a "
                                     "mapping", member=where)
    return document


def _check_references(document: Mapping[str, Any], tree: _Tree, top: str) -> None:
    """Every path Compose would follow stays in the package (`reconciler.compose_paths`),
    reported like any other unsafe member: the file inside the archive, and the YAML path
    and value in the message."""
    def parse(name: str) -> Mapping[str, Any]:
        return _parse_document(tree.files[name], f"{top}/{name}")

    try:
        check_compose_paths(document, files=tree.files, directories=tree.directories,
                            parse=parse, compose_file=COMPOSE_FILE)
    except PathRefused as refused:
        raise UnsafePackageError(refused.rule, f"{refused.where} {refused.value!r} "
                                 f"{refused.reason}", member=f"{top}/{refused.file}",
                                 field=refused.where) from None


# --------------------------------------------------------------------------- public API


def validate_package(data: bytes, *, max_members: int = MAX_MEMBERS,
                     max_unpacked_bytes: int = MAX_UNPACKED_BYTES) -> ComposePackage:
    """Read and check a Compose Archive completely; raise `UnsafePackageError` naming the
    first offending member and rule. Nothing touches the file system."""
    tree = _Tree(set(), {}, set())
    for member, content in _members(_decompress(data, max_unpacked_bytes), max_members):
        parts = _member_parts(member)
        _check_type_and_mode(member)
        if parts:
            tree.add(member, parts, content, max_unpacked_bytes)
        elif not member.isdir():
            raise UnsafePackageError("unnormalised-name", "the archive root must be a "
                                     "directory", member=member.name)
    if len(tree.tops) != 1:
        raise UnsafePackageError("single-top-level-directory", "the archive must contain "
                                 "exactly one top-level directory; it contains none")
    top = next(iter(tree.tops))
    if COMPOSE_FILE not in tree.files:
        others = [n for n in _OTHER_COMPOSE_NAMES if n in tree.files]
        hint = f" ({', '.join(others)} is not a valid name)" if others else ""
        raise UnsafePackageError("missing-compose-yaml", f"the top-level directory has no "
                                 f"{COMPOSE_FILE}{hint}", member=top)
    compose = _parse_compose(tree.files[COMPOSE_FILE], f"{top}/{COMPOSE_FILE}")
    _check_references(compose, tree, top)
    directories = tuple(sorted(tree.directories, key=lambda d: (d.count("/"), d)))
    return ComposePackage(digest=digest_of(data), top_directory=top, files=dict(tree.files),
                          directories=directories, compose=compose)


def _write_file(path: Path, content: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(descriptor, "wb") as handle:
        os.fchmod(handle.fileno(), 0o644)  # whatever the umask
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())


def extract_package(package: ComposePackage, dest: Path) -> Path:
    """Write the package's top-level directory contents to `dest` (which must not exist)
    and return the path of its `compose.yaml`.

    Atomic: everything is written into a temporary sibling and renamed to `dest`, so after a
    crash `dest` is either complete or absent (a leftover `.<name>.partial-*` sibling can be
    deleted). Raises `FileExistsError` when `dest` exists."""
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.partial-{secrets.token_hex(6)}"
    staging.mkdir(mode=0o755)
    try:
        os.chmod(staging, 0o755)
        for directory in package.directories:
            (staging / directory).mkdir(mode=0o755)
            os.chmod(staging / directory, 0o755)
        for name in sorted(package.files):
            _write_file(staging / name, package.files[name])
        os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    directory_fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(directory_fd)  # make the rename durable
    finally:
        os.close(directory_fd)
    return dest / COMPOSE_FILE


def restore_extracted(package: ComposePackage, dest: Path) -> list[str]:
    """Make `dest` hold exactly the package's bytes again before it is used; the names of
    the files that had to be written (empty when it was intact).

    `dest` missing: it is extracted (`extract_package`). A file that is missing, not a
    regular file, or holds other bytes is replaced atomically (written beside it, renamed
    over it, so a link planted there is replaced, never followed). Files the package does not
    have are left alone: a service may bind-mount a package directory and write into it. A
    package directory that is no longer a real directory (a link could lead a write
    anywhere) means extracting the whole package afresh."""
    dest = Path(dest)
    if not dest.exists() and not dest.is_symlink():
        extract_package(package, dest)
        return sorted(package.files)
    if not _real_directory(dest) or not all(_real_directory(dest / d)
                                            for d in package.directories):
        if dest.is_symlink() or not dest.is_dir():
            dest.unlink()
        else:
            shutil.rmtree(dest)
        extract_package(package, dest)
        return sorted(package.files)
    restored = []
    for name in sorted(package.files):
        path = dest / name
        if _holds(path, package.files[name]):
            continue
        staging = path.with_name(f".{path.name}.restore-{secrets.token_hex(6)}")
        try:
            _write_file(staging, package.files[name])
            os.replace(staging, path)
        except IsADirectoryError:  # a directory where the file belongs: start over
            staging.unlink(missing_ok=True)
            shutil.rmtree(dest)
            extract_package(package, dest)
            return sorted(package.files)
        except BaseException:
            staging.unlink(missing_ok=True)
            raise
        restored.append(name)
    return restored


def _real_directory(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _holds(path: Path, content: bytes) -> bool:
    """Whether `path` is a regular file (not a link) with exactly `content`."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(descriptor, "rb") as handle:
        return handle.read(len(content) + 1) == content
