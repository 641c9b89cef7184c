"""`margo.identifiers`: every name a family accepts is usable where it goes.

Property-based: whatever text is offered, a family either refuses it (with a reason, never
an exception) or the name is a valid Git ref component / file name / URL segment, checked
against Git itself (``git check-ref-format``, libgit2, a stock clone) and not only against
our own statement of its rules.
"""

from __future__ import annotations

import subprocess
import urllib.parse
from pathlib import Path

import pygit2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.gitstore import DEVICE_ID_PATTERN, DeviceCommit, DeviceStore, device_ref
from margo.identifiers import (
    CLIENT_ID,
    DEPLOYMENT_ID,
    DEVICE_ID,
    DNS_LABEL,
    LABEL_KEY,
    MAX_REF_COMPONENT,
    IdentifierError,
    branch_component,
    file_name_problem,
    label_value_problem,
    ref_component_problem,
)

#: Texts near every rule: anything at all, the standard's syntax at any length, runs of the
#: characters that are encoded (three bytes each), and the characters Git cares about.
TEXTS = st.one_of(
    st.text(),
    st.from_regex(rf"\A{DEVICE_ID_PATTERN}\Z", fullmatch=True),
    st.builds(lambda unit, n: unit * n,
              st.sampled_from(["a", "~", ".", "a/", "~a", "a.", "-", "ab.lock"]),
              st.integers(0, 400)),
    st.text(alphabet=st.sampled_from("aZ9._~-/%@{}:?*[\\^ \t\n\x00é"), max_size=300),
)

FAMILIES = [DEVICE_ID, DEPLOYMENT_ID, CLIENT_ID, DNS_LABEL, LABEL_KEY]


def git_accepts(ref: str) -> bool:
    return subprocess.run(["git", "check-ref-format", ref], capture_output=True,
                          check=False).returncode == 0


@settings(max_examples=400, deadline=None)
@given(TEXTS)
def test_an_accepted_device_id_names_a_branch_git_accepts(text: str) -> None:
    problem = DEVICE_ID.problem(text)
    if problem is not None:
        assert isinstance(problem, str) and problem
        with pytest.raises(IdentifierError):
            DEVICE_ID.check(text)
        return
    component = branch_component(text)
    assert ref_component_problem(component) is None
    assert file_name_problem(component + ".lock") is None  # a loose ref's lock file
    ref = device_ref(text)
    assert ref == "refs/heads/devices/" + component
    assert pygit2.reference_is_valid_name(ref)
    assert git_accepts(ref)
    assert urllib.parse.quote(text, safe="/") == text  # a URL path as it is


@settings(max_examples=300, deadline=None)
@given(TEXTS, st.sampled_from(FAMILIES))
def test_every_family_refuses_or_gives_a_ref_component_and_a_file_name(
        text: str, family: object) -> None:
    assert isinstance(family, type(DEVICE_ID))
    problem = family.problem(text)
    if problem is not None:
        assert isinstance(problem, str)
        return
    assert len(text) <= family.max_length
    if family in (DEPLOYMENT_ID, CLIENT_ID, DNS_LABEL):  # used as they are
        assert urllib.parse.quote(text, safe="") == text  # one URL path segment
        assert file_name_problem(text + ".yaml") is None
    if family is DNS_LABEL:
        assert ref_component_problem(text, branch_start=True) is None
        assert git_accepts(f"refs/heads/{text}")
        assert subprocess.run(["git", "check-ref-format", "--branch", text],
                              capture_output=True, check=False).returncode == 0
    if family is LABEL_KEY:
        prefix, _, name = text.rpartition("/")
        assert len(prefix) <= 253 and 1 <= len(name) <= 63


@given(st.one_of(st.none(), st.integers(), st.lists(st.text()), st.binary()),
       st.sampled_from(FAMILIES))
def test_non_strings_are_refused_with_a_reason(value: object, family: object) -> None:
    assert isinstance(family, type(DEVICE_ID))
    assert "must be a string" in (family.problem(value) or "")


@settings(max_examples=200, deadline=None)
@given(TEXTS)
def test_ref_component_rules_agree_with_git(text: str) -> None:
    """Our statement of Git's rules never accepts what Git refuses."""
    if ref_component_problem(text) is None:
        assert git_accepts(f"refs/heads/{text}")


@pytest.mark.parametrize(("value", "valid"), [
    ("northstarida.xtapro.k8s.edge", True), ("fc6a5159-3b3f-4140-8092-25992e18f959", True),
    ("gateway-01/child-7", True), ("wfm-core-device", True), ("x~1", True),
    ("a" * 250, True), ("a" * 251, False), ("a" * 1005, False), ("~" * 340, False),
    ("~" * 83, True), ("~" * 84, False), ("", False), ("a b", False), ("é", False),
    ("a//b", False), ("/a", False),
])
def test_device_id_examples(value: str, valid: bool) -> None:
    assert DEVICE_ID.is_valid(value) is valid


@pytest.mark.parametrize(("key", "valid"), [
    ("example.com/site", True), ("k8s.margo-gitops.dev/nodes", True), ("site", True),
    ("node-role.kubernetes.io/control-plane", True), ("feature.node.kubernetes.io/cpu-x.Y", True),
    ("Site Name", False), ("", False), ("/x", False), ("Example.com/x", False),
    ("a" * 63, True), ("a" * 64, False), ("x" * 253 + "/y", True), ("x" * 254 + "/y", False),
])
def test_label_key_examples(key: str, valid: bool) -> None:
    assert LABEL_KEY.is_valid(key) is valid


def test_label_values_are_bounded() -> None:
    assert label_value_problem("plant-a") is None and label_value_problem(3) is None
    assert label_value_problem(["x", "y"]) is None
    assert label_value_problem("x" * 1025) is not None
    assert label_value_problem("a\nb") is not None
    assert label_value_problem(["x"] * 257) is not None


def test_the_longest_accepted_ids_round_trip_through_the_store_and_a_stock_clone(
        tmp_path: Path) -> None:
    """At the bound, a branch is written, listed, read back, and cloned by stock Git (which
    writes it as a loose ref: a file named after the component, plus its ``.lock``)."""
    longest = ["a" * 250, "~" * 83, "gw/" + "b" * 245, ".x" + "." * 80]
    assert all(DEVICE_ID.is_valid(d) for d in longest)
    assert all(len(branch_component(d)) <= MAX_REF_COMPONENT for d in longest)
    store = DeviceStore(tmp_path / "repos")
    with store.lock():
        store.write([DeviceCommit(d, {"a.yaml": b"x: 1\n"}, "m\n", 1_760_000_000)
                     for d in longest])
    assert store.device_ids() == sorted(longest)
    for index, device_id in enumerate(longest):
        assert store.read_files(device_id) == {"a.yaml": b"x: 1\n"}
        branch = device_ref(device_id).removeprefix("refs/heads/")
        clone = tmp_path / f"clone-{index}"
        subprocess.run(["git", "clone", "-q", "--branch", branch, str(store.path), str(clone)],
                       check=True, capture_output=True)
        assert (clone / "a.yaml").read_bytes() == b"x: 1\n"
