"""Commit messages: rendered from the template exactly as Jinja's own `render` would."""

from __future__ import annotations

import pytest

from compiler.messages import Change, _template, commit_message

TRAILERS = {"Fleet-Source": "0123abc", "Capabilities-Digest": "sha256:" + "a" * 64,
            "Inputs-Digest": "sha256:" + "b" * 64}


@pytest.mark.parametrize("changes", [
    [],
    [Change("a.yaml", "a", "add", ("intent added",))],
    [Change("a.yaml", "a", "reconfigure", ("intent edited", "capabilities changed")),
     Change("b.yaml", "b", "remove", ("device no longer eligible: needs 4Gi, has 2Gi",)),
     Change("c.yaml", "c", "update", ())],
    [Change("ü.yaml", "ü", "update", ("{{ not a template }} {% neither %}",))],
])
def test_messages_are_what_the_template_renders(changes: list[Change]) -> None:
    expected = _template().render(device_id="gw/child-1", changes=changes, trailers=TRAILERS)
    assert commit_message("gw/child-1", changes, TRAILERS) == expected.rstrip("\n") + "\n"


def test_a_message_names_the_device_what_changed_and_the_inputs() -> None:
    text = commit_message("dev-1", [Change("a.yaml", "a", "add", ("intent added",))],
                          TRAILERS)
    assert text.splitlines()[0] == "dev-1: add a"
    assert "- a.yaml: add (intent added)" in text
    assert text.endswith("Inputs-Digest: sha256:" + "b" * 64 + "\n")
