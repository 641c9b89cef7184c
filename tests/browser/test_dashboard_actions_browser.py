"""Rollout actions as people see them: headless Chromium (Debian's) against a running server
with a staged rollout in progress (`kits.rolloutkit`). An operator clicks Pause and sees the
rollout paused; a viewer sees the same rollout without a button."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.rolloutkit import INTENT, RolloutServer, rollout_server


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutServer]:
    with rollout_server(tmp_path_factory.mktemp("browser-rollout"),
                        {"olivia": "operator", "victor": "viewer"}) as server:
        yield server


def test_an_operator_pauses_the_rollout_and_a_viewer_sees_no_button(
        rollout: RolloutServer, signed_in_page: Callable[[str, str], Any],
        screenshots: Path) -> None:
    block = f'[data-rollout="{INTENT}"]'
    viewer = signed_in_page(rollout.base, rollout.tokens["victor"])
    who = viewer.get_by_test_id("who")
    assert (who.get_attribute("data-operator"), who.get_attribute("data-role")) == (
        "victor", "viewer")
    assert viewer.locator(f"{block} [data-testid=rollout-status]").inner_text() == "progressing"
    assert viewer.locator(f"{block} button, {block} summary").count() == 0

    operator = signed_in_page(rollout.base, rollout.tokens["olivia"])
    assert operator.get_by_test_id("who").get_attribute("data-role") == "operator"
    operator.locator(block).get_by_role("button", name="Pause").click()
    operator.wait_for_url(f"{rollout.base}/#rollout-{INTENT}")
    assert operator.locator(f"{block} [data-testid=rollout-status]").inner_text() == "paused"
    assert operator.locator(f"{block} button[data-action=resume]").is_visible()
    assert operator.locator(f"{block} [data-action=pause]").count() == 0
    assert rollout.rollout()["status"] == "paused"
    operator.screenshot(path=str(screenshots / "dashboard-rollout-paused.png"))
