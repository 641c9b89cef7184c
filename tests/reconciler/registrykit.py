"""A real OCI registry (Debian's `docker-registry`, CNCF distribution 2.8) on loopback.

Started once per test session on a free port, storage in a temporary directory; stopped at
the end. The Makefile installs the package; a machine without it fails loudly instead of
skipping (the drivers must be tested against a real registry).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from processkit import free_port, stop, wait_until_ready

CONFIG = """\
version: 0.1
log: {{level: error}}
storage:
  filesystem: {{rootdirectory: {root}}}
  delete: {{enabled: true}}
http: {{addr: "127.0.0.1:{port}"}}
"""


@contextmanager
def running_registry(workdir: Path, port: int | None = None) -> Iterator[str]:
    """Start `docker-registry serve`; yield `127.0.0.1:<port>`; stop it afterwards."""
    binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    if not Path(binary).exists():
        raise RuntimeError("docker-registry is not installed: run `make venv` (it installs "
                           "the Debian package)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / f"registry-{port}.yml"
    config.write_text(CONFIG.format(root=workdir / "storage", port=port))
    log = open(workdir / f"registry-{port}.log", "w")  # noqa: SIM115
    process = subprocess.Popen([binary, "serve", str(config)], stdout=log,
                               stderr=subprocess.STDOUT)
    host = f"127.0.0.1:{port}"
    try:
        wait_until_ready(process, lambda: httpx.get(f"http://{host}/v2/", timeout=1)
                         .status_code == 200, "registry", workdir / f"registry-{port}.log",
                         timeout=20, interval=0.05)
        yield host
    finally:
        stop(process, timeout=10)
        log.close()
