"""Moving refs by splicing them into the ``packed-refs`` this process last wrote
(`compiler.packedrefs._merged`): the same bytes as checking, parsing and rendering the whole
file again, whatever is added, moved or deleted, and the full rewrite whenever the file is
not the one written last."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler import packedrefs
from compiler.packedrefs import RefMovedError, move_refs

_HEADER = b"# pack-refs with: peeled fully-peeled sorted \n"
#: Names whose byte order is not their order as path components, and prefixes of others.
_NAMES = ["refs/heads/a", "refs/heads/a-b", "refs/heads/a/b", "refs/heads/ab", "refs/heads/b",
          "refs/heads/devices/x", "refs/heads/devices/x0", "refs/heads/devices/\u00e9",
          "refs/tags/t", "refs/tags/u", "refs/zz"]
_OIDS = [f"{i:040x}" for i in range(1, 6)]


def _oid(n: int) -> str:
    return _OIDS[n % len(_OIDS)]


def _write_packed(git_dir: Path, refs: dict[str, int], peeled: set[str]) -> None:
    """A packed-refs file as Git writes it, some refs with a peel line, written in place by
    someone else than `move_refs`."""
    lines = [_HEADER]
    for name in sorted(refs):
        lines.append(f"{_oid(refs[name])} {name}\n".encode())
        if name in peeled:
            lines.append(f"^{_oid(refs[name] + 1)}\n".encode())
    (git_dir / "packed-refs").write_bytes(b"".join(lines))


def _current(git_dir: Path) -> dict[str, str]:
    lines = (git_dir / "packed-refs").read_bytes().decode().splitlines()
    return dict(reversed(line.split(" ")) for line in lines if line[:1] not in "#^")


_UPDATES = st.dictionaries(st.sampled_from(_NAMES), st.one_of(st.none(), st.integers(0, 4)),
                           max_size=len(_NAMES))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(_NAMES), st.integers(0, 4)),
       st.sets(st.sampled_from(_NAMES)), st.lists(_UPDATES, min_size=1, max_size=4))
def test_splicing_gives_the_bytes_of_a_full_rewrite(initial: dict[str, int], peeled: set[str],
                                                    rounds: list[dict[str, int | None]],
                                                    ) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        git_dir = Path(scratch)
        _write_packed(git_dir, initial, peeled)
        move_refs(git_dir, {"refs/heads/first": (None, _OIDS[0])})  # now the file is ours
        for moves in rounds:
            before = _current(git_dir)
            updates = {name: (before.get(name), None if n is None else _oid(n))
                       for name, n in moves.items()}
            identity, data = packedrefs._read(git_dir / "packed-refs")
            merged = packedrefs._merged(git_dir / "packed-refs", identity, data, updates)
            assert merged == packedrefs._rewritten(git_dir / "packed-refs", data, updates)
            move_refs(git_dir, updates)
            assert (git_dir / "packed-refs").read_bytes() == merged[0]
            assert packedrefs.ref_names(git_dir) == frozenset(_current(git_dir))


@pytest.mark.parametrize("updates", [
    {"refs/heads/b": (_OIDS[2], _OIDS[3])},  # not where the caller thinks
    {"refs/heads/b": (None, _OIDS[3])},  # exists already
    {"refs/heads/c": (_OIDS[1], _OIDS[3])},  # does not exist
    {"refs/heads/c": (None, _OIDS[3]), "refs/heads/a": (_OIDS[3], None)},  # one of two
])
def test_a_spliced_move_checks_every_ref_and_changes_nothing_if_one_moved(
        tmp_path: Path, updates: dict[str, tuple[str | None, str | None]]) -> None:
    move_refs(tmp_path, {"refs/heads/a": (None, _OIDS[0]), "refs/heads/b": (None, _OIDS[1])})
    before = (tmp_path / "packed-refs").read_bytes()
    with pytest.raises(RefMovedError):
        move_refs(tmp_path, updates)
    assert (tmp_path / "packed-refs").read_bytes() == before


def test_a_file_replaced_by_someone_else_is_read_in_full(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         ) -> None:
    """After another writer's rename (a new identity), nothing remembered is trusted: the
    file is checked and parsed again, and a ref only that writer added is kept."""
    move_refs(tmp_path, {"refs/heads/a": (None, _OIDS[0])})
    replacement = tmp_path / "other"
    replacement.write_bytes(_HEADER + f"{_OIDS[1]} refs/heads/a\n{_OIDS[2]} refs/heads/z\n"
                            .encode())
    os.replace(replacement, tmp_path / "packed-refs")
    spliced: list[object] = []
    original = packedrefs._merged

    def spy(*args: object) -> bytes | None:
        spliced.append(result := original(*args))  # type: ignore[arg-type]
        return result

    monkeypatch.setattr(packedrefs, "_merged", spy)
    with pytest.raises(RefMovedError):  # it is not where this process left it
        move_refs(tmp_path, {"refs/heads/a": (_OIDS[0], _OIDS[3])})
    move_refs(tmp_path, {"refs/heads/a": (_OIDS[1], _OIDS[3])})
    assert spliced == [None, None]
    assert _current(tmp_path) == {"refs/heads/a": _OIDS[3], "refs/heads/z": _OIDS[2]}
    move_refs(tmp_path, {"refs/heads/m": (None, _OIDS[4])})  # its own file: spliced
    assert spliced[-1] is not None
    assert _current(tmp_path) == {"refs/heads/a": _OIDS[3], "refs/heads/m": _OIDS[4],
                                  "refs/heads/z": _OIDS[2]}


def test_a_file_rewritten_in_place_to_a_bad_one_is_refused(tmp_path: Path) -> None:
    """Rewritten in place (same inode, other size): checked again, and refused."""
    move_refs(tmp_path, {"refs/heads/a": (None, _OIDS[0])})
    with open(tmp_path / "packed-refs", "ab") as handle:
        handle.write(b"not a ref line\n")
    with pytest.raises(packedrefs.PackedRefsError):
        move_refs(tmp_path, {"refs/heads/b": (None, _OIDS[1])})


@pytest.mark.parametrize("updates", [
    {"refs/heads/a": (None, _OIDS[0][:39])},
    {"refs/heads/a": (None, f"{0xabc:040X}")},
    {"refs/heads/a": (None, f"{_OIDS[0]}\n{_OIDS[1]}")},  # two ids as one
    {"refs/heads/a": (None, _OIDS[0][:39] + "\u00e9")},
    {"refs/heads/a": (None, 12)},
    {"refs/heads/a": (None, _OIDS[0]), "heads/b": (None, _OIDS[1])},
    {"refs/heads/a": (None, _OIDS[0]), "refs/heads/b c": (None, _OIDS[1])},
    {"refs/heads/a\n": (None, _OIDS[0])},
])
def test_every_update_is_checked_before_anything_is_read(
        tmp_path: Path, updates: dict[str, tuple[str | None, str | None]]) -> None:
    move_refs(tmp_path, {"refs/heads/x": (None, _OIDS[0])})
    before = (tmp_path / "packed-refs").read_bytes()
    with pytest.raises(packedrefs.PackedRefsError, match="not a"):
        move_refs(tmp_path, updates)
    assert (tmp_path / "packed-refs").read_bytes() == before


def test_a_ref_name_not_in_utf8_is_kept_and_nothing_is_remembered(tmp_path: Path) -> None:
    """Another writer's ref whose name is not UTF-8 stays as it is through every move (the
    moves read the whole file each time, remembering no names)."""
    odd = b"refs/heads/\xff"
    (tmp_path / "packed-refs").write_bytes(_HEADER + _OIDS[0].encode() + b" " + odd + b"\n")
    move_refs(tmp_path, {"refs/heads/a": (None, _OIDS[1])})
    move_refs(tmp_path, {"refs/heads/a": (_OIDS[1], _OIDS[2]), "refs/heads/b": (None, _OIDS[3])})
    assert (tmp_path / "packed-refs").read_bytes() == (
        _HEADER + f"{_OIDS[2]} refs/heads/a\n{_OIDS[3]} refs/heads/b\n".encode()
        + _OIDS[0].encode() + b" " + odd + b"\n")


def test_a_ref_the_remembered_names_lack_is_never_added_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the remembered names ever lack a ref the file holds (another writer's file
    with the same identity), the move falls back to reading the file in full, which sees
    the ref: it is not where the caller expected it."""
    move_refs(tmp_path, {"refs/heads/a": (None, _OIDS[0]), "refs/heads/b": (None, _OIDS[1])})
    path = tmp_path / "packed-refs"
    with open(path, "rb") as handle:
        identity = packedrefs._identity(handle.fileno())
    monkeypatch.setattr(packedrefs._PACKED_NAMES, "get",
                        lambda *_: frozenset({"refs/heads/a"}))
    assert packedrefs._merged(path, identity, path.read_bytes(),
                              {"refs/heads/b": (None, _OIDS[2])}) is None
    with pytest.raises(RefMovedError):
        move_refs(tmp_path, {"refs/heads/b": (None, _OIDS[2])})
