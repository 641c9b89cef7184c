"""SemVer revisions written as OCI tags (`_` for build metadata)."""

from __future__ import annotations

import pytest

from margo.revisions import parse_revision, revision_problem


@pytest.mark.parametrize("text", ["1.0.0", "0.1.2", "1.0.0-rc.1", "1.2.3-alpha.1_build.7",
                                  "10.20.30_sha.5114f85"])
def test_valid_revisions(text: str) -> None:
    assert revision_problem(text) is None
    assert parse_revision(text).tag == text


@pytest.mark.parametrize(
    ("text", "reason"),
    [("v1.0.0", "no leading 'v'"), ("1.0", "SemVer 2.0"), ("01.0.0", "SemVer 2.0"),
     ("1.0.0+build.1", "instead of '+'"), ("1.0.0-", "SemVer 2.0"), ("", "SemVer 2.0")],
)
def test_invalid_revisions_explain_why(text: str, reason: str) -> None:
    problem = revision_problem(text)
    assert problem is not None and reason in problem


def test_precedence_follows_semver() -> None:
    ordered = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2",
               "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0", "1.0.1", "1.1.0", "2.0.0"]
    revisions = [parse_revision(t) for t in ordered]
    assert sorted(reversed(revisions)) == revisions
    assert parse_revision("1.0.0_b1") == parse_revision("1.0.0_b1")
    assert parse_revision("1.0.0_b1").semver == "1.0.0+b1"
    assert parse_revision("1.0.0+b1", allow_plus=True).tag == "1.0.0_b1"
