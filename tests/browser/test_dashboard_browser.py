"""The dashboard as a person sees it: headless Chromium (Debian's) against a running server.

Screenshots at 1366x768 land in the pytest temporary directory for review; with
UPDATE_SCREENSHOTS=1 they are also copied to docs/images/ for the README.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The session fixture's fleet (tests/browser/conftest.py DashboardFleet); test modules do
#: not import conftest, whose module name is not unique in this tree.
DashboardFleet = Any


def shoot(page: Any, screenshots: Path, name: str) -> None:
    """The visible 1366x768 screen (what the README shows) and the whole page (review)."""
    target = screenshots / f"dashboard-{name}.png"
    page.screenshot(path=str(target))
    page.screenshot(path=str(screenshots / f"dashboard-{name}-full.png"), full_page=True)
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        images = ROOT / "docs" / "images"
        images.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, images / target.name)


def row_text(page: Any, selector: str) -> str:
    return " ".join(str(page.locator(selector).inner_text()).split())


def test_sign_in_keeps_the_token_out_of_the_address_and_the_page(
        browser_context: Any, dashboard_fleet: DashboardFleet) -> None:
    cookies = {c["name"]: c for c in browser_context.cookies(dashboard_fleet.base)}
    session = cookies["margo_dashboard"]
    assert session["httpOnly"] and session["sameSite"] == "Strict"
    assert "browser-operator-token" not in session["value"]
    page = browser_context.new_page()
    try:
        page.goto(dashboard_fleet.base + "/")
        assert page.evaluate("document.cookie") == ""  # HttpOnly: no script can read it
        assert "token" not in page.url
    finally:
        page.close()


def test_overview_lists_devices_with_kinds_nodes_gpus_and_state_counts(
        page: Any, dashboard_fleet: DashboardFleet, screenshots: Path) -> None:
    page.goto(dashboard_fleet.base + "/")
    assert page.locator("html").get_attribute("lang") == "en"
    assert page.get_by_role("heading", level=1).inner_text() == "Fleet overview"
    rows = page.locator("table.devices tbody tr")
    assert rows.count() == 3
    assert [rows.nth(i).locator("th").inner_text() for i in range(3)] == [
        "line-box", "plant-a-cluster", "plant-a-edge"]
    cluster = row_text(page, 'tr[data-device="plant-a-cluster"]')
    assert re.search(r"Kubernetes cluster \(k3s v1\.31\.2\) 3 1 ", cluster), cluster
    assert "1 installing" in cluster and "1 installed" in cluster
    box = row_text(page, 'tr[data-device="line-box"]')
    assert "Compose box" in box and "1 failed" in box
    counts = dashboard_fleet.operator_get("/api/fleet/deployments")
    totals = row_text(page, '[data-testid="total-states"]')
    for state, count in counts["byState"].items():
        assert f"{count} {state}" in totals
    vision = row_text(page, 'tr[data-application="com-example-gpu-inference"]')
    assert "Vision Inference" in vision and "plant-a-cluster installing" in vision
    shoot(page, screenshots, "overview")


def test_a_device_page_shows_its_nodes_and_why_an_intent_fails(
        page: Any, dashboard_fleet: DashboardFleet, screenshots: Path) -> None:
    page.goto(dashboard_fleet.base + "/")
    page.locator("#devices").get_by_role("link", name="plant-a-edge", exact=True).click()
    page.wait_for_url("**/devices/plant-a-edge")
    assert "Device plant-a-edge" in page.get_by_role("heading", level=1).inner_text()
    nodes = page.locator("table.nodes tbody tr")
    assert nodes.count() == 1
    assert row_text(page, 'tr[data-node="edge-1"]').startswith(
        "edge-1 control-plane, worker Ready yes amd64 6.5 of 7 27Gi of 27Gi")
    vision = row_text(page, 'article[data-intent="vision-plant-a"]')
    assert "vision-plant-a: not eligible" in vision
    assert "Failing clause" in vision and "NVIDIA" in vision

    page.goto(dashboard_fleet.base + "/devices/plant-a-cluster")
    assert page.locator("table.nodes tbody tr").count() == 3
    assert "1 x NVIDIA L4" in row_text(page, 'tr[data-node="worker-gpu"]')
    assert row_text(page, 'tr[data-node="cp-1"]').startswith("cp-1 control-plane Ready no amd64")
    assert page.locator("table.history tbody tr").count() >= 1
    shoot(page, screenshots, "device")


def test_the_application_page_says_where_it_cannot_run_and_why(
        page: Any, dashboard_fleet: DashboardFleet, screenshots: Path) -> None:
    page.goto(dashboard_fleet.base + "/")
    page.get_by_role("link", name="Vision Inference").click()
    page.wait_for_url("**/applications/com-example-gpu-inference")
    runs = page.locator("table.runs tbody tr")
    assert runs.count() == 1 and "installing" in row_text(page, "table.runs tbody tr")
    edge = row_text(page, 'article.blocked[data-device="plant-a-edge"]')
    assert "not eligible" in edge and "NVIDIA" in edge
    box = row_text(page, 'article.blocked[data-device="line-box"]')
    assert "not targeted" in box and "example.com/site" in box and "plant-b" in box
    shoot(page, screenshots, "application")


def test_the_page_refreshes_itself_after_a_new_status_report(
        page: Any, dashboard_fleet: DashboardFleet) -> None:
    page.goto(dashboard_fleet.base + "/devices/plant-a-cluster")
    deployment = dashboard_fleet.deployment_id("plant-a-cluster", "line-monitor")
    selector = f'tr[data-deployment="{deployment}"]'
    assert "pending" in row_text(page, selector)
    page.evaluate("window.notReloaded = true")  # a reload would drop this
    dashboard_fleet.report("plant-a-cluster", "line-monitor", "failed",
                           {"code": "E-HELM", "message": "chart values rejected"})
    page.wait_for_function(
        "sel => (document.querySelector(sel) || {}).innerText?.includes('chart values rejected')",
        arg=selector, timeout=15_000)
    assert "failed" in row_text(page, selector)
    assert page.evaluate("window.notReloaded") is True
    assert page.url.endswith("/devices/plant-a-cluster")


#: What the Compose driver reported for a failed upgrade (tests/reconciler/test_compose_e2e:
#: Compose's progress lines, then the failing container's last log lines).
COMPOSE_FAILURE = (
    "upgrade of web-7b7ff02016: docker compose exited with 1: Container "
    "web-7b7ff02016-web-1  Recreate\n Container web-7b7ff02016-migrate-1  Creating\n"
    " Container web-7b7ff02016-migrate-1  Created\n Container web-7b7ff02016-web-1  Recreated\n"
    " Container web-7b7ff02016-migrate-1  Starting\n Container web-7b7ff02016-web-1  Started\n"
    " Container web-7b7ff02016-web-1  Waiting\n Container web-7b7ff02016-web-1  Healthy\n"
    "container web-7b7ff02016-migrate-1 exited (3)\nweb-7b7ff02016-migrate-1 exited with "
    "code 3; its last log lines:\nloading configuration\nfatal: DATABASE_URL is not set")


def test_a_long_error_is_shown_once_briefly_and_unfolds_in_full(
        page: Any, dashboard_fleet: DashboardFleet) -> None:
    dashboard_fleet.report("plant-a-edge", "hello-everywhere", "failed",
                           {"code": "UPGRADE_FAILED", "message": COMPOSE_FAILURE})
    deployment = dashboard_fleet.deployment_id("plant-a-edge", "hello-everywhere")
    page.goto(dashboard_fleet.base + "/devices/plant-a-edge")
    row = page.locator(f'tr[data-deployment="{deployment}"]')
    shown = " ".join(str(row.inner_text()).split())
    # The component says its code; the Error column says the message once, first and last
    # lines, with Compose's progress folded away.
    assert shown.count("UPGRADE_FAILED") == 2, shown
    assert shown.count("docker compose exited with 1") == 1, shown
    assert shown.count("fatal: DATABASE_URL is not set") == 1, shown
    assert "Creating" not in shown and "its last log lines" not in shown, shown
    row.locator("details summary").click()
    full = row.locator("details pre")
    assert full.is_visible()
    assert full.inner_text() == COMPOSE_FAILURE.strip()
    # Unfolded, it stays so across the page's self-refresh.
    page.evaluate("document.getElementById('main').dataset.old = 'yes'")
    page.wait_for_function("() => !document.getElementById('main').dataset.old",
                           timeout=15_000)
    assert row.locator("details").get_attribute("open") is not None
    assert row.locator("details pre").is_visible()

    page.goto(dashboard_fleet.base + "/applications/com-example-hello-world")
    run = " ".join(str(page.locator('table.runs tr[data-device="plant-a-edge"]')
                       .inner_text()).split())
    assert run.count("docker compose exited with 1") == 1 and "Creating" not in run, run
