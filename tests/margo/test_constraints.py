"""deviceConstraints / requiredResources matching: every operator, every compile error, and
every failing clause explained."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from margo.constraints import (
    CompiledConstraints,
    Failure,
    MatchResult,
    compile_constraints,
    match,
    parse_pointer,
)
from margo.errors import DocumentError

GI = 1024**3

# The spec's newest capabilities example (rc.3 prose), as the baseline device.
SPEC_DEVICE: dict[str, Any] = {
    "id": "northstarida.xtapro.k8s.edge",
    "vendor": "Northstar Industrial Devices",
    "modelNumber": "332ANZE1-N1",
    "serialNumber": "PF45343-AA",
    "cpus": [{"cores": 24, "architecture": "amd64"}],
    "memory": "59 Gi",
    "storage": "1862 Gi",
    "peripherals": [{"type": "gpu", "manufacturer": "NVIDIA"}],
    "interfaces": [{"type": "ethernet"}, {"type": "wifi"}],
    "otelCollector": True,
    "supportedRuntimes": ["oci"],
    "supportedDeploymentTypes": ["helm", "compose"],
}

GPU_EXPRESSION: dict[str, Any] = {
    "key": "/peripherals",
    "operator": "ContainsAll",
    "itemSelector": {
        "matchExpressions": [
            {"key": "/type", "operator": "In", "values": ["gpu"]},
            {"key": "/manufacturer", "operator": "In", "values": ["NVIDIA"]},
        ]
    },
}


def expr(key: str, operator: str, values: list[Any] | None = None,
         items: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A matchExpression document."""
    out: dict[str, Any] = {"key": key, "operator": operator}
    if values is not None:
        out["values"] = values
    if items is not None:
        out["itemSelector"] = {"matchExpressions": items}
    return out


