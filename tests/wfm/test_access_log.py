"""No credential in the server's log (`wfm.server.accesslog`): at `--log-level info` uvicorn
prints every request line, and a browser signs in to the dashboard with `/?token=...`."""

from __future__ import annotations

from pathlib import Path

import httpx
from kits.serverkit import ROOT

from tools.margoserver import margo_server
from wfm.server.accesslog import redacted

TOKEN = "an-admin-token-that-must-not-be-logged"


def test_credential_query_parameters_are_redacted() -> None:
    assert redacted('"GET /?token=abc&x=1 HTTP/1.1"') == '"GET /?token=<redacted>&x=1 HTTP/1.1"'
    assert redacted("/a?x=1&access_token=abc#f") == "/a?x=1&access_token=<redacted>#f"
    assert redacted("/a?Password=abc") == "/a?Password=<redacted>"
    assert redacted("/a?tokens_seen=3") == "/a?tokens_seen=<redacted>"  # errs on the safe side
    assert redacted("/api/fleet/devices?label=token") == "/api/fleet/devices?label=token"


def test_a_sign_in_address_is_logged_without_its_token(tmp_path: Path) -> None:
    admin = tmp_path / "admin"
    admin.write_text(TOKEN)
    with margo_server(tmp_path / "data", "--admin-token-file", str(admin), log_level="info",
                      cwd=ROOT) as server:
        httpx.get(f"{server.url}/?token={TOKEN}", timeout=10)
        httpx.get(f"{server.url}/api/fleet/devices?access_token={TOKEN}", timeout=10)
        httpx.get(f"{server.url}/api/fleet/devices", timeout=10,
                  headers={"Authorization": f"Bearer {TOKEN}"})
    log = server.log.read_text()
    assert '"GET /?token=<redacted> HTTP/1.1"' in log, log
    assert TOKEN not in log
