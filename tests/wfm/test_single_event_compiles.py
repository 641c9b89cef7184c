"""A push to the hosted source is one event: its compile does not wait the debounce that
lets a burst of capability reports make one compile (`margo serve --compile-debounce`).

A real `margo serve --host-source` with a 60 s debounce: a device's capability report
starts a debounced compile, and the operator's `git push` that follows is served to the
device long before that debounce could have run out (the wait below gives up at 30 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kits.serverkit import _one_server, add_client, margo
from test_metrics import ADMIN_TOKEN, Device, fleet_repository, git

DEBOUNCE = "60"


def test_a_push_compiles_without_waiting_for_the_debounce_a_report_started(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    token = add_client(data, "edge")
    (tmp_path / "admin").write_text(ADMIN_TOKEN)
    work = fleet_repository(tmp_path / "work")
    with _one_server(data, "--host-source", "--admin-token-file", str(tmp_path / "admin"),
                     "--compile-debounce", DEBOUNCE) as base:
        device = Device(base, token)
        try:
            device.register()  # (a capability report: its compile waits the debounce)
            pushing = base.replace("http://", f"http://operator:{ADMIN_TOKEN}@")
            git("push", "-q", f"{pushing}/git/source.git", "main", cwd=work)
            manifest = device.wait_for("the push's compile, before the 60 s debounce",
                                       lambda m: bool(m["deployments"]))
        finally:
            device.http.close()
    assert manifest["deployments"]


@pytest.mark.parametrize("seconds", ["-1", "nan", "601"])
def test_a_debounce_out_of_range_is_refused_before_starting(tmp_path: Path,
                                                            seconds: str) -> None:
    result = margo("serve", "--data", str(tmp_path / "data"), "--port", "1",
                   "--compile-debounce", seconds, check=False)
    assert result.returncode != 0
    assert "--compile-debounce must be 0 to 600 seconds" in result.stderr
