"""A value that is valid but for a final newline is invalid, everywhere: Python's `$` also
matches before a final newline, JSON Schema's (ECMA-262) does not."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from fastjsonschema import JsonSchemaException

import compiler.intents
import margo.schemas
import margo.validation
from compiler.intents import load_intent
from margo.canonical import canonical_yaml
from margo.digests import DigestError, parse_digest
from margo.errors import DocumentError
from margo.loading import load_document
from margo.revisions import parse_revision
from margo.schemas import python_patterns, shown_pattern
from margo.spiffe import SpiffeIdError, parse_spiffe_id
from margo.validation import gate_problems, validate_document

APP = (Path(__file__).resolve().parents[2] / "examples" / "fleet" / "apps"
       / "com-example-gpu-inference" / "margo.yaml").read_text()

INTENT = {"apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
          "metadata": {"name": "demo"},
          "spec": {"application": {"id": "com-example-app"}, "namespace": "demo",
                   "targets": {"devices": ["a"]}}}


def test_python_patterns_anchor_at_the_end_only() -> None:
    schema = python_patterns({"pattern": "^[a-z]+$", "patternProperties": {"^x-$": {}},
                              "items": [{"pattern": r"^a\$b$"}]})
    assert schema == {"pattern": r"^[a-z]+\Z", "patternProperties": {r"^x-\Z": {}},
                      "items": [{"pattern": r"^a\$b\Z"}]}
    assert shown_pattern(schema["pattern"]) == "^[a-z]+$"


def test_an_application_id_with_a_final_newline_is_a_located_problem() -> None:
    valid = validate_document(APP.encode(), file="margo.yaml")
    assert valid.valid, [p.format() for p in valid.problems]
    report = validate_document(APP.replace("id: com-example-gpu-inference",
                                           'id: "com-example-gpu-inference\\n"', 1)
                               .encode(), file="margo.yaml")
    assert not report.valid
    [problem] = report.problems
    assert problem.path == ("id",) and problem.line == 3
    assert "an id of lower-case letters" in problem.message


def test_an_intent_namespace_with_a_final_newline_is_refused() -> None:
    load_intent(load_document(canonical_yaml(INTENT)), expected_name="demo")
    bad = copy.deepcopy(INTENT)
    bad["spec"]["namespace"] = "demo\n"
    with pytest.raises(DocumentError) as failure:
        load_intent(load_document(canonical_yaml(bad)), expected_name="demo")
    [problem] = failure.value.problems
    assert problem.path == ("spec", "namespace")
    assert "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" in problem.message


def test_a_gate_refusal_the_explainer_misses_still_refuses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the two validators ever disagree again, the document is refused with the
    gate's own words, not let through because the explanation came back empty (in a
    process that validates in bulk, where the gate decides first)."""
    monkeypatch.setattr(margo.schemas, "_hot", set(margo.schemas.KINDS_AND_SHAPES))
    for module in (margo.validation, compiler.intents):
        monkeypatch.setattr(module, "explain_schema_errors", lambda validator, instance: [])
    report = validate_document(APP.replace("          revision: 0.4.1\n",
                                           "          revision: 0.4.1\n          bogus: 1\n")
                               .encode(), file="margo.yaml")
    assert not report.valid
    [problem] = report.problems
    assert problem.path == ("deploymentProfiles", 0, "components", 0, "properties")
    assert problem.message.startswith("invalid: ") and "bogus" in problem.message
    bad = copy.deepcopy(INTENT)
    bad["spec"]["namespace"] = "Not A Label"
    with pytest.raises(DocumentError) as failure:
        load_intent(load_document(canonical_yaml(bad)), expected_name="demo")
    assert [p.path for p in failure.value.problems] == [("spec", "namespace")]


def test_gate_problems_reads_fastjsonschema_paths() -> None:
    refusal = JsonSchemaException("data.a[1] must be string")
    refusal.path = ["data", "a", "1"]  # type: ignore[attr-defined]
    [(problem, at_key)] = gate_problems(refusal, {"a": [1, 2]})
    assert problem.path == ("a", 1) and not at_key
    assert "must be string" in problem.message


@pytest.mark.parametrize(("parse", "good", "error"), [
    (parse_digest, "sha256:" + "0" * 64, DigestError),
    (parse_spiffe_id, "spiffe://example.org/client/a", SpiffeIdError),
    (parse_revision, "1.2.3", ValueError),
])
def test_parsers_refuse_a_final_newline(parse: Any, good: str, error: type[Exception]) -> None:
    parse(good)
    with pytest.raises(error):
        parse(good + "\n")
