"""Start a device that will load the Helm engine with the Go runtime settings it should have.

The Helm engine is a Go shared library, and its runtime reads `GOGC` (how far the heap may
grow past what survived the last collection before it collects again; 100 by default,
i.e. double) once, from the environment the *process started with*: on Linux it finds it
past argv on the initial stack, so setting `os.environ` before the library loads changes
nothing (checked with GODEBUG=inittrace=1). An install cycle's chart rendering and
Kubernetes clients are short-lived garbage, and with the default the device's peak
resident memory is that heap doubled: `bench/device_memory.py` measured 123.4 to 124.6 MiB at
the peak with it and 118.5 MiB with GOGC=50, the steady figure about the same (a device
installs seldom; the extra collections are not noticed). So `margo device run|once` with a
driver that loads the engine execs itself once, same process id, with GOGC=50 added,
unless the environment already sets GOGC (an operator's own choice wins).

Only the margo program itself does this (`margo ...` or `python -m margo_cli.main ...`),
never a process that merely calls the command's function, such as a test runner.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["ENGINE_DRIVERS", "GO_SETTINGS", "restart_with_engine_settings"]

#: The device drivers that load the Helm engine.
ENGINE_DRIVERS = frozenset({"helm", "render"})
#: What the engine's Go runtime is started with, where the environment does not say.
GO_SETTINGS = {"GOGC": "50"}


def _is_the_margo_program() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) == "margo_cli.main" or Path(sys.argv[0]).name == "margo"


def restart_with_engine_settings(driver: str) -> None:
    """Exec this program again with `GO_SETTINGS` when `driver` loads the engine and they
    are missing; return when nothing needs doing (or when this is not the margo program)."""
    missing = {name: value for name, value in GO_SETTINGS.items() if name not in os.environ}
    if driver not in ENGINE_DRIVERS or not missing or not _is_the_margo_program():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, **missing})
