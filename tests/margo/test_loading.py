"""Safe loading: YAML 1.2 core typing, located errors, hostile input rejected fast."""

from __future__ import annotations

import pytest

from margo.errors import DocumentError
from margo.loading import Limits, load_document


def load_error(data: bytes, **kw) -> str:
    with pytest.raises(DocumentError) as info:
        load_document(data, file="doc.yaml", **kw)
    assert len(info.value.problems) == 1
    return info.value.problems[0].format()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a: yes", "yes"),
        ("a: on", "on"),
        ("a: 012", 12),
        ("a: 0o17", 15),
        ("a: 0x1F", 31),
        ("a: 1.5", 1.5),
        ("a: 1e3", 1000.0),
        ("a: 2024-01-01", "2024-01-01"),
        ("a: ~", None),
        ("a:", None),
        ("a: True", True),
        ("a: 'true'", "true"),
        ("a: !!str 12", "12"),
        ("a: 1.2.1", "1.2.1"),
    ],
    ids=lambda v: str(v),
)
def test_scalars_follow_the_yaml_1_2_core_schema(text: str, expected: object) -> None:
    value = load_document(text.encode()).value["a"]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"a: 1\nb: 2\na: 3\n", "doc.yaml:3:1: $.a: duplicate key 'a'"),
        (b'{"a": 1, "a": 2}', "$.a: duplicate key 'a'"),
        (b"a: [1, 2\n", "doc.yaml:2:1: $: invalid YAML"),
        (b'{"a": 1,\n "b": }', "doc.yaml:2:7: $: invalid JSON"),
        (b"a: \xff\n", "doc.yaml:1:4: $: not valid UTF-8"),
        (b"a: !!python/object:os.system x\n", "doc.yaml:1:4: $.a: unsupported YAML tag"),
        (b"a: .nan\n", "not a finite number"),
        (b'{"a": NaN}', "not a finite number"),
        (b"a: &x {b: 1}\nc:\n  <<: *x\n", "doc.yaml:3:3: $.c: YAML merge keys"),
        (b"a: 1\n---\nb: 2\n", "expected exactly one document, found 2 documents"),
        (b"", "expected exactly one document, found no document"),
        (b"? [a, b]\n: c\n", "mapping keys must be plain strings"),
        (b"a: *nope\n", "doc.yaml:1:4: $.a: unknown alias *nope"),
        (b"a: b\x00c", "NUL character"),
    ],
    ids=["dup-yaml", "dup-json", "unclosed", "bad-json", "utf8", "python-tag", "nan", "json-nan",
         "merge-key", "two-docs", "empty", "complex-key", "unknown-alias", "nul"],
)
def test_bad_input_is_a_located_problem(data: bytes, fragment: str) -> None:
    assert fragment in load_error(data)


def test_alias_bomb_is_rejected_quickly() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    message = load_error("\n".join(lines).encode())
    assert "aliases expand to more than 100000 nodes" in message


def test_small_aliases_are_expanded_into_independent_copies() -> None:
    doc = load_document(b"a: &x {b: [1, 2]}\nc: *x\n").value
    assert doc["c"] == {"b": [1, 2]}
    assert doc["c"] is not doc["a"]


@pytest.mark.parametrize("data", [b"[" * 50_000 + b"]" * 50_000, b"a: " + b"[" * 500 + b"]" * 500,
                                  b"".join(b"  " * i + b"k:\n" for i in range(300))],
                         ids=["json", "flow-yaml", "block-yaml"])
def test_deep_nesting_is_rejected(data: bytes) -> None:
    assert "nesting deeper than 100 levels" in load_error(data)


def test_oversized_documents_are_rejected_before_parsing() -> None:
    data = b"a: [" + b"1," * 3_000_000 + b"1]"
    assert "the limit is 4194304" in load_error(data)
    assert "the limit is 10" in load_error(b"a: 123456789", limits=Limits(max_bytes=10))


def test_multi_megabyte_documents_within_the_limit_load() -> None:
    data = b"items:\n" + b"".join(b"- name: item-%d\n  value: %d\n" % (i, i) for i in range(60_000))
    assert len(data) > 1_000_000
    assert len(load_document(data).value["items"]) == 60_000


def test_positions_point_at_values_and_keys() -> None:
    doc = load_document(b"metadata:\n  name: x\n  labels:\n    - a\n    - b\n", file="f.yaml")
    assert doc.source.value_position(("metadata", "labels", 1)) == (5, 7)
    assert doc.source.key_position(("metadata", "name")) == (2, 3)
    assert doc.source.value_position(("metadata", "missing", 3)) == (2, 3)


def test_json_positions_are_found_lazily() -> None:
    doc = load_document(b'{\n  "a": {\n    "b": [1, 2]\n  }\n}\n')
    assert doc.source.value_position(("a", "b", 1)) == (3, 14)


def test_bom_is_tolerated() -> None:
    assert load_document(b"\xef\xbb\xbfa: 1\n").value == {"a": 1}
