"""Every file path a Compose model names must stay inside its package.

Docker Compose reads more than `compose.yaml`: `include:` and `extends.file` pull in other
Compose files, and `env_file`, `label_file`, `configs.*.file`, `build` contexts and
Dockerfiles are read while the model loads or the image builds. A package is verified by its
digest, but any of those paths could name a file on the device instead (`/etc/shadow`,
`../../x`, `~/.ssh`, `${HOME}/x`), and Compose would read it. So `check_compose_paths`
resolves every path-bearing field of the Compose specification (compose-spec `spec.md`,
`build.md`, `14-include.md`; the same list compose-go resolves relative paths for) against
the package's own file list and refuses, located by file, YAML path and value:

* a path that is absolute, starts with `~`, or contains `$` (interpolation could resolve
  anywhere, and a package has no reason to compute where its own files are);
* a path that leaves the package after normalisation and link resolution
  (`resolve_inside`);
* a referenced file that is not in the package (an included or extended Compose file, a
  required `env_file`, a `label_file`, a `configs` file, an explicit Dockerfile), since
  whatever Compose found there would not be what was verified;
* included and extended files are checked the same way, recursively, each against the
  directory Compose resolves its relative paths from (the including file's base for the
  reference itself; an included file's `project_directory`, or its own directory; an
  extended file's own directory); an include cycle, a chain deeper than
  `MAX_REFERENCE_DEPTH`, or more than `MAX_REFERENCED_DOCUMENTS` checks are refused too.

Paths that by design name the device, not the package, are left alone: absolute or
interpolated bind-mount sources (a host mount the operator grants) and `secrets.*.file`
outside the package (provisioned on the device; a secret shipped inside the package is
refused instead, `secret-in-archive`). A relative bind-mount source names package content, so
it must stay inside too. Remote build contexts (Git or HTTP URLs, `docker-image://`,
`service:`) are not paths.
"""

from __future__ import annotations

import posixpath
import re
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

__all__ = ["MAX_LINK_HOPS", "MAX_REFERENCED_DOCUMENTS", "MAX_REFERENCE_DEPTH", "PathRefused",
           "check_compose_paths", "resolve_inside"]

MAX_REFERENCE_DEPTH = 8  # include/extends nesting; Compose projects rarely go past 2
MAX_REFERENCED_DOCUMENTS = 256  # (file, base) checks in one package, diamonds included
MAX_LINK_HOPS = 40  # as Linux's path resolution (ELOOP)

# What the builder fetches itself (compose-go's remote contexts); any other scheme is a path.
_REMOTE_CONTEXT = re.compile(r"^(?:https?://|git://|ssh://|git@|github\.com/)", re.IGNORECASE)
_NOT_PATH_CONTEXTS = ("docker-image://", "service:", "target:")


class PathRefused(Exception):
    """A path-bearing field broke a rule: `file` is the Compose file inside the package,
    `where` the YAML path of the field, `value` what it holds, `rule` a rule name of
    `reconciler.compose_package` (`referenced-file`, `reference-cycle`, `reference-depth`,
    `secret-in-archive`)."""

    def __init__(self, rule: str, file: str, where: str, value: Any, reason: str) -> None:
        super().__init__(f"{file}: {where} {value!r} {reason}")
        self.rule = rule
        self.file = file
        self.where = where
        self.value = value
        self.reason = reason


def resolve_inside(path: str, base: str = "",
                   links: Mapping[str, str] | None = None) -> str | None:
    """`path`, taken relative to the package directory `base` ("" is the top), as a
    normalised package path ("" for the top itself), or None when it is absolute or leaves
    the package.

    Resolved component by component, the way the kernel does: a `..` after a link climbs
    from the link's target, not lexically, so `links` (package path -> link target) are
    followed as they are met; an absolute target, or more than `MAX_LINK_HOPS` of them,
    leaves the package. (Archives with links are refused before this runs, so the package
    check passes none; the resolution stays right if that rule is ever relaxed.)"""
    if path.startswith("/"):
        return None
    links = links or {}
    stack = [part for part in base.split("/") if part]
    pending = deque(path.split("/"))
    hops = 0
    while pending:
        part = pending.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                return None
            stack.pop()
            continue
        stack.append(part)
        target = links.get("/".join(stack))
        if target is None:
            continue
        hops += 1
        if hops > MAX_LINK_HOPS or target.startswith("/"):
            return None
        stack.pop()
        pending.extendleft(reversed(target.split("/")))
    return "/".join(stack)


def check_compose_paths(compose: Mapping[str, Any], *, files: Collection[str],
                        directories: Collection[str],
                        parse: Callable[[str], Mapping[str, Any]],
                        links: Mapping[str, str] | None = None,
                        compose_file: str = "compose.yaml") -> None:
    """Check every path in `compose` (the package's `compose_file`, parsed) and in every
    file it includes or extends; raise `PathRefused` at the first offence.

    `files` and `directories` are the package's paths relative to its top directory, and
    `parse(name)` returns another of its Compose files as a mapping (raising whatever the
    caller uses for invalid YAML)."""
    _Walker(files, directories, parse, links or {}).document(compose_file, compose, "",
                                                             (compose_file,))