def rule(props: list[dict[str, Any]] | None = None,
         labels: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if props is not None:
        out["propertySelector"] = {"matchExpressions": props}
    if labels is not None:
        out["labelSelector"] = {"matchExpressions": labels}
    return out


def rules(*items: dict[str, Any]) -> dict[str, Any]:
    return {"eligibilityRules": list(items)}


# --------------------------------------------------------------------------- operators

OBJECTS = [
    {"type": "gpu", "manufacturer": "AMD"},
    {"type": "camera", "manufacturer": "NVIDIA"},
    {"type": "gpu", "manufacturer": "NVIDIA", "model": "A2"},
]
ONLY_SPLIT_OBJECTS = OBJECTS[:2]  # each element satisfies one item expression, none both
GPU_ITEMS = GPU_EXPRESSION["itemSelector"]["matchExpressions"]

PROPERTY_CASES = [
    # In
    ("in-string-match", expr("/v", "In", ["Acme", "Other"]), {"v": "Acme"}, True),
    ("in-string-no-match", expr("/v", "In", ["Acme"]), {"v": "Other"}, False),
    ("in-case-sensitive", expr("/v", "In", ["Acme"]), {"v": "acme"}, False),
    ("in-number-int", expr("/v", "In", [1, 2]), {"v": 2}, True),
    ("in-number-int-float-mix", expr("/v", "In", [2.0]), {"v": 2}, True),
    ("in-number-float", expr("/v", "In", [1.5, 3]), {"v": 1.5}, True),
    ("in-string-vs-number", expr("/v", "In", [1]), {"v": "1"}, False),
    ("in-number-vs-string", expr("/v", "In", ["1"]), {"v": 1}, False),
    ("in-bool-vs-number", expr("/v", "In", [1]), {"v": True}, False),
    ("in-number-vs-bool", expr("/v", "In", [True]), {"v": 1}, False),
    ("in-bool-match", expr("/v", "In", [True]), {"v": True}, True),
    ("in-bool-false-match", expr("/v", "In", [False]), {"v": False}, True),
    ("in-bool-no-match", expr("/v", "In", [True]), {"v": False}, False),
    ("in-bool-vs-string", expr("/v", "In", [True]), {"v": "true"}, False),
    ("in-missing", expr("/v", "In", ["Acme"]), {}, False),
    ("in-null", expr("/v", "In", ["Acme"]), {"v": None}, False),
    ("in-array-actual", expr("/v", "In", ["Acme"]), {"v": ["Acme"]}, False),
    ("in-object-actual", expr("/v", "In", ["Acme"]), {"v": {"Acme": 1}}, False),
    ("in-nested-pointer", expr("/cpus/0/architecture", "In", ["amd64"]), SPEC_DEVICE, True),
    ("in-index-out-of-range", expr("/cpus/1/architecture", "In", ["amd64"]), SPEC_DEVICE,
     False),
    ("in-index-into-object", expr("/a/0", "In", ["x"]), {"a": {"0": "x"}}, True),
    ("in-leading-zero-index", expr("/a/01", "In", ["x"]), {"a": ["y", "x"]}, False),
    ("in-dash-index", expr("/a/-", "In", ["x"]), {"a": ["x"]}, False),
    ("in-through-scalar", expr("/v/w", "In", ["x"]), {"v": "x"}, False),
    ("in-escaped-slash", expr("/a~1b", "In", ["x"]), {"a/b": "x"}, True),
    ("in-escaped-tilde", expr("/m~0n", "In", ["x"]), {"m~n": "x"}, True),
    ("in-empty-token", expr("/", "In", ["x"]), {"": "x"}, True),
    ("in-whole-document", expr("", "In", ["x"]), {"v": "x"}, False),
    # NotIn
    ("notin-absent-value", expr("/v", "NotIn", ["Acme"]), {"v": "Other"}, True),
    ("notin-present-value", expr("/v", "NotIn", ["Acme", "Other"]), {"v": "Other"}, False),
    ("notin-missing", expr("/v", "NotIn", ["Acme"]), {}, False),
    ("notin-null", expr("/v", "NotIn", ["Acme"]), {"v": None}, False),
    ("notin-array", expr("/v", "NotIn", ["Acme"]), {"v": ["Other"]}, False),
    ("notin-object", expr("/v", "NotIn", ["Acme"]), {"v": {}}, False),
    ("notin-string-vs-number", expr("/v", "NotIn", [1]), {"v": "1"}, True),
    ("notin-bool-vs-number", expr("/v", "NotIn", [1]), {"v": True}, True),
    ("notin-number-match", expr("/v", "NotIn", [1.0]), {"v": 1}, False),
    ("notin-bool-match", expr("/v", "NotIn", [False]), {"v": False}, False),
    # Exists / DoesNotExist
    ("exists-present", expr("/v", "Exists"), {"v": "x"}, True),
    ("exists-null-is-present", expr("/v", "Exists"), {"v": None}, True),
    ("exists-false-is-present", expr("/v", "Exists"), {"v": False}, True),
    ("exists-missing", expr("/v", "Exists"), {}, False),
    ("exists-nested-missing", expr("/v/w", "Exists"), {"v": {}}, False),
    ("exists-array-element", expr("/cpus/0", "Exists"), SPEC_DEVICE, True),
    ("doesnotexist-missing", expr("/v", "DoesNotExist"), {}, True),
    ("doesnotexist-null", expr("/v", "DoesNotExist"), {"v": None}, False),
    ("doesnotexist-present", expr("/v", "DoesNotExist"), {"v": 0}, False),
    # Gt / Lt
    ("gt-greater", expr("/v", "Gt", [3]), {"v": 5}, True),
    ("gt-equal", expr("/v", "Gt", [5]), {"v": 5}, False),
    ("gt-smaller", expr("/v", "Gt", [5]), {"v": 4.5}, False),
    ("gt-float-bound", expr("/v", "Gt", [1.5]), {"v": 2}, True),
    ("gt-string-number", expr("/v", "Gt", [3]), {"v": "5"}, False),
    ("gt-bool", expr("/v", "Gt", [0]), {"v": True}, False),
    ("gt-missing", expr("/v", "Gt", [0]), {}, False),
    ("gt-null", expr("/v", "Gt", [0]), {"v": None}, False),
    ("gt-array", expr("/v", "Gt", [0]), {"v": [5]}, False),
    ("gt-nested-cores", expr("/cpus/0/cores", "Gt", [16]), SPEC_DEVICE, True),
    ("lt-smaller", expr("/v", "Lt", [3]), {"v": 2}, True),
    ("lt-equal", expr("/v", "Lt", [3]), {"v": 3}, False),
    ("lt-greater", expr("/v", "Lt", [3]), {"v": 3.5}, False),
    ("lt-string", expr("/v", "Lt", [3]), {"v": "2"}, False),
    ("lt-bool", expr("/v", "Lt", [3]), {"v": False}, False),
    ("lt-missing", expr("/v", "Lt", [3]), {}, False),
    # ContainsAll / ContainsAny on arrays of objects
    ("containsall-spec-gpu", GPU_EXPRESSION, SPEC_DEVICE, True),
    ("containsall-one-element-matches-all", expr("/p", "ContainsAll", items=GPU_ITEMS),
     {"p": OBJECTS}, True),
    ("containsall-split-across-elements", expr("/p", "ContainsAll", items=GPU_ITEMS),
     {"p": ONLY_SPLIT_OBJECTS}, False),
    ("containsall-case-sensitive", expr("/p", "ContainsAll", items=GPU_ITEMS),
     {"p": [{"type": "gpu", "manufacturer": "nvidia"}]}, False),
    ("containsall-empty-array", expr("/p", "ContainsAll", items=GPU_ITEMS), {"p": []}, False),
    ("containsall-missing", expr("/p", "ContainsAll", items=GPU_ITEMS), {}, False),
    ("containsall-object-not-array", expr("/p", "ContainsAll", items=GPU_ITEMS),
     {"p": {"type": "gpu", "manufacturer": "NVIDIA"}}, False),
    ("containsall-string-not-array", expr("/p", "ContainsAll", items=GPU_ITEMS),
     {"p": "gpu"}, False),
    ("containsall-scalar-elements", expr("/p", "ContainsAll", items=GPU_ITEMS),
     {"p": ["gpu", "NVIDIA"]}, False),
    ("containsany-one-expression", expr("/p", "ContainsAny", items=GPU_ITEMS),
     {"p": [{"type": "display", "manufacturer": "NVIDIA"}]}, True),
    ("containsany-split-across-elements", expr("/p", "ContainsAny", items=GPU_ITEMS),
     {"p": ONLY_SPLIT_OBJECTS}, True),
    ("containsany-none", expr("/p", "ContainsAny", items=GPU_ITEMS),
     {"p": [{"type": "camera", "manufacturer": "Sony"}]}, False),
    ("containsany-missing", expr("/p", "ContainsAny", items=GPU_ITEMS), {}, False),
    ("containsany-not-array", expr("/p", "ContainsAny", items=GPU_ITEMS),
     {"p": {"type": "gpu"}}, False),
    ("contains-exists-item", expr("/p", "ContainsAll", items=[expr("/model", "Exists")]),
     {"p": OBJECTS}, True),
    ("contains-doesnotexist-item",
     expr("/p", "ContainsAll", items=[expr("/model", "DoesNotExist"),
                                      expr("/type", "In", ["gpu"])]),
     {"p": OBJECTS}, True),
    ("contains-gt-item", expr("/cpus", "ContainsAll", items=[expr("/cores", "Gt", [16])]),
     SPEC_DEVICE, True),
    ("contains-nested",
     expr("/a", "ContainsAny",
          items=[expr("/tags", "ContainsAll", items=[expr("", "In", ["x"])])]),
     {"a": [{"tags": ["y"]}, {"tags": ["x", "z"]}]}, True),
    # ContainsAll / ContainsAny on arrays of scalars ("" = the element itself)
    ("containsall-scalars", expr("/supportedRuntimes", "ContainsAll",
                                 items=[expr("", "In", ["oci"])]), SPEC_DEVICE, True),
    ("containsall-scalars-no-match", expr("/supportedRuntimes", "ContainsAll",
                                          items=[expr("", "In", ["custom"])]), SPEC_DEVICE,
     False),
    ("containsall-scalars-two-items", expr("/t", "ContainsAll",
                                           items=[expr("", "In", ["a", "b"]),
                                                  expr("", "NotIn", ["a"])]),
     {"t": ["a", "b"]}, True),
    ("containsany-scalars", expr("/supportedDeploymentTypes", "ContainsAny",
                                 items=[expr("", "In", ["compose"]), expr("", "In", ["x"])]),
     SPEC_DEVICE, True),
    ("containsany-numbers", expr("/n", "ContainsAny", items=[expr("", "Gt", [10])]),
     {"n": [1, 5, 11]}, True),
    ("contains-scalar-strict-types", expr("/n", "ContainsAny", items=[expr("", "In", [1])]),
     {"n": ["1", True]}, False),
]


@pytest.mark.parametrize(
    ("expression", "properties", "expected"),
    [pytest.param(e, p, x, id=i) for i, e, p, x in PROPERTY_CASES],
)
def test_property_operator(expression: dict[str, Any], properties: dict[str, Any],
                           expected: bool) -> None:
    result = match(rules(rule(props=[expression])), properties, {})
    assert result.eligible is expected
    assert (result.failures == ()) is expected
    if not expected:
        (failure,) = result.failures
        assert (failure.stage, failure.key, failure.operator, failure.rule) == (
            "eligibility", expression["key"], expression["operator"], 0)


HOST = "example.com/hyper-v.host"
LABEL_CASES = [
    ("in-bool-label", expr(HOST, "In", [True]), {HOST: True}, True),
    ("in-bool-label-string", expr(HOST, "In", [True]), {HOST: "true"}, False),
    ("in-string-label", expr("site", "In", ["berlin", "paris"]), {"site": "paris"}, True),
    ("in-number-label", expr("rack", "In", [3]), {"rack": 3}, True),
    ("in-number-label-string", expr("rack", "In", [3]), {"rack": "3"}, False),
    ("in-missing-label", expr("site", "In", ["berlin"]), {}, False),
    ("in-list-label", expr("zones", "In", ["a"]), {"zones": ["a"]}, False),
    ("label-key-is-not-a-pointer", expr("/site", "In", ["x"]), {"site": "x"}, False),
    ("label-key-with-slash-exact", expr("/site", "In", ["x"]), {"/site": "x"}, True),
    ("notin-label", expr("site", "NotIn", ["berlin"]), {"site": "paris"}, True),
    ("notin-missing-label", expr("site", "NotIn", ["berlin"]), {}, False),
    ("exists-label", expr(HOST, "Exists"), {HOST: False}, True),
    ("doesnotexist-label", expr(HOST, "DoesNotExist"), {}, True),
    ("gt-label", expr("gen", "Gt", [2]), {"gen": 3}, True),
    ("lt-label-string", expr("gen", "Lt", [9]), {"gen": "3"}, False),
    ("containsall-string-list-label", expr("zones", "ContainsAll",
                                           items=[expr("", "In", ["b"])]),
     {"zones": ["a", "b"]}, True),
    ("containsany-number-list-label", expr("ports", "ContainsAny",
                                           items=[expr("", "In", [80, 443])]),
     {"ports": [22, 443]}, True),
    ("containsany-scalar-label", expr("zones", "ContainsAny", items=[expr("", "In", ["a"])]),
     {"zones": "a"}, False),
]


@pytest.mark.parametrize(
    ("expression", "labels", "expected"),
    [pytest.param(e, lab, x, id=i) for i, e, lab, x in LABEL_CASES],
)
def test_label_operator(expression: dict[str, Any], labels: dict[str, Any],
                        expected: bool) -> None:
    result = match(rules(rule(labels=[expression])), SPEC_DEVICE, labels)
    assert result.eligible is expected


# --------------------------------------------------------------------------- compile errors

SEL = ("eligibilityRules", 0, "propertySelector", "matchExpressions", 0)
ITEMS = (*SEL, "itemSelector", "matchExpressions")


def one(expression: dict[str, Any]) -> dict[str, Any]:
    return rules(rule(props=[expression]))


COMPILE_ERRORS = [
    ("gt-two-values", one(expr("/v", "Gt", [1, 2])), (*SEL, "values"), "exactly one"),
    ("lt-no-values", one(expr("/v", "Lt", [])), (*SEL, "values"), "non-empty"),
    ("gt-string-value", one(expr("/v", "Gt", ["5"])), (*SEL, "values", 0), "numbers"),
    ("gt-bool-value", one(expr("/v", "Gt", [True])), (*SEL, "values", 0), "numbers"),
    ("gt-nan-value", one(expr("/v", "Gt", [float("nan")])), (*SEL, "values", 0), "numbers"),
    ("gt-missing-values", one(expr("/v", "Gt")), SEL, "needs `values`"),
    ("in-mixed-string-number", one(expr("/v", "In", ["a", 1])), (*SEL, "values"), "one type"),
    ("in-mixed-bool-number", one(expr("/v", "In", [True, 1])), (*SEL, "values"), "one type"),
    ("in-two-booleans", one(expr("/v", "In", [True, False])), (*SEL, "values"),
     "exactly one boolean"),
    ("in-empty-values", one(expr("/v", "In", [])), (*SEL, "values"), "non-empty"),
    ("in-values-not-list", one({"key": "/v", "operator": "In", "values": "a"}),
     (*SEL, "values"), "non-empty list"),
    ("in-missing-values", one(expr("/v", "In")), SEL, "needs `values`"),
    ("in-object-value", one(expr("/v", "In", [{"a": 1}])), (*SEL, "values", 0), "strings"),
    ("in-null-value", one(expr("/v", "In", [None])), (*SEL, "values", 0), "strings"),
    ("notin-mixed", one(expr("/v", "NotIn", [1, "1"])), (*SEL, "values"), "one type"),
    ("exists-with-values", one(expr("/v", "Exists", ["x"])), (*SEL, "values"), "no values"),
    ("doesnotexist-with-values", one(expr("/v", "DoesNotExist", [])), (*SEL, "values"),
     "no values"),
    ("exists-with-item-selector", one(expr("/v", "Exists", items=[expr("", "Exists")])),
     (*SEL, "itemSelector"), "no itemSelector"),
    ("in-with-item-selector", one(expr("/v", "In", ["x"], items=[expr("", "Exists")])),
     (*SEL, "itemSelector"), "no itemSelector"),
    ("containsall-without-item-selector", one(expr("/p", "ContainsAll")), SEL,
     "needs itemSelector"),
    ("containsany-without-item-selector", one(expr("/p", "ContainsAny")), SEL,
     "needs itemSelector"),
    ("containsall-with-values", one(expr("/p", "ContainsAll", ["gpu"], items=GPU_ITEMS)),
     (*SEL, "values"), "no values"),
    ("containsall-empty-items", one(expr("/p", "ContainsAll", items=[])), ITEMS,
     "non-empty"),
    ("containsall-item-selector-not-object",
     one({"key": "/p", "operator": "ContainsAll", "itemSelector": []}),
     (*SEL, "itemSelector"), "must be an object"),
    ("containsall-bad-item", one(expr("/p", "ContainsAll", items=[expr("/t", "Gt", ["x"])])),
     (*ITEMS, 0, "values", 0), "numbers"),
    ("containsall-bad-item-pointer",
     one(expr("/p", "ContainsAll", items=[expr("type", "In", ["gpu"])])),
     (*ITEMS, 0, "key"), "JSON Pointer"),
    ("pointer-without-slash", one(expr("vendor", "In", ["x"])), (*SEL, "key"), "JSON Pointer"),
    ("pointer-bad-escape", one(expr("/a~2b", "In", ["x"])), (*SEL, "key"), "'~'"),
    ("pointer-trailing-tilde", one(expr("/a~", "In", ["x"])), (*SEL, "key"), "'~'"),
    ("key-not-string", one({"key": 5, "operator": "Exists"}), (*SEL, "key"), "string"),
    ("key-missing", one({"operator": "Exists"}), SEL, "needs `key`"),
    ("label-key-empty", rules(rule(labels=[expr("", "Exists")])),
     ("eligibilityRules", 0, "labelSelector", "matchExpressions", 0, "key"), "non-empty"),
    ("unknown-operator", one(expr("/v", "Equals", ["x"])), (*SEL, "operator"),
     "unknown operator"),
    ("operator-wrong-case", one(expr("/v", "in", ["x"])), (*SEL, "operator"),
     "did you mean 'In'"),
    ("operator-missing", one({"key": "/v"}), SEL, "needs `operator`"),
    ("unknown-expression-field", one({**expr("/v", "Exists"), "value": ["x"]}),
     (*SEL, "value"), "unknown field 'value'"),
    ("expression-not-object", one("vendor=Acme"),  # type: ignore[arg-type]
     SEL, "must be an object"),
    ("unknown-selector-field",
     rules({"propertySelector": {"matchExpressions": [], "matchLabels": {}}}),
     ("eligibilityRules", 0, "propertySelector", "matchLabels"), "unknown field"),
    ("selector-without-match-expressions", rules({"propertySelector": {}}),
     ("eligibilityRules", 0, "propertySelector"), "needs matchExpressions"),
    ("selector-match-expressions-not-list",
     rules({"labelSelector": {"matchExpressions": {"key": "a"}}}),
     ("eligibilityRules", 0, "labelSelector", "matchExpressions"), "must be a list"),
    ("selector-null", rules({"propertySelector": None}),
     ("eligibilityRules", 0, "propertySelector"), "must be an object"),
    ("rule-without-selector", rules({}), ("eligibilityRules", 0), "needs a propertySelector"),
    ("rule-with-only-unknown-field", rules({"nodeSelector": {}}),
     ("eligibilityRules", 0, "nodeSelector"), "unknown field"),
    ("unknown-rule-field", rules({**rule(props=[]), "propertySelectors": {}}),
     ("eligibilityRules", 0, "propertySelectors"), "did you mean 'propertySelector'"),
    ("rules-not-list", {"eligibilityRules": {"propertySelector": {}}}, ("eligibilityRules",),
     "must be a list"),
    ("rules-null", {"eligibilityRules": None}, ("eligibilityRules",), "must be a list"),
    ("unknown-top-level-field", {"capacity": {}}, ("capacity",), "unknown field"),
    ("bad-extension-name", {"x-Acme-extensions": {}}, ("x-Acme-extensions",),
     "unknown field"),
    ("unknown-capacity-field", {"capacityRequirements": {"gpu": 1}},
     ("capacityRequirements", "gpu"), "unknown field"),
    ("unknown-cpu-field", {"capacityRequirements": {"cpu": {"cores": 1, "threads": 2}}},
     ("capacityRequirements", "cpu", "threads"), "unknown field"),
    ("cpu-without-cores", {"capacityRequirements": {"cpu": {"architectures": ["amd64"]}}},
     ("capacityRequirements", "cpu"), "needs `cores`"),
    ("cpu-zero-cores", {"capacityRequirements": {"cpu": {"cores": 0}}},
     ("capacityRequirements", "cpu", "cores"), "greater than 0"),
    ("cpu-bool-cores", {"capacityRequirements": {"cpu": {"cores": True}}},
     ("capacityRequirements", "cpu", "cores"), "greater than 0"),
    ("cpu-string-cores", {"capacityRequirements": {"cpu": {"cores": "2"}}},
     ("capacityRequirements", "cpu", "cores"), "greater than 0"),
    ("cpu-empty-architectures",
     {"capacityRequirements": {"cpu": {"cores": 1, "architectures": []}}},
     ("capacityRequirements", "cpu", "architectures"), "non-empty list"),
    ("cpu-bad-architecture",
     {"capacityRequirements": {"cpu": {"cores": 1, "architectures": ["amd64", 7]}}},
     ("capacityRequirements", "cpu", "architectures", 1), "non-empty string"),
    ("bad-memory-unit", {"capacityRequirements": {"memory": "4Gb"}},
     ("capacityRequirements", "memory"), "unknown unit 'Gb'"),
    ("negative-storage", {"capacityRequirements": {"storage": "-10Gi"}},
     ("capacityRequirements", "storage"), "negative"),
    ("memory-not-string", {"capacityRequirements": {"memory": ["4Gi"]}},
     ("capacityRequirements", "memory"), "not a quantity"),
    ("capacity-not-object", {"capacityRequirements": "4Gi"}, ("capacityRequirements",),
     "must be an object"),
]


@pytest.mark.parametrize(
    ("constraints", "path", "fragment"),
    [pytest.param(c, p, f, id=i) for i, c, p, f in COMPILE_ERRORS],
)
def test_compile_error(constraints: dict[str, Any], path: tuple[str | int, ...],
                       fragment: str) -> None:
    prefix = ("deploymentProfiles", 2, "deviceConstraints")
    with pytest.raises(DocumentError) as info:
        compile_constraints(constraints, path=prefix)
    paths = [p.path for p in info.value.problems]
    assert (*prefix, *path) in paths
    problem = info.value.problems[paths.index((*prefix, *path))]
    assert fragment in problem.message
    assert problem.expected


def test_compile_reports_every_problem_at_once() -> None:
    constraints = {
        "capacityRequirements": {"memory": "lots", "cpu": {"cores": -1}},
        "eligibilityRules": [
            rule(props=[expr("/a", "Gt", [1, 2]), expr("/b", "In", ["x"]),
                        expr("c", "Exists")]),
            {},
            rule(labels=[expr("k", "Bogus")]),
        ],
    }
    with pytest.raises(DocumentError) as info:
        compile_constraints(constraints)
    assert sorted(map(str, (p.path for p in info.value.problems))) == sorted(map(str, [
        ("capacityRequirements", "cpu", "cores"),
        ("capacityRequirements", "memory"),
        ("eligibilityRules", 0, "propertySelector", "matchExpressions", 0, "values"),
        ("eligibilityRules", 0, "propertySelector", "matchExpressions", 2, "key"),
        ("eligibilityRules", 1),
        ("eligibilityRules", 2, "labelSelector", "matchExpressions", 0, "operator"),
    ]))


def test_compile_problem_carries_found_value() -> None:
    with pytest.raises(DocumentError) as info:
        compile_constraints(one(expr("/v", "Gt", [1, 2])))
    (problem,) = info.value.problems
    assert problem.found == "a list of 2 item(s)"
    assert problem.json_path == "$.eligibilityRules[0].propertySelector.matchExpressions[0].values"


@pytest.mark.parametrize(
    "constraints",
    [
        pytest.param(None, id="none"),
        pytest.param({}, id="empty"),
        pytest.param({"eligibilityRules": []}, id="no-rules"),
        pytest.param({"x-acme-extensions": {"anything": [1, 2]}}, id="extension-ignored"),
        pytest.param({"x-acme-corp-extensions": "not even an object"}, id="extension-any-value"),
        pytest.param(rules(rule(props=[])), id="empty-match-expressions"),
        pytest.param(rules(rule(props=[], labels=[])), id="both-selectors-empty"),
    ],
)
def test_trivially_eligible(constraints: dict[str, Any] | None) -> None:
    assert compile_constraints(constraints).evaluate({}, {}) == MatchResult(True, ())


# --------------------------------------------------------------------------- JSON Pointer


@pytest.mark.parametrize(
    ("pointer", "tokens"),
    [
        pytest.param("", (), id="whole-document"),
        pytest.param("/", ("",), id="empty-key"),
        pytest.param("/vendor", ("vendor",), id="one-token"),
        pytest.param("/cpus/0/cores", ("cpus", "0", "cores"), id="array-index"),
        pytest.param("/a~1b", ("a/b",), id="escaped-slash"),
        pytest.param("/m~0n", ("m~n",), id="escaped-tilde"),
        pytest.param("/~01", ("~1",), id="escape-order"),
        pytest.param("/a//b", ("a", "", "b"), id="empty-middle-token"),
    ],
)
def test_parse_pointer(pointer: str, tokens: tuple[str, ...]) -> None:
    assert parse_pointer(pointer) == tokens


@pytest.mark.parametrize("pointer", ["vendor", "#/vendor", "/a~", "/a~2", "/~x", " /a"])
def test_parse_pointer_rejects(pointer: str) -> None:
    with pytest.raises(ValueError, match="JSON Pointer"):
        parse_pointer(pointer)


# --------------------------------------------------------------------------- capacity


def capacity(**requirements: Any) -> CompiledConstraints:
    return compile_constraints({"capacityRequirements": requirements})


def device(**fields: Any) -> dict[str, Any]:
    return {**SPEC_DEVICE, **fields}


def test_cpu_entries_are_never_summed() -> None:
    result = capacity(cpu={"cores": 3}).evaluate(
        device(cpus=[{"cores": 2, "architecture": "arm64"}] * 2), {})
    assert not result.eligible
    (failure,) = result.failures
    assert (failure.stage, failure.key, failure.operator) == ("capacity", "cpu.cores", ">=")
    assert (failure.required, failure.actual, failure.rule) == (3, [2, 2], None)
    assert "never summed" in failure.message


@pytest.mark.parametrize(
    ("cpu", "cpus", "eligible"),
    [
        pytest.param({"cores": 4}, [{"cores": 2}, {"cores": 4}], True, id="one-big-entry"),
        pytest.param({"cores": 1.5}, [{"cores": 2}], True, id="fractional-required"),
        pytest.param({"cores": 2}, [{"cores": 1.5}], False, id="fractional-reported"),
        pytest.param({"cores": 2, "architectures": ["amd64"]},
                     [{"cores": 4, "architecture": "x86_64"}], True, id="device-alias-x86_64"),
        pytest.param({"cores": 2, "architectures": ["x86_64"]},
                     [{"cores": 4, "architecture": "amd64"}], True, id="constraint-alias-x86_64"),
        pytest.param({"cores": 2, "architectures": ["arm64"]},
                     [{"cores": 4, "architecture": "aarch64"}], True, id="alias-aarch64"),
        pytest.param({"cores": 2, "architectures": ["aarch64"]},
                     [{"cores": 4, "architecture": "arm64"}], True, id="alias-aarch64-required"),
        pytest.param({"cores": 2, "architectures": ["amd64", "arm64"]},
                     [{"cores": 4, "architecture": "arm64"}], True, id="any-listed-arch"),
        pytest.param({"cores": 2, "architectures": ["arm64"]},
                     [{"cores": 4, "architecture": "arm"}], False, id="arm-is-not-arm64"),
        pytest.param({"cores": 2, "architectures": ["amd64"]},
                     [{"cores": 4, "architecture": "AMD64"}], False, id="arch-case-sensitive"),
        pytest.param({"cores": 2}, [{"cores": "4"}], False, id="string-cores"),
        pytest.param({"cores": 2}, [{"cores": True}], False, id="bool-cores"),
        pytest.param({"cores": 2}, [], False, id="empty-cpus"),
        pytest.param({"cores": 2}, ["4 cores"], False, id="garbage-entry"),
    ],
)
def test_cpu(cpu: dict[str, Any], cpus: list[Any], eligible: bool) -> None:
    assert capacity(cpu=cpu).evaluate(device(cpus=cpus), {}).eligible is eligible


def test_architecture_mismatch_with_enough_cores() -> None:
    result = capacity(cpu={"cores": 2, "architectures": ["arm64"]}).evaluate(SPEC_DEVICE, {})
    (failure,) = result.failures
    assert (failure.key, failure.operator) == ("cpu.architectures", "In")
    assert (failure.required, failure.actual) == (["arm64"], ["amd64"])
    assert "['arm64']" in failure.message and "['amd64']" in failure.message


def test_architecture_and_cores_both_fail() -> None:
    result = capacity(cpu={"cores": 32, "architectures": ["arm64"]}).evaluate(SPEC_DEVICE, {})
    assert [(f.key, f.operator, f.actual) for f in result.failures] == [
        ("cpu.architectures", "In", ["amd64"]),
        ("cpu.cores", ">=", [24]),
    ]


def test_cores_counted_only_on_matching_architecture() -> None:
    cpus = [{"cores": 2, "architecture": "amd64"}, {"cores": 8, "architecture": "arm64"}]
    result = capacity(cpu={"cores": 4, "architectures": ["amd64"]}).evaluate(
        device(cpus=cpus), {})
    (failure,) = result.failures
    assert (failure.key, failure.actual) == ("cpu.cores", [2, 8])
    assert "amd64 entries have [2] cores" in failure.message


@pytest.mark.parametrize("cpus", [None, "24 cores"], ids=["missing", "not-a-list"])
def test_missing_cpus(cpus: Any) -> None:
    props = device()
    if cpus is None:
        del props["cpus"]
    else:
        props["cpus"] = cpus
    result = capacity(cpu={"cores": 2, "architectures": ["amd64"]}).evaluate(props, {})
    assert [(f.key, f.actual) for f in result.failures] == [
        ("cpu.cores", None), ("cpu.architectures", None)]


@pytest.mark.parametrize(
    ("field", "required", "reported", "eligible"),
    [
        pytest.param("memory", "59Gi", "59 Gi", True, id="spec-spacing"),
        pytest.param("memory", "4Gi", "4GiB", True, id="GiB"),
        pytest.param("memory", "14Gi", "16GB", True, id="decimal-device-unit"),
        pytest.param("memory", "16Gi", "16GB", False, id="GB-is-smaller-than-Gi"),
        pytest.param("memory", "1024Mi", 1024**3, True, id="reported-as-int"),
        pytest.param("memory", 1024, "1Ki", True, id="required-as-int"),
        pytest.param("storage", "1862Gi", "1862 Gi", True, id="storage-exact"),
        pytest.param("storage", "2Ti", "1862 Gi", False, id="storage-short"),
        pytest.param("storage", "0", "0", True, id="zero"),
    ],
)
def test_quantity(field: str, required: Any, reported: Any, eligible: bool) -> None:
    result = capacity(**{field: required}).evaluate(device(**{field: reported}), {})
    assert result.eligible is eligible


def test_memory_near_miss_message() -> None:
    result = capacity(memory="4Gi").evaluate(device(memory="3.5Gi"), {})
    (failure,) = result.failures
    assert failure.to_json() == {
        "stage": "capacity", "key": "memory", "operator": ">=", "required": "4Gi",
        "actual": "3.5Gi", "rule": None, "message": "needs 4Gi memory, has 3.5Gi",
    }


def test_near_miss_that_renders_equal_shows_bytes() -> None:
    result = capacity(memory="4Gi").evaluate(device(memory=4 * GI - 1), {})
    (failure,) = result.failures
    assert "needs 4Gi memory" in failure.message
    assert str(4 * GI - 1) in failure.message


@pytest.mark.parametrize(
    ("reported", "fragment"),
    [
        pytest.param("lots", "not a quantity", id="garbage"),
        pytest.param("4 Gb", "unknown unit", id="unknown-unit"),
        pytest.param(True, "not a quantity", id="bool"),
        pytest.param(["4Gi"], "not a quantity", id="list"),
        pytest.param(None, "does not report memory", id="null"),
    ],
)
def test_bad_reported_quantity_is_a_failure(reported: Any, fragment: str) -> None:
    result = capacity(memory="1Gi").evaluate(device(memory=reported), {})
    (failure,) = result.failures
    assert failure.key == "memory" and fragment in failure.message
    assert failure.actual == reported


def test_missing_memory_and_storage() -> None:
    props = {k: v for k, v in SPEC_DEVICE.items() if k not in {"memory", "storage"}}
    result = capacity(memory="1Gi", storage="1Gi").evaluate(props, {})
    assert [(f.key, f.actual) for f in result.failures] == [("memory", None), ("storage", None)]


# --------------------------------------------------------------------------- aggregation


def test_spec_gpu_example_end_to_end() -> None:
    constraints = {
        "capacityRequirements": {"cpu": {"cores": 1.5, "architectures": ["amd64"]},
                                 "memory": "1024Mi", "storage": "10Gi"},
        "eligibilityRules": [rule(props=[GPU_EXPRESSION])],
    }
    compiled = compile_constraints(constraints)
    assert compiled.evaluate(SPEC_DEVICE, {}).eligible
    amd = device(peripherals=[{"type": "gpu", "manufacturer": "AMD"}])
    (failure,) = compiled.evaluate(amd, {}).failures
    assert failure.required == ["/type In ['gpu']", "/manufacturer In ['NVIDIA']"]
    assert failure.actual == [{"type": "gpu", "manufacturer": "AMD"}]
    assert failure.message.startswith(
        "rule 0: /peripherals ContainsAll [/type In ['gpu'], /manufacturer In ['NVIDIA']] but")


def test_rule_failure_fields_and_message() -> None:
    result = match(rules(rule(props=[expr("/vendor", "In", ["Acme"])])),
                   device(vendor="Other"), {})
    assert result.to_json() == {"eligible": False, "failures": [{
        "stage": "eligibility", "key": "/vendor", "operator": "In", "required": ["Acme"],
        "actual": "Other", "rule": 0,
        "message": "rule 0: /vendor In ['Acme'] but the device has 'Other'",
    }]}


@pytest.mark.parametrize(
    ("expression", "properties", "fragment"),
    [
        pytest.param(expr("/vendor", "In", ["Acme"]), {}, "has no property /vendor",
                     id="missing-property"),
        pytest.param(expr("/n", "In", [1]), {"n": "1"}, "a string; the values are numbers",
                     id="type-mismatch"),
        pytest.param(expr("/n", "In", ["a"]), {"n": ["a"]}, "a list, not a single value",
                     id="list-for-scalar"),
        pytest.param(expr("/n", "Gt", [1]), {"n": "5"}, "a string, not a number",
                     id="gt-string"),
        pytest.param(expr("/n", "DoesNotExist"), {"n": 1}, "the device has 1", id="dne"),
        pytest.param(GPU_EXPRESSION, {"peripherals": {"type": "gpu"}}, "an object, not a list",
                     id="contains-non-list"),
        pytest.param(GPU_EXPRESSION, {"peripherals": []}, "an empty list", id="contains-empty"),
        pytest.param(expr("/p", "ContainsAny", items=[expr("", "In", ["x"])]), {"p": ["y"]},
                     "matches any item expression", id="contains-any"),
    ],
)
def test_failure_messages(expression: dict[str, Any], properties: dict[str, Any],
                          fragment: str) -> None:
    (failure,) = match(one(expression), properties, {}).failures
    assert fragment in failure.message


def test_label_failure_message() -> None:
    (failure,) = match(rules(rule(labels=[expr(HOST, "In", [True])])), {}, {}).failures
    assert failure.message == (
        "rule 0: label 'example.com/hyper-v.host' In [true] but the device has no label "
        "'example.com/hyper-v.host'")
    assert failure.actual is None


def test_every_failing_clause_across_rules_is_listed() -> None:
    constraints = rules(
        rule(props=[expr("/vendor", "In", ["Acme"]), expr("/modelNumber", "Exists"),
                    expr("/cpus/0/cores", "Gt", [64])]),
        rule(props=[expr("/otelCollector", "In", [False])],
             labels=[expr("site", "In", ["berlin"]), expr("tier", "Exists")]),
        rule(labels=[expr(HOST, "In", [True])]),
    )
    result = match(constraints, SPEC_DEVICE, {"tier": "gold"})
    assert not result.eligible
    assert [(f.rule, f.key, f.operator) for f in result.failures] == [
        (0, "/vendor", "In"),
        (0, "/cpus/0/cores", "Gt"),
        (1, "/otelCollector", "In"),
        (1, "site", "In"),
        (2, HOST, "In"),
    ]


def test_one_passing_rule_makes_the_device_eligible() -> None:
    constraints = rules(rule(props=[expr("/vendor", "In", ["Acme"])]),
                        rule(labels=[expr(HOST, "In", [True])]))
    assert match(constraints, SPEC_DEVICE, {HOST: True}) == MatchResult(True, ())


def test_rule_needs_both_selectors() -> None:
    constraints = rules(rule(props=[expr("/vendor", "Exists")],
                             labels=[expr(HOST, "In", [True])]))
    assert match(constraints, SPEC_DEVICE, {HOST: True}).eligible
    result = match(constraints, SPEC_DEVICE, {HOST: False})
    assert [f.key for f in result.failures] == [HOST]


def test_selector_expressions_are_anded() -> None:
    constraints = one(expr("/vendor", "Exists"))
    constraints["eligibilityRules"][0]["propertySelector"]["matchExpressions"].append(
        expr("/vendor", "In", ["Acme"]))
    result = match(constraints, SPEC_DEVICE, {})
    assert [f.operator for f in result.failures] == ["In"]


def test_capacity_failures_come_first_and_rules_still_reported() -> None:
    constraints = {
        "capacityRequirements": {"memory": "64Gi", "cpu": {"cores": 32}},
        "eligibilityRules": [rule(props=[expr("/vendor", "In", ["Acme"])])],
    }
    result = match(constraints, SPEC_DEVICE, {})
    assert [(f.stage, f.key) for f in result.failures] == [
        ("capacity", "cpu.cores"), ("capacity", "memory"), ("eligibility", "/vendor")]


def test_capacity_failure_with_passing_rule_reports_only_capacity() -> None:
    constraints = {
        "capacityRequirements": {"storage": "4Ti"},
        "eligibilityRules": [rule(props=[expr("/vendor", "Exists")])],
    }
    result = match(constraints, SPEC_DEVICE, {})
    assert not result.eligible
    assert [f.key for f in result.failures] == ["storage"]


def test_none_documents_are_empty() -> None:
    compiled = compile_constraints(rules(rule(props=[expr("/v", "DoesNotExist")],
                                              labels=[expr("l", "DoesNotExist")])))
    assert compiled.evaluate(None, None).eligible


def test_compiled_constraints_are_immutable_and_reusable() -> None:
    compiled = compile_constraints(one(expr("/vendor", "In", ["Acme"])))
    with pytest.raises(dataclasses.FrozenInstanceError):
        compiled.rules = ()  # type: ignore[misc]
    verdicts = [compiled.evaluate({"vendor": v}, {}).eligible for v in ["Acme", "X", "Acme"]]
    assert verdicts == [True, False, True]


def test_results_serialise_to_json() -> None:
    constraints = {"capacityRequirements": {"cpu": {"cores": 64, "architectures": ("arm64",)}},
                   "eligibilityRules": [rule(props=[GPU_EXPRESSION])]}
    result = match(constraints, device(peripherals=({"type": "camera"},)), {})
    data = json.loads(json.dumps(result.to_json()))
    assert data["eligible"] is False
    assert [f["key"] for f in data["failures"]] == [
        "cpu.architectures", "cpu.cores", "/peripherals"]
    assert data["failures"][2]["actual"] == [{"type": "camera"}]
    assert set(data["failures"][0]) == {f.name for f in dataclasses.fields(Failure)}


# --------------------------------------------------------------------------- requiredResources

LEGACY = {
    "cpu": {"cores": 4, "architectures": ["x86_64"]},
    "memory": "8Gi",
    "storage": "100Gi",
    "peripherals": [{"type": "gpu", "manufacturer": "NVIDIA"}],
    "interfaces": [{"type": "ethernet"}, {"type": "wifi"}],
}


def test_required_resources_satisfied() -> None:
    assert match(None, SPEC_DEVICE, {}, required_resources=LEGACY).eligible


@pytest.mark.parametrize(
    ("peripheral", "eligible"),
    [
        pytest.param({"type": "gpu"}, True, id="type-only"),
        pytest.param({"type": "gpu", "manufacturer": "NVIDIA"}, True, id="manufacturer"),
        pytest.param({"type": "gpu", "manufacturer": "nvidia"}, False, id="case-sensitive"),
        pytest.param({"type": "gpu", "manufacturer": "NVIDIA", "model": "A2"}, False,
                     id="model-not-reported"),
        pytest.param({"type": "camera"}, False, id="other-type"),
    ],
)
def test_required_peripheral(peripheral: dict[str, str], eligible: bool) -> None:
    result = match(None, SPEC_DEVICE, {}, required_resources={"peripherals": [peripheral]})
    assert result.eligible is eligible
    if not eligible:
        (failure,) = result.failures
        assert (failure.stage, failure.key, failure.required) == (
            "requiredResources", "peripherals", peripheral)
        assert failure.actual == SPEC_DEVICE["peripherals"]


def test_required_interfaces_each_checked() -> None:
    required = {"interfaces": [{"type": "wifi"}, {"type": "canbus"}, {"type": "usb"}]}
    result = match(None, SPEC_DEVICE, {}, required_resources=required)
    assert [(f.key, f.required) for f in result.failures] == [
        ("interfaces", {"type": "canbus"}), ("interfaces", {"type": "usb"})]
    assert "'canbus' interface" in result.failures[0].message


def test_required_resources_capacity_uses_its_own_stage() -> None:
    required = {"cpu": {"cores": 48}, "memory": "64Gi"}
    result = match(None, SPEC_DEVICE, {}, required_resources=required)
    assert [(f.stage, f.key) for f in result.failures] == [
        ("requiredResources", "cpu.cores"), ("requiredResources", "memory")]


def test_device_constraints_and_required_resources_both_apply() -> None:
    constraints = rules(rule(props=[expr("/vendor", "In", ["Acme"])]))
    result = match(constraints, SPEC_DEVICE, {}, required_resources={"storage": "4Ti"})
    assert [(f.stage, f.key) for f in result.failures] == [
        ("requiredResources", "storage"), ("eligibility", "/vendor")]
    assert not match({}, SPEC_DEVICE, {}, required_resources={"storage": "4Ti"}).eligible
    assert not match(constraints, SPEC_DEVICE, {}, required_resources={}).eligible


@pytest.mark.parametrize(
    ("required", "path", "fragment"),
    [
        pytest.param({"gpu": 1}, ("gpu",), "unknown field", id="unknown-field"),
        pytest.param({"memory": "8 gigs"}, ("memory",), "not a quantity", id="bad-memory"),
        pytest.param({"cpu": {}}, ("cpu",), "needs `cores`", id="cpu-without-cores"),
        pytest.param({"peripherals": [{"manufacturer": "NVIDIA"}]}, ("peripherals", 0),
                     "needs `type`", id="peripheral-without-type"),
        pytest.param({"peripherals": [{"type": "gpu", "vendor": "x"}]},
                     ("peripherals", 0, "vendor"), "unknown field", id="peripheral-unknown"),
        pytest.param({"peripherals": [{"type": "gpu", "model": 3}]},
                     ("peripherals", 0, "model"), "non-empty string", id="peripheral-model"),
        pytest.param({"peripherals": {"type": "gpu"}}, ("peripherals",), "must be a list",
                     id="peripherals-not-list"),
        pytest.param({"interfaces": [{}]}, ("interfaces", 0), "needs `type`",
                     id="interface-without-type"),
        pytest.param({"interfaces": ["wifi"]}, ("interfaces", 0), "must be an object",
                     id="interface-not-object"),
    ],
)
def test_required_resources_compile_errors(required: dict[str, Any],
                                           path: tuple[str | int, ...], fragment: str) -> None:
    profile = ("deploymentProfiles", 1)
    with pytest.raises(DocumentError) as info:
        compile_constraints(None, required_resources=required,
                            path=(*profile, "deviceConstraints"))
    (problem,) = info.value.problems
    assert problem.path == (*profile, "requiredResources", *path)
    assert fragment in problem.message


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({"path": ("p", "deviceConstraints")}, ("p", "requiredResources"),
                     id="sibling-of-deviceConstraints"),
        pytest.param({"path": ("p", "requiredResources")}, ("p", "requiredResources"),
                     id="path-is-requiredResources"),
        pytest.param({"path": ("p",)}, ("p", "requiredResources"), id="inside-profile"),
        pytest.param({"path": ("p",), "required_resources_path": ("elsewhere",)},
                     ("elsewhere",), id="explicit"),
    ],
)
def test_required_resources_problem_location(kwargs: dict[str, Any],
                                             expected: tuple[str, ...]) -> None:
    with pytest.raises(DocumentError) as info:
        compile_constraints(None, required_resources={"storage": "x"}, **kwargs)
    assert [p.path for p in info.value.problems] == [(*expected, "storage")]


def test_is_eligible_agrees_with_evaluate() -> None:
    constraints = compile_constraints({
        "capacityRequirements": {"cpu": {"cores": 2}, "memory": "4Gi"},
        "eligibilityRules": [{"labelSelector": {"matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["a"]}]}}]})
    devices = [
        ({"cpus": [{"cores": 4}], "memory": "8Gi"}, {"zone": "a"}),
        ({"cpus": [{"cores": 4}], "memory": "8Gi"}, {"zone": "b"}),
        ({"cpus": [{"cores": 1}, {"cores": 1}], "memory": "8Gi"}, {"zone": "a"}),
        ({}, {}),
        (None, None),
    ]
    for properties, labels in devices:
        assert constraints.is_eligible(properties, labels) == constraints.evaluate(
            properties, labels).eligible
