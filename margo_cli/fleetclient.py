"""The commands that ask a running fleet server (`margo status`, `margo rollout`,
`margo explain --url`): one way to call its read API with the operator token and to turn a
refusal into an error that says what the server said."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import httpx

__all__ = ["DEFAULT_URL", "add_server_options", "call"]

DEFAULT_URL = "http://127.0.0.1:8080"


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """`--url` and `--token-file`, defaulting to `MARGO_URL` and `MARGO_TOKEN_FILE` so a
    shell (and its completion, which cannot see options not typed yet) names the server
    once."""
    parser.add_argument("--url", default=os.environ.get("MARGO_URL") or DEFAULT_URL,
                        help="the server's base URL (default: $MARGO_URL, else "
                             f"{DEFAULT_URL})")
    parser.add_argument("--token-file", metavar="FILE",
                        default=os.environ.get("MARGO_TOKEN_FILE") or None,
                        help="operator token, if the server requires one (default: "
                             "$MARGO_TOKEN_FILE)")


def call(url: str, path: str, *, token_file: str | None = None, method: str = "GET",
         params: dict[str, str] | None = None, timeout: float = 60) -> Any:
    """The JSON of `method url+path`; RuntimeError("<path>: <status> <detail>") unless 200
    (httpx errors and an unreadable token file propagate)."""
    headers = {}
    if token_file:
        headers["Authorization"] = "Bearer " + Path(token_file).read_text().strip()
    response = httpx.request(method, url.rstrip("/") + path, params=params, headers=headers,
                             timeout=timeout)
    if response.status_code != 200:
        detail = (response.json().get("detail") if "json" in
                  response.headers.get("content-type", "") else response.text)
        raise RuntimeError(f"{path}: {response.status_code} {detail}")
    return response.json()
