"""The `margo` command's exit codes, and the one error for input it cannot use.

0 success, 1 a negative answer (an invalid document, not eligible, a failed check), 2
input or usage that cannot be worked with (a missing file, a bad option, an unreachable
server). A subcommand raises `UsageError` for the last; `margo_cli.main` prints its
message on stderr and exits 2, so every subcommand says it the same way.
"""

from __future__ import annotations

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_UNUSABLE", "UsageError"]

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2


class UsageError(Exception):
    """Input or usage the command cannot work with; the message says what and why."""
