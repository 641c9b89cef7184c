"""write_atomically: the old content or the new one, the final mode from the start, and
nothing left behind when writing fails."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from margo.files import write_atomically


def test_replaces_with_the_mode_given_and_creates_the_folder(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "secret.env"
    write_atomically(target, "A=1\n", mode=0o600)
    assert target.read_text() == "A=1\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    write_atomically(target, b"A=2\n", mode=0o600)
    assert target.read_bytes() == b"A=2\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["secret.env"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")

    with pytest.raises(TypeError):  # not bytes: the write fails after the file was created
        write_atomically(target, object())  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
