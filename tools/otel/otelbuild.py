"""Build the OpenTelemetry Collector the tests (and anyone on this machine) use, from its Go
modules, once per machine.

No package registry here carries a collector binary, but the Go module proxy serves the
collector's modules (`go.opentelemetry.io/collector/...`) and the contrib modules. `go.mod`
in this folder pins ONE collector release: every `v0.x` module at v0.161.0 and every `v1.x`
module at the v1.67.0 that release goes with (the contrib file exporter passes at v0.161.0,
not at later releases on this machine's proxy). `main.go` is the Collector Builder's entry
point written by hand, with only what we need: the OTLP receiver (HTTP and gRPC), the batch
processor, the file exporter (what tests read back) and the debug exporter. `go.sum` makes
every build fetch the same bytes.

The binary is cached by a key over everything that decides it (go.mod, go.sum, main.go, the
Go version, the build flags), in `$MARGO_OTEL_CACHE` or else
`${XDG_CACHE_HOME:-~/.cache}/margo-gitops/otel/<release>-<key>/margo-otelcol`, like the
Kubernetes binaries (tools/kube/kubebuild.py). Builds are serialised by a file lock, so
parallel test runs build once.

    python -m tools.otel.otelbuild        # prints the binary's path, building it if needed
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["BINARY", "HERE", "binary", "cache_root", "collector_release"]

HERE = Path(__file__).resolve().parent
BINARY = "margo-otelcol"
_INPUTS = ("go.mod", "go.sum", "main.go")
_LDFLAGS = "-s -w"


def collector_release() -> str:
    """The pinned collector release (`v0.161.0`), read from go.mod (the one place it is set)."""
    found = re.search(r"^\s*go\.opentelemetry\.io/collector/otelcol (v\d+\.\d+\.\d+)\b",
                      (HERE / "go.mod").read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{HERE / 'go.mod'}: no go.opentelemetry.io/collector/otelcol "
                           "requirement")
    return found.group(1)


def _go() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists()
                                else None)
    if go is None:
        raise RuntimeError("building the OpenTelemetry Collector needs a Go toolchain "
                           "(`go` on PATH or /usr/local/go/bin/go)")
    return go


def cache_root() -> Path:
    if os.environ.get("MARGO_OTEL_CACHE"):
        return Path(os.environ["MARGO_OTEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "margo-gitops" / "otel"


def _key(go: str) -> str:
    digest = hashlib.sha256()
    for name in _INPUTS:
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    go_version = subprocess.run([go, "version"], capture_output=True, text=True,
                                check=True).stdout
    digest.update(go_version.encode() + _LDFLAGS.encode())
    return digest.hexdigest()[:12]


def binary(*, log: Callable[[str], None] | None = None) -> Path:
    """The collector binary, built first when the cache has none. `log` (default: stderr)
    hears about a build, which takes minutes the first time."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    go, release = _go(), collector_release()
    folder = cache_root() / f"{release}-{_key(go)}"
    target = folder / BINARY
    if target.is_file():
        return target
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target  # another process built it while we waited
        say(f"building the OpenTelemetry Collector {release} from Go modules into {folder} "
            "(once per machine; a few minutes on two cores)")
        started = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=folder.parent))
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly",
               "GOTOOLCHAIN": "local"}
        try:
            subprocess.run([go, "build", "-trimpath", "-ldflags", _LDFLAGS, "-o",
                            str(work / BINARY), "."], cwd=HERE, env=env, check=True)
            if folder.exists():
                shutil.rmtree(folder)
            work.chmod(0o755)
            work.rename(folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for stale in folder.parent.glob("v*-*"):  # builds for other inputs: ~26 MB each
            if stale != folder and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        say(f"built the OpenTelemetry Collector in {time.monotonic() - started:.0f} s")
    return target


if __name__ == "__main__":
    print(binary())
