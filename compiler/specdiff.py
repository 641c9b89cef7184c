"""Is a changed deployment document a reconfiguration or an update?

A commit message says `reconfigure` when only parameter values changed and `update`
otherwise, and the device plans accordingly. The compiler writes canonical YAML, where every
key sits on its own line at a fixed indentation, so the members of `spec` can be compared as
text, without parsing: one intent's edit gives thousands of devices the same pair of spec
texts, which a memo then compares once.
"""

from __future__ import annotations

__all__ = ["classify", "spec_sections"]


def spec_sections(data: bytes) -> dict[bytes, bytes]:
    """The text of each `spec` member of a canonical deployment document.

    The members of `spec` are the lines indented by exactly two spaces inside the `spec:`
    block; only the text from the top-level ``spec:`` line on is split (the rest cannot be
    part of it).
    """
    found = 0 if data.startswith(b"spec:\n") else data.find(b"\nspec:\n") + 1
    if found == 0 and not data.startswith(b"spec:\n"):
        return {}
    lines = data[found:].split(b"\n")
    sections: dict[bytes, bytes] = {}
    name: bytes | None = None
    start, end = 0, len(lines)
    for index, line in enumerate(lines[1:], start=1):
        if not line.startswith(b" "):
            end = index
            break
        if line[2:3] != b" ":
            if name is not None:
                sections[name] = b"\n".join(lines[start:index])
            name, start = line[2:].split(b":", 1)[0], index
    if name is not None:
        sections[name] = b"\n".join(lines[start:end])
    return sections


def _spec_tail(data: bytes) -> bytes:
    """A canonical document from its top-level ``spec:`` line on (all `spec_sections`
    reads); empty without one."""
    if data.startswith(b"spec:\n"):
        return data
    found = data.find(b"\nspec:\n")
    return b"" if found < 0 else data[found + 1:]


def classify(old: bytes, new: bytes, memo: dict[tuple[bytes, bytes], str] | None = None,
             ) -> str:
    """`reconfigure` when only parameter values changed, `update` otherwise. With `memo`,
    each pair of spec texts is compared once."""
    if memo is None:
        return _classify_specs(_spec_tail(old), _spec_tail(new))
    key = (_spec_tail(old), _spec_tail(new))
    found = memo.get(key)
    if found is None:
        if len(memo) >= 10_000:
            memo.clear()
        found = memo[key] = _classify_specs(*key)
    return found


def _classify_specs(old: bytes, new: bytes) -> str:
    before, after = spec_sections(old), spec_sections(new)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    return "reconfigure" if before and after and changed == {b"parameters"} else "update"
