"""The Helm engine (helm-python-sdk's Go library), loaded so that Kubernetes sees who applied.

Helm's Kubernetes client names its server-side-apply field manager after the program:
`filepath.Base(os.Args[0])` unless a Go variable says otherwise, and the SDK's C interface
offers no way to set that variable. Inside Python, `os.Args[0]` is the interpreter, so
every object the Helm driver applied was owned by a field manager called `python` — which
tells a cluster operator running `kubectl get -o yaml --show-managed-fields` nothing.

The Go runtime of a shared library reads the process's argument strings in place when the
library is loaded (`gostringnocopy` over the argv glibc hands to library initialisers).
So, once, before the library loads, the bytes of argv[0] are overwritten with
`margo-gitops` and NUL padding: Go then reads `margo-gitops`, and `ps` shows
`margo-gitops` followed by the real arguments. Python keeps its own copies of argv (read at
start-up), so nothing else in the process changes. Where argv[0] is too short to hold the
name, or /proc is not there, the engine loads as before (the field manager stays the
interpreter's name) — a cosmetic loss, never a failure.

Every module of the device side imports the engine through this one.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

__all__ = ["ENGINE_NAME", "helm"]

#: The field manager of everything the Helm driver applies (and the process's name in ps).
ENGINE_NAME = "margo-gitops"


def _argv0_span() -> tuple[int, int] | None:
    """(address, length) of the process's argv[0] bytes, from /proc/self."""
    try:
        stat = Path("/proc/self/stat").read_text()
        cmdline = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    arg_start = int(fields[45])  # field 48 of proc(5)
    return arg_start, len(cmdline.split(b"\0", 1)[0])


def name_the_process(name: str = ENGINE_NAME) -> bool:
    """Overwrite argv[0] in place with `name` (padded with NULs) unless the Go runtime is
    loaded already or argv[0] is too short. True when the name was written."""
    if "helm_python" in sys.modules:
        return False
    span = _argv0_span()
    encoded = name.encode()
    if span is None or span[1] < len(encoded):
        return False
    address, length = span
    ctypes.memmove(address, encoded.ljust(length, b"\0"), length)
    return True


name_the_process()

import helm_python as helm  # noqa: E402 - after the process carries its name (above)
