"""The exported schemas: in sync with their source, well-formed, and the fast gate agrees
with the explaining validator on every document we can think of."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastjsonschema import JsonSchemaException
from jsonschema import Draft202012Validator

from margo import schemas
from margo.kinds import detect
from margo.loading import load_path
from margo.schemas import KINDS_AND_SHAPES, fast_check_for, hot_gate, load_schema, validator_for
from margo.validation import schema_problems

EXAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "spec-examples"
ROOT = Path(__file__).resolve().parents[2]


def test_exported_files_match_the_source() -> None:
    result = subprocess.run([sys.executable, "-m", "margo.schemas", "--check"], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("kind", "shape"), KINDS_AND_SHAPES, ids="/".join)
def test_schemas_are_valid_2020_12(kind: str, shape: str) -> None:
    Draft202012Validator.check_schema(load_schema(kind, shape))


def _mutations(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Each variant changes one thing: drop a key, add an unknown key, retype a value, end
    a string or a key with a newline (where Python's `$` and JSON Schema's part ways)."""
    if isinstance(doc, str):
        yield f"{path}-newline", doc + "\n"
    if isinstance(doc, dict):
        for key in list(doc):
            yield f"{path}-drop-{key}", _replace(doc, key, None, drop=True)
            yield f"{path}-newline-key-{key}", {(k + "\n" if k == key else k): v
                                                for k, v in doc.items()}
            for variant, value in _mutations(doc[key], (*path, key)):
                yield variant, _replace(doc, key, value)
        yield f"{path}-extra", {**doc, "unexpectedField": 1}
    elif isinstance(doc, list):
        for index, item in enumerate(doc[:1]):
            for variant, value in _mutations(item, (*path, index)):
                changed = list(doc)
                changed[index] = value
                yield variant, changed
    for other in ("", -1, 1.5, True, None, [], {}, "x" * 300):
        if type(other) is not type(doc) or other != doc:
            yield f"{path}-as-{other!r:.12}", copy.deepcopy(other)


def _replace(doc: dict[str, Any], key: str, value: Any, *, drop: bool = False) -> dict[str, Any]:
    out = dict(doc)
    if drop:
        del out[key]
    else:
        out[key] = value
    return out


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*/*")), ids=lambda p: p.name)
def test_fast_gate_agrees_with_the_full_validator(path: Path) -> None:
    original = load_path(str(path)).value
    detection = detect(original)
    assert detection.kind is not None and detection.shape is not None
    kind, shape = str(detection.kind), str(detection.shape)
    _assert_gate_agrees(original, fast_check_for(kind, shape), validator_for(kind, shape))


def _assert_gate_agrees(original: Any, fast: Any, full: Any) -> None:
    """The fast gate and the explaining validator agree on every mutation of `original`."""
    checked = 0
    for name, variant in _mutations(original):
        try:
            fast(variant)
            fast_ok = True
        except JsonSchemaException:
            fast_ok = False
        assert fast_ok == full.is_valid(variant), name
        checked += 1
    assert checked > 20


def _full_intent() -> dict[str, Any]:
    """An intent using every field of the schema."""
    return {"apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
            "metadata": {"name": "everything"},
            "spec": {"application": {"id": "com-example-app", "version": "1.0.0"},
                     "profile": {"type": "helm"}, "namespace": "demo",
                     "parameters": {"greeting": "{{ device.id }}", "n": 2},
                     "targets": {"devices": ["a", "b"], "selectors": [
                         {"labelSelector": {"matchExpressions": [
                             {"key": "zone", "operator": "In", "values": ["z1"]}]},
                          "propertySelector": {"matchExpressions": [
                              {"key": "/vendor", "operator": "Exists"}]}}]},
                     "constraints": {"capacityRequirements": {"memory": "1Gi"}},
                     "gracePeriod": "1h30m", "outputShape": "oct-2024"}}


@pytest.mark.parametrize("path", [*sorted((ROOT / "examples" / "fleet" / "deployments")
                                          .glob("*.yaml")), None],
                         ids=lambda p: p.name if p else "every-field")
def test_fast_intent_gate_agrees_with_the_full_validator(path: Path | None) -> None:
    from compiler.intents import _validator, fast_intent_check

    original = load_path(str(path)).value if path else _full_intent()
    assert _validator().is_valid(original)
    _assert_gate_agrees(original, fast_intent_check(), _validator())


@pytest.fixture
def cold_gates(monkeypatch: pytest.MonkeyPatch) -> None:
    """No kind has been validated yet in this process, as in a device that just started."""
    monkeypatch.setattr(schemas, "_heat", {})
    monkeypatch.setattr(schemas, "_hot", set())


@pytest.mark.usefixtures("cold_gates")
def test_a_kind_gets_its_compiled_gate_only_once_validated_in_bulk() -> None:
    kind, shape = "ApplicationDeployment", "rc.3"
    assert all(hot_gate(kind, shape) is None for _ in range(schemas.HOT_COUNT - 1))
    assert hot_gate("DeviceCapabilitiesManifest", "rc.3") is None  # each kind counts alone
    assert hot_gate(kind, shape) is fast_check_for(kind, shape)
    assert hot_gate(kind, shape) is fast_check_for(kind, shape)  # and stays hot


@pytest.mark.usefixtures("cold_gates")
def test_documents_spread_over_time_never_make_a_kind_hot() -> None:
    kind, shape = "ApplicationDeployment", "rc.2"
    for _ in range(3 * schemas.HOT_COUNT):
        assert hot_gate(kind, shape) is None
        schemas._heat[(kind, shape)].since -= schemas.HOT_WINDOW + 1  # a minute later


@pytest.mark.usefixtures("cold_gates")
@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*/*")), ids=lambda p: p.name)
def test_cold_and_hot_validation_give_the_same_answer(path: Path) -> None:
    """A device (cold: the explaining validator alone) and a server (hot: the gate first)
    accept and refuse the same documents with the same located problems."""
    original = load_path(str(path)).value
    detection = detect(original)
    assert detection.kind is not None and detection.shape is not None
    variants = [original, *(value for _, value in _mutations(original))][:60]
    cold = [schema_problems(v, detection.kind, detection.shape) for v in variants]
    schemas._hot.add((str(detection.kind), str(detection.shape)))
    hot = [schema_problems(v, detection.kind, detection.shape) for v in variants]
    assert cold == hot
    assert any(cold)
    assert bool(cold[0]) is (path.parent.name == "invalid")
