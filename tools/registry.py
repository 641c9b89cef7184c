"""A real OCI registry (Debian's `docker-registry`, CNCF distribution 2.8) on loopback, for
the tests (`kits.registrykit`), the benchmarks and the demo.

Started (once per test session) on a free port, storage in a temporary directory; stopped at
the end. The Makefile installs the package; a machine without it fails loudly instead of
skipping (the drivers must be tested against a real registry).

With `users` the registry requires HTTP basic authentication against an htpasswd file
(bcrypt, the only hash distribution accepts): anonymous requests get 401, as from any
private registry.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import bcrypt
import httpx

from tools.processes import free_port, stop, wait_until_ready

__all__ = ["running_registry"]

CONFIG = """\
version: 0.1
log: {{level: error}}
storage:
  filesystem: {{rootdirectory: {root}}}
  delete: {{enabled: true}}
http: {{addr: "127.0.0.1:{port}"}}
"""
AUTH = """\
auth:
  htpasswd: {{realm: margo-test-registry, path: {path}}}
"""


@contextmanager
def running_registry(workdir: Path, port: int | None = None, *,
                     users: Mapping[str, str] | None = None) -> Iterator[str]:
    """Start `docker-registry serve`; yield `127.0.0.1:<port>`; stop it afterwards.
    `users` (name → password) makes it require those credentials."""
    binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    if not Path(binary).exists():
        raise RuntimeError("docker-registry is not installed: run `make venv` (it installs "
                           "the Debian package)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / f"registry-{port}.yml"
    text = CONFIG.format(root=workdir / "storage", port=port)
    if users:
        htpasswd = workdir / f"htpasswd-{port}"
        htpasswd.write_text("".join(
            f"{name}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()}\n"
            for name, password in users.items()))
        text += AUTH.format(path=htpasswd)
    config.write_text(text)
    log = open(workdir / f"registry-{port}.log", "w")  # noqa: SIM115
    process = subprocess.Popen([binary, "serve", str(config)], stdout=log,
                               stderr=subprocess.STDOUT)
    host = f"127.0.0.1:{port}"
    try:
        ready = 401 if users else 200
        wait_until_ready(process, lambda: httpx.get(f"http://{host}/v2/", timeout=1)
                         .status_code == ready, "registry", workdir / f"registry-{port}.log",
                         timeout=20, interval=0.05)
        yield host
    finally:
        stop(process, timeout=10)
        log.close()
