"""The device client's configuration as the `margo device` verbs read it: validated, or a
`UsageError` (exit 2) saying why it is unusable.

Its own module, below `device_command`, `plan_command` and `doctor_command`, so that the verbs
share it without importing one another (`make lint` refuses import cycles).
"""

from __future__ import annotations

from margo.errors import DocumentError
from margo_cli.usage import UsageError
from reconciler.config import DeviceConfig, load_config

__all__ = ["device_config"]


def device_config(path: str) -> DeviceConfig:
    """The validated configuration at `path`; `UsageError` when it cannot be read or used."""
    try:
        return load_config(path)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except DocumentError as exc:
        raise UsageError("\n".join(problem.format() for problem in exc.problems)) from None
