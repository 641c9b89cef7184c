"""A private PostgreSQL server from Debian's packages, for the tests and benchmarks.

`running_postgres(folder)` initialises a cluster in a folder of its own (`initdb`, trust
authentication for one superuser `margo`), starts `postgres` on a loopback port and a Unix
socket in that folder, and stops it at the end. PostgreSQL refuses to run as root, so when
the tests run as root the server runs as the `postgres` user the Debian package creates (the
folder is then owned by it). The server dies with the process that started it.

`fsync=off` (with `synchronous_commit` left on): a test kills and restarts the server, never
the machine, and the OS keeps what PostgreSQL wrote; the same trade as etcd's
`--unsafe-no-fsync` in tools/kube. Benchmarks say when they run this way.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tools.processes import die_with_parent, free_port

__all__ = ["PostgresServer", "postgres_binaries", "running_postgres", "why_unavailable"]

SUPERUSER = "margo"


def postgres_binaries() -> Path | None:
    """The newest installed `/usr/lib/postgresql/<version>/bin`, or None."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit()
                   else 0)
    return found[-1].parent if found else None


def why_unavailable() -> str | None:
    """None when a server can be started here; otherwise why not, for people."""
    if postgres_binaries() is None:
        return "PostgreSQL is not installed (Debian package postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root, and there is no 'postgres' user to run the server as"
    return None


def _run_as() -> tuple[int, int] | None:
    """(uid, gid) to run the server as: `postgres` when we are root, else ourselves."""
    if os.geteuid() != 0:
        return None
    entry = pwd.getpwnam("postgres")
    return entry.pw_uid, entry.pw_gid


@dataclass
class PostgresServer:
    folder: Path
    port: int
    bin: Path
    owner: tuple[int, int] | None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def data(self) -> Path:
        return self.folder / "data"

    @property
    def log(self) -> Path:
        return self.folder / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _popen(self, command: list[str], **options: object) -> subprocess.Popen[bytes]:
        user = {} if self.owner is None else {"user": self.owner[0], "group": self.owner[1],
                                              "extra_groups": []}
        return subprocess.Popen(command, preexec_fn=die_with_parent, **user,  # type: ignore[call-overload]
                                **options)

    def _run(self, command: list[str]) -> None:
        process = self._popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output, _ = process.communicate(timeout=120)
        if process.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {output.decode(errors='replace')}")

    def initialise(self) -> None:
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", SUPERUSER,
                   "--auth=trust", "-E", "UTF8", "--locale=C", "--no-instructions"])

    def start(self) -> None:
        """Start (or start again, on the same port and data) and wait until it answers."""
        log = open(self.log, "ab")  # noqa: SIM115 - closed when the process ends
        self.process = self._popen(
            [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.folder}",
             "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200",
             "-c", "shared_buffers=64MB"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited ({self.process.returncode}): "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            ready = subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p",
                                    str(self.port), "-q"], check=False)
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        raise TimeoutError(f"postgres did not answer within 60 s; see {self.log}")

    def stop(self, *, mode: str = "fast") -> None:
        """`fast` (SIGINT: roll back and end sessions), `immediate` (SIGQUIT: a crash, as
        far as clients can tell), or `kill` (SIGKILL)."""
        if self.process is None or self.process.poll() is not None:
            return
        signals = {"fast": 2, "immediate": 3, "kill": 9}
        self.process.send_signal(signals[mode])
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def create_database(self, name: str) -> str:
        """A new empty database; its URL."""
        import psycopg  # only the callers that start a server need the driver

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@contextlib.contextmanager
def running_postgres(folder: Path | None = None) -> Iterator[PostgresServer]:
    """A started server in `folder` (default: a new temporary folder, removed afterwards);
    stopped at the end. PostgreSQL's folder must be reachable by the user it runs as, so a
    folder under pytest's 0700 temporary root is refused: pass none, or one under /tmp."""
    why = why_unavailable()
    if why is not None:
        raise RuntimeError(why)
    bin_dir = postgres_binaries()
    assert bin_dir is not None
    owner = _run_as()
    made = folder is None
    folder = Path(tempfile.mkdtemp(prefix="margo-pg-")) if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        os.chown(folder, *owner)
    server = PostgresServer(folder, free_port(), bin_dir, owner)
    try:
        server.initialise()
        server.start()
        yield server
    finally:
        server.stop()
        if made:
            shutil.rmtree(folder, ignore_errors=True)
