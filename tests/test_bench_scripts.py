"""Every benchmark in bench/ still starts as `make bench` runs it (`python -m bench.<name>`
from the repository's root): its imports resolve and its options parse. The figures
themselves are measured by `make bench`, never here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text())  # not benchkit.py


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_benchmark_starts(script: Path) -> None:
    done = subprocess.run([sys.executable, "-m", f"bench.{script.stem}", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
