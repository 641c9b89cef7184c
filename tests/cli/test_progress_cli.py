"""Progress bars (margo_cli.progress): drawn on stderr when it is a terminal, for long
enough work; never on a pipe, and never mixed into what stdout carries."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from kits.fleetkit import intent

from margo.canonical import canonical_yaml
from margo_cli import progress

ROOT = Path(__file__).resolve().parents[2]


def source_of(root: Path, intents: int) -> Path:
    deployments = root / "deployments"
    deployments.mkdir(parents=True)
    for index in range(intents):
        (deployments / f"i{index}.yaml").write_bytes(canonical_yaml(intent(f"i{index}")))
    return root


def run_with_terminal(*argv: str) -> tuple[int, str, str]:
    """`margo ARGV` with stderr on a pseudo-terminal: (exit code, stdout, the terminal)."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "margo_cli.main", *argv], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=secondary, text=True)
    os.close(secondary)
    out, _ = process.communicate(timeout=60)
    terminal = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the other side is closed and drained
            break
        if not chunk:
            break
        terminal += chunk
    os.close(main)
    return process.returncode, out, terminal.decode(errors="replace")


def test_secrets_check_draws_a_bar_on_a_terminal_only(tmp_path: Path) -> None:
    source = source_of(tmp_path / "source", 25)
    code, out, terminal = run_with_terminal("secrets", "check", "--source", str(source))
    assert code == 0 and out == f"{source}: 0 secret(s), all well-formed\n"
    assert "check:" in terminal and "/25 [" in terminal and "intent" in terminal
    piped = subprocess.run([sys.executable, "-m", "margo_cli.main", "secrets", "check",
                            "--source", str(source)], cwd=ROOT, capture_output=True,
                           text=True, check=False, timeout=60)
    assert piped.returncode == 0 and piped.stdout == out and piped.stderr == ""


def test_short_work_draws_no_bar(tmp_path: Path) -> None:
    source = source_of(tmp_path / "source", 3)
    code, _out, terminal = run_with_terminal("secrets", "check", "--source", str(source))
    assert code == 0 and "check:" not in terminal


def test_a_bar_keeps_the_lines_it_is_given_on_stdout(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What `margo conformance wfm` does: a bar of steps, each step's line printed."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with os.fdopen(secondary, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        for enabled in (True, False):
            with progress.bar(2, "conformance", enabled=enabled, unit="step") as steps:
                for line in ("PASS one", "FAIL two"):
                    steps.update()
                    steps.write(line)
        terminal.flush()
        drawn = os.read(main, 65536).decode()
    os.close(main)
    assert capsys.readouterr().out == "PASS one\nFAIL two\n" * 2
    assert drawn.count("conformance:") >= 1 and "/2 [" in drawn
