"""The eligibility-rules dialect (`deviceConstraints.eligibilityRules`): OR across rules, AND
of every property and label expression within a rule; compiled and checked here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from margo.constraints.expressions import Expression, compile_selector
from margo.constraints.problems import ProblemCollector
from margo.constraints.results import Failure
from margo.constraints.vocabulary import MISSING
from margo.errors import Path

__all__ = ["Rule", "compile_rules"]

_RULE_FIELDS: Final = ("propertySelector", "labelSelector")


@dataclass(frozen=True, slots=True)
class Rule:
    """One eligibility rule: every property and every label expression must hold."""

    index: int
    properties: tuple[Expression, ...]
    labels: tuple[Expression, ...]

    def passes(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
        for exprs, doc in ((self.properties, properties), (self.labels, labels)):
            for expr in exprs:
                if not expr.test(expr.lookup(doc)):
                    return False
        return True

    def explain(self, properties: Mapping[str, Any], labels: Mapping[str, Any]) -> list[Failure]:
        failures = []
        for exprs, doc in ((self.properties, properties), (self.labels, labels)):
            for expr in exprs:
                actual = expr.lookup(doc)
                if not expr.test(actual):
                    failures.append(self._failure(expr, actual))
        return failures

    def _failure(self, expr: Expression, actual: Any) -> Failure:
        message = f"rule {self.index}: {expr.text} but {expr.why_not(actual)}"
        return Failure("eligibility", expr.key, expr.operator, expr.required,
                       None if actual is MISSING else actual, self.index, message)


def compile_rules(log: ProblemCollector, value: Any, path: Path) -> list[Rule]:
    """`eligibilityRules`: the valid rules, a located problem for every invalid one."""
    if not isinstance(value, list | tuple):
        log.problem(path, "eligibilityRules must be a list of rules",
                    expected="a list (OR across rules)", found=value)
        return []
    compiled = [_compile_rule(log, raw, (*path, i), i) for i, raw in enumerate(value)]
    return [rule for rule in compiled if rule is not None]


def _compile_rule(log: ProblemCollector, value: Any, path: Path, index: int) -> Rule | None:
    doc = log.fields_of(value, path, "an eligibility rule", _RULE_FIELDS)
    if doc is None:
        return None
    if not any(field in doc for field in _RULE_FIELDS):
        log.problem(path, "an eligibility rule needs a propertySelector or a labelSelector",
                    expected="propertySelector and/or labelSelector", found=value)
        return None
    before = len(log.problems)
    properties = compile_selector(log, doc.get("propertySelector", MISSING),
                                  (*path, "propertySelector"), labels=False)
    labels = compile_selector(log, doc.get("labelSelector", MISSING), (*path, "labelSelector"),
                              labels=True)
    if len(log.problems) != before:
        return None
    return Rule(index, properties, labels)
