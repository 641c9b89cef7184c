"""Reading a step's result back from the engine, before the runner reports it.

That `apply` returned means the engine accepted the step, not that the engine now holds
what was applied: Helm's record of the release can be left `failed` or `pending-*`, or moved
on by another writer; a container can exit right after `up` started it; a file can differ
from what was written. So after every step the runner asks the driver to `confirm` it
(`reconciler.drivers.base.Driver.confirm`), and only then reports the component `installed`
(or `removed`). Each driver reads the engine's own view and describes both sides in the
same few words:

- `helm`: Helm's storage (`status`, and `get values` of that revision): status `deployed`,
  the revision the step wrote, the chart's name and version, our labels, the values' digest;
- `compose`: the Docker engine's containers (`docker ps`) and Compose's own `config
  --hash`: a container per service, running (healthy, with `wait`) or a job that finished,
  carrying our labels and the config-hash of the files we wrote;
- `render`: the ledger and the files on disk: status `deployed`, our labels, each file's
  digest as written.

`require_match` turns the differences into the one error the runner reports:
`ApplyError(READBACK_MISMATCH)`, naming for each difference what was expected and what was
found. It is retryable: the next cycle plans again against what the engine really holds.
"""

from __future__ import annotations

from collections.abc import Mapping

from reconciler.errors import ApplyError, ErrorCode

__all__ = ["NOTHING", "require_match"]

#: What a description holds for something the engine does not have at all.
NOTHING = "nothing"
#: How many differences a message names (the rest are counted).
_SHOWN = 6


def require_match(what: str, expected: Mapping[str, str], found: Mapping[str, str]) -> None:
    """Raise `READBACK_MISMATCH` when `found` (the engine's view, read back) differs from
    `expected` (what the step applied) in any key of `expected`; a key missing from `found`
    counts as `NOTHING`. `what` names the release and where it was read, for the message."""
    differences = [f"{key}: expected {value}, found {found.get(key, NOTHING)}"
                   for key, value in expected.items() if found.get(key, NOTHING) != value]
    if not differences:
        return
    shown = "; ".join(differences[:_SHOWN])
    more = f"; and {len(differences) - _SHOWN} more" if len(differences) > _SHOWN else ""
    raise ApplyError(ErrorCode.READBACK_MISMATCH,
                     f"{what} is not what was applied: {shown}{more}")
