"""Credentials never reach the server's log: uvicorn's access log (`--log-level info`)
prints each request line with its query string, and a browser signs in to the dashboard
with `/?token=<token>` (`wfm.http.sessions`). `install` adds a filter to that logger which
replaces the value of every query parameter whose name says it is a credential (`token`,
`access_token`, `password`...) by `<redacted>`, before any handler formats the line.
"""

from __future__ import annotations

import logging
import re

__all__ = ["ACCESS_LOGGER", "CredentialRedaction", "install", "redacted"]

ACCESS_LOGGER = "uvicorn.access"
_CREDENTIAL = re.compile(r"([?&](?:[^=&#]*(?:token|password|secret)[^=&#]*)=)[^&#\s]*",
                         re.IGNORECASE)


def redacted(text: str) -> str:
    """`text` with the values of credential query parameters replaced."""
    return _CREDENTIAL.sub(r"\1<redacted>", text)


class CredentialRedaction(logging.Filter):
    """Redacts credential query parameters in a record's message and arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redacted(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redacted(record.msg)
        return True


def install() -> None:
    """Add the filter to uvicorn's access logger (once)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, CredentialRedaction) for f in logger.filters):
        logger.addFilter(CredentialRedaction())
