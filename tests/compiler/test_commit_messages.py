"""Commit messages: rendered from the template exactly as Jinja's own `render` would."""

from __future__ import annotations

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler import messages
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


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_changes = st.lists(st.builds(Change, _text, _text, st.sampled_from(
    ["add", "update", "reconfigure", "remove"]), st.lists(_text, max_size=2).map(tuple)),
    max_size=3)


@settings(max_examples=150, deadline=None)
@given(devices=st.lists(_text, min_size=1, max_size=3), changes=_changes,
       values=st.lists(st.tuples(_text, _text, _text), min_size=1, max_size=3))
def test_filled_messages_equal_rendered_ones(devices: list[str], changes: list[Change],
                                              values: list[tuple[str, str, str]]) -> None:
    """Messages of one set of changes are filled in from one rendering: whatever the device
    ids and trailer values (markers' NUL, newlines, braces included), each equals what the
    template renders for it."""
    for device_id, (source, caps, inputs) in zip(devices, values * len(devices), strict=False):
        trailers = {"Fleet-Source": source, "Capabilities-Digest": caps,
                    "Inputs-Digest": inputs}
        expected = _template().render(device_id=device_id, changes=changes, trailers=trailers)
        assert commit_message(device_id, changes, trailers) == expected.rstrip("\n") + "\n"


@pytest.mark.parametrize("line", ["{{ device_id | upper }}", "{{ device_id[:3] }}",
                                  "{{ device_id | length }}",
                                  "{{ trailers['Inputs-Digest'] | replace('a', 'x') }}"])
def test_a_template_that_changes_the_values_is_rendered_for_each_message(
        monkeypatch: pytest.MonkeyPatch, line: str) -> None:
    """A template that transforms, cuts or measures the filled-in values cannot be filled
    in; every message is then rendered, so the text is still right."""
    template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(
        line + "\n{% for c in changes %}{{ c.file }}{% endfor %}\n"
        "{% for n, v in trailers.items() %}{{ n }}: {{ v }}\n{% endfor %}")
    monkeypatch.setattr(messages, "_template", lambda: template)
    monkeypatch.setattr(messages, "_globals", lambda: dict(template.globals))
    monkeypatch.setattr(messages, "_fills", {})
    changes = [Change("a.yaml", "a", "add", ())]
    for device_id in ["gw/child-1", "dev-22"]:
        expected = template.render(device_id=device_id, changes=changes, trailers=TRAILERS)
        assert commit_message(device_id, changes, TRAILERS) == expected.rstrip("\n") + "\n"
    assert list(messages._fills.values()) == [messages._NO_FILL]
