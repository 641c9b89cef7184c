"""Shared fixtures: paths to the official spec examples and our example fleet."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SPEC_EXAMPLES = FIXTURES / "spec-examples"


@pytest.fixture
def spec_examples() -> Path:
    return SPEC_EXAMPLES
