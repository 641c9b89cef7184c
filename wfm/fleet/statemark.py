"""Which published generation the compiling replica's compiler state belongs to.

The compiler's state (`compiler.state`) is a cache per replica, valid only while this
replica was the last to publish; a sidecar beside it records the generation it compiled and
the lease epoch it held (`wfm.fleet.coordination` drops the state when they do not match).
"""

from __future__ import annotations

from pathlib import Path

from margo.files import write_atomically

__all__ = ["STATE_FILE", "state_mark", "write_state_mark"]

STATE_FILE = "compiler-state.sqlite"
_SIDECAR = "compiler-state.generation"


def state_mark(directory: Path) -> tuple[int, int | None] | None:
    """(the generation the compiler's state belongs to, the lease epoch it was written
    under; None when an older server wrote only the generation), or None: no sidecar."""
    try:
        words = (directory / _SIDECAR).read_text().split()
        return int(words[0]), (int(words[1]) if len(words) > 1 else None)
    except (OSError, ValueError, IndexError):
        return None


def write_state_mark(directory: Path, generation: int, epoch: int | None) -> None:
    """Record that the state in `directory` belongs to `generation` (under `epoch`)."""
    write_atomically(directory / _SIDECAR,
                     f"{generation}\n" if epoch is None else f"{generation} {epoch}\n")
