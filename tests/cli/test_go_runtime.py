"""A device whose driver loads the Helm engine runs with the Go runtime setting it needs
(`margo_cli.go_runtime`: GOGC=50, read only from the environment a process started with),
the same process, and an operator's own GOGC wins. Read from /proc/<pid>/environ of a real
`margo device run`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kits.gitbox import Box, git_box

from margo_cli import go_runtime

ROOT = Path(__file__).resolve().parents[2]


def started_environment(config: Path, env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The environment of a running `margo device run`, read until the test has seen enough."""
    process = subprocess.Popen(
        [sys.executable, "-m", "margo_cli.main", "device", "run", "--config", str(config),
         "--log-level", "error"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process.poll() is None:
            raw = Path(f"/proc/{process.pid}/environ").read_bytes()
            if raw:  # empty until the child has exec'd the interpreter
                yield dict(item.split("=", 1) for item in raw.decode().split("\0")
                           if "=" in item)
            time.sleep(0.05)
    finally:
        process.terminate()
        process.wait(timeout=30)


def without_gogc() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "GOGC"}


def test_an_engine_driver_device_runs_with_gogc_50(tmp_path: Path) -> None:
    box = git_box(tmp_path, Box, device="go-settings", model="M")
    seen = next((env for env in started_environment(box.config, without_gogc())
                 if "GOGC" in env), None)
    assert seen is not None and seen["GOGC"] == "50"


def test_an_operators_gogc_is_kept(tmp_path: Path) -> None:
    box = git_box(tmp_path, Box, device="go-own", model="M")
    readings = started_environment(box.config, {**without_gogc(), "GOGC": "200"})
    assert [env["GOGC"] for _, env in zip(range(20), readings, strict=False)] == ["200"] * 20


def test_a_compose_device_is_not_restarted(tmp_path: Path) -> None:
    box = git_box(tmp_path, Box, device="go-none", model="M")
    settings = yaml.safe_load(box.config.read_text())
    settings["driver"] = {"type": "compose"}
    box.config.write_text(yaml.safe_dump(settings))
    readings = started_environment(box.config, without_gogc())
    assert all("GOGC" not in env for _, env in zip(range(20), readings, strict=False))


def test_a_process_that_only_calls_the_command_is_never_replaced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A test runner (this one) calling the command's function keeps its own process."""
    monkeypatch.delenv("GOGC", raising=False)

    def replaced(*_args: object) -> None:
        raise AssertionError("os.execve called outside the margo program")

    monkeypatch.setattr(go_runtime.os, "execve", replaced)
    go_runtime.restart_with_engine_settings("render")