def _items(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """A string-or-list field as (YAML path, entry) pairs: `where` for a scalar, `where[i]`
    for each list entry."""
    if isinstance(value, list):
        for index, entry in enumerate(value):
            yield f"{where}[{index}]", entry
    else:
        yield where, value


class _Walker:
    """One package check: the parsed files and the (file, base) pairs already checked."""

    def __init__(self, files: Collection[str], directories: Collection[str],
                 parse: Callable[[str], Mapping[str, Any]], links: Mapping[str, str]) -> None:
        self.files = files
        self.directories = directories
        self.parse = parse
        self.links = links
        self.checked: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------- one path

    def path(self, file: str, where: str, value: Any, bases: tuple[str, ...], *,
             kind: str | None = "file") -> str:
        """`value` resolved against `bases[0]` (and required to stay inside from every base
        in `bases`); `kind` "file" or "directory" also requires it in the package."""
        if not isinstance(value, str) or not value:
            raise PathRefused("referenced-file", file, where, value, "must be a path")
        if "$" in value:
            raise PathRefused("referenced-file", file, where, value, "uses interpolation; "
                              "packaged files must be named literally")
        if value.startswith("~"):
            raise PathRefused("referenced-file", file, where, value, "names a home "
                              "directory; it must be a relative path inside the package")
        if value.startswith("/"):
            raise PathRefused("referenced-file", file, where, value, "must be a relative path "
                              "inside the package")
        resolved = [resolve_inside(value, base, self.links) for base in bases]
        if any(r is None for r in resolved):
            raise PathRefused("referenced-file", file, where, value, "leaves the package "
                              "directory")
        found = resolved[0]
        assert found is not None
        if kind == "file" and found not in self.files:
            raise PathRefused("referenced-file", file, where, value, "is not in the package")
        if kind == "directory" and found and found not in self.directories:
            raise PathRefused("referenced-file", file, where, value, "is not a directory in "
                              "the package")
        return found

    # ------------------------------------------------------------------- one document

    def document(self, file: str, doc: Mapping[str, Any], base: str,
                 chain: tuple[str, ...]) -> None:
        """Check `doc` (package file `file`, relative paths taken from `base`)."""
        self.checked.add((file, base))
        bases = tuple(dict.fromkeys((base, posixpath.dirname(file))))
        self.includes(file, doc.get("include"), bases, chain)
        services = doc.get("services")
        if isinstance(services, dict):
            for name, service in services.items():
                if isinstance(service, dict):
                    self.service(file, f"services.{name}", service, bases, chain)
        configs = doc.get("configs")
        if isinstance(configs, dict):
            for name, config in configs.items():
                if isinstance(config, dict) and "file" in config:
                    self.path(file, f"configs.{name}.file", config["file"], bases)
        secrets = doc.get("secrets")
        if isinstance(secrets, dict):
            for name, secret in secrets.items():
                if isinstance(secret, dict) and "file" in secret:
                    self.secret(file, f"secrets.{name}.file", secret["file"], bases)

    def referenced(self, file: str, where: str, value: str, target: str, base: str,
                   chain: tuple[str, ...], *, include: bool) -> None:
        """Parse and check the Compose file `target` that `file` names at `where`."""
        if target in chain:
            if include:
                cycle = " -> ".join((*chain, target))
                raise PathRefused("reference-cycle", file, where, value, f"is an include "
                                  f"cycle ({cycle})")
            return  # extends back into a file being checked: Compose detects service cycles
        if (target, base) in self.checked:
            return  # reached again by another route (a diamond): checked the same way
        if len(chain) >= MAX_REFERENCE_DEPTH:
            raise PathRefused("reference-depth", file, where, value, "nests included or "
                              f"extended files more than {MAX_REFERENCE_DEPTH} deep")
        if len(self.checked) >= MAX_REFERENCED_DOCUMENTS:
            raise PathRefused("reference-depth", file, where, value, "is one reference too "
                              f"many: a package may check {MAX_REFERENCED_DOCUMENTS} files")
        self.document(target, self.parse(target), base, (*chain, target))

    def includes(self, file: str, value: Any, bases: tuple[str, ...],
                 chain: tuple[str, ...]) -> None:
        if value is None:
            return
        for where, entry in _items(value, "include"):
            if not isinstance(entry, dict):
                target = self.path(file, where, entry, bases)
                self.referenced(file, where, entry, target, posixpath.dirname(target), chain,
                                include=True)
                continue
            if "path" not in entry:
                raise PathRefused("referenced-file", file, f"{where}.path", None,
                                  "is required")
            targets = [(w, v, self.path(file, w, v, bases))
                       for w, v in _items(entry["path"], f"{where}.path")]
            project = posixpath.dirname(targets[0][2]) if targets else bases[0]
            if entry.get("project_directory") is not None:
                project = self.path(file, f"{where}.project_directory",
                                    entry["project_directory"], bases, kind=None)
            for env_where, env_file in _items(entry.get("env_file") or [],
                                              f"{where}.env_file"):
                self.path(file, env_where, env_file, bases)
            for target_where, target_value, target in targets:
                self.referenced(file, target_where, target_value, target, project, chain,
                                include=True)

    # ------------------------------------------------------------------- services

    def service(self, file: str, prefix: str, service: Mapping[str, Any],
                bases: tuple[str, ...], chain: tuple[str, ...]) -> None:
        for where, entry in _items(service.get("env_file") or [], f"{prefix}.env_file"):
            if isinstance(entry, dict):
                self.path(file, f"{where}.path", entry.get("path"), bases,
                          kind="file" if entry.get("required", True) is not False else None)
            else:
                self.path(file, where, entry, bases)
        for where, entry in _items(service.get("label_file") or [], f"{prefix}.label_file"):
            self.path(file, where, entry, bases)
        extends = service.get("extends")
        if isinstance(extends, dict) and extends.get("file") is not None:
            where = f"{prefix}.extends.file"
            target = self.path(file, where, extends["file"], bases)
            self.referenced(file, where, extends["file"], target, posixpath.dirname(target),
                            chain, include=False)
        if "build" in service:
            self.build(file, f"{prefix}.build", service["build"], bases)
        for where, volume in _items(service.get("volumes") or [], f"{prefix}.volumes"):
            self.volume(file, where, volume, bases)
        develop = service.get("develop")
        if isinstance(develop, dict):
            for where, watch in _items(develop.get("watch") or [], f"{prefix}.develop.watch"):
                if isinstance(watch, dict) and "path" in watch:
                    self.path(file, f"{where}.path", watch["path"], bases, kind=None)

    def build(self, file: str, where: str, build: Any, bases: tuple[str, ...]) -> None:
        """The context (a package directory unless remote), an explicit Dockerfile (a package
        file, relative to the context), additional contexts, SSH keys and local caches."""
        if isinstance(build, str):
            build = {"context": build}
            context_where = where
        else:
            context_where = f"{where}.context"
        if not isinstance(build, dict):
            raise PathRefused("referenced-file", file, where, build, "must be a path or a "
                              "mapping")
        context_value = build.get("context", ".")
        if isinstance(context_value, str) and _REMOTE_CONTEXT.match(context_value):
            return  # fetched by the builder, not read from the device
        context = self.path(file, context_where, context_value, bases, kind="directory")
        if build.get("dockerfile") is not None and build.get("dockerfile_inline") is None:
            self.path(file, f"{where}.dockerfile", build["dockerfile"], (context,))
        extra = build.get("additional_contexts") or {}
        pairs = (extra.items() if isinstance(extra, dict)
                 else (str(e).partition("=")[::2] for e in extra if isinstance(e, str)))
        for name, value in pairs:
            if isinstance(value, str) and value.startswith("oci-layout://"):
                value = value.removeprefix("oci-layout://")  # a local OCI layout directory
            elif not isinstance(value, str) or value.startswith(_NOT_PATH_CONTEXTS) or \
                    _REMOTE_CONTEXT.match(value):
                continue
            self.path(file, f"{where}.additional_contexts.{name}", value, bases, kind=None)
        for index, entry in enumerate(build.get("ssh") or []):
            _, _, key_path = str(entry).partition("=")  # `default`, `id` or `id=path`
            if key_path:
                self.path(file, f"{where}.ssh[{index}]", key_path, bases, kind=None)
        for field in ("cache_from", "cache_to"):
            for index, entry in enumerate(build.get(field) or []):
                options = dict(o.partition("=")[::2] for o in str(entry).split(","))
                if options.get("type") == "local":
                    for option in ("src", "dest"):
                        if option in options:
                            self.path(file, f"{where}.{field}[{index}]", options[option],
                                      bases, kind=None)

    def volume(self, file: str, where: str, volume: Any, bases: tuple[str, ...]) -> None:
        """A bind-mount source written as a relative path names package content; a host
        path (absolute, `~`, interpolated) is the operator's grant and is left alone."""
        source: Any
        if isinstance(volume, str):
            source, separator, _ = volume.partition(":")
            if not separator:
                return  # an anonymous volume
        elif isinstance(volume, dict) and volume.get("type", "volume") == "bind":
            source, where = volume.get("source"), f"{where}.source"
        else:
            return
        if not isinstance(source, str) or not source or source[0] in "/~$":
            return
        if source.startswith(".") or "/" in source or isinstance(volume, dict):
            self.path(file, where, source, bases, kind=None)

    def secret(self, file: str, where: str, value: Any, bases: tuple[str, ...]) -> None:
        """A secret file provisioned on the device (absolute or interpolated) is fine; a
        relative one must neither leave the package nor be shipped in it."""
        if not isinstance(value, str) or not value or value[0] in "/~" or "$" in value:
            return
        resolved = self.path(file, where, value, bases, kind=None)
        if resolved in self.files:
            raise PathRefused("secret-in-archive", file, where, value, "is shipped in the "
                              "package; secret files must not be")
