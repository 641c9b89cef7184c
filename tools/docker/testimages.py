"""Small container images built on this machine, since none can be pulled: a root file
system made of Debian's static busybox (`busybox-static`, /bin/busybox) and a few files,
imported with `docker import` and pushed to a local registry.

`web_image` serves `/www/index.html` with busybox httpd on port 8080 and prints a start-up
line naming its version and greeting (so logs show what runs). `crash_image` prints two
lines and exits 3 (a container that fails during start-up). The tar is deterministic, so
the same inputs import as the same layer.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from tools.docker.dockerengine import DockerEngine

__all__ = ["BUSYBOX", "crash_image", "greeter_image", "push_image", "rootfs_tar", "web_image",
           "worker_command"]

BUSYBOX = Path("/bin/busybox")
APPLETS = ("sh", "httpd", "wget", "sleep", "echo", "cat", "env", "kill", "true", "false")


def rootfs_tar(files: Mapping[str, str | bytes], *, busybox: Path = BUSYBOX,
               executables: Collection[str] = ()) -> bytes:
    """A root file system: busybox, its applets as symlinks, `files` (path → content;
    those named in `executables` with mode 0755)."""
    if not busybox.is_file():
        raise RuntimeError(f"{busybox} is missing: install Debian's busybox-static")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes | None = None, *, mode: int = 0o644,
                link: str | None = None) -> None:
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            if link is not None:
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, link, 0o777
                tar.addfile(info)
            elif data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))
        folders = {"bin", "tmp", "www"} | {str(Path(p).parent) for p in files}
        for folder in sorted(f for f in folders if f not in ("", ".")):
            add(folder)
        add("bin/busybox", busybox.read_bytes(), mode=0o755)
        for applet in APPLETS:
            add(f"bin/{applet}", link="busybox")
        for path, content in sorted(files.items()):
            add(path, content.encode() if isinstance(content, str) else content,
                mode=0o755 if path in executables else 0o644)
    return buffer.getvalue()


def _import(engine: DockerEngine, ref: str, files: Mapping[str, str | bytes],
            cmd: Sequence[str], env: Mapping[str, str]) -> str:
    changes = [f"CMD {_json_list(cmd)}", "ENV PATH=/bin"] + [
        f"ENV {key}={value}" for key, value in env.items()]
    argv = ["import"]
    for change in changes:
        argv += ["--change", change]
    engine.run(*argv, "-", ref, input=rootfs_tar(files))
    return ref


def _json_list(items: Sequence[str]) -> str:
    import json
    return json.dumps(list(items))


#: A shell as PID 1 that stops its child on SIGTERM: PID 1 has no default signal handlers,
#: so `exec httpd` would ignore `docker stop` and wait out its 10 s grace period.
_SUPERVISE = 'trap "kill $child; exit 0" TERM INT; {command} & child=$!; wait $child'


def web_image(engine: DockerEngine, ref: str, version: str) -> str:
    """busybox httpd on :8080 serving `web <version>`; logs a start-up line first, stops at
    once on SIGTERM. `sleep` as its command makes a quiet worker of it."""
    start = ('echo "web $VERSION starting, greeting: ${GREETING:-none}"; '
             + _SUPERVISE.format(command="httpd -f -v -p 8080 -h /www"))
    return _import(engine, ref, {"www/index.html": f"web {version}\n"},
                   ["sh", "-c", start], {"VERSION": version})


def greeter_image(engine: DockerEngine, ref: str) -> str:
    """busybox httpd on :8080 answering with `$GREETING` (the page is written at start, so
    a reconfigured environment shows on the next request)."""
    start = ('echo "${GREETING:-Hello}" > /www/index.html; echo "greeter serving: $GREETING"; '
             + _SUPERVISE.format(command="httpd -f -p 8080 -h /www"))
    return _import(engine, ref, {"www/index.html": "\n"}, ["sh", "-c", start], {})


def worker_command(seconds: int = 3600) -> list[str]:
    """A command for `web_image` containers that idles, stopping at once on SIGTERM."""
    return ["sh", "-c", _SUPERVISE.format(command=f"sleep {seconds}")]


def crash_image(engine: DockerEngine, ref: str) -> str:
    """Fails during start-up: two log lines, then exit code 3."""
    return _import(engine, ref, {}, [
        "sh", "-c", 'echo "loading configuration"; echo "fatal: DATABASE_URL is not set" >&2; '
                    "exit 3"], {})


def push_image(engine: DockerEngine, ref: str) -> None:
    engine.run("push", ref)
