"""The target index answers exactly what `Intent.targets` answers, device by device."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.intents import load_intent
from compiler.snapshot import snapshot_from_documents
from compiler.targeting import TargetIndex
from margo.loading import LoadedDocument

LABEL_VALUES = st.one_of(st.sampled_from(["a", "b", "1", "true"]), st.sampled_from([1, 1.0, 2]),
                         st.booleans(), st.lists(st.sampled_from(["a", "b"]), max_size=2))
VALUES = st.one_of(st.lists(st.sampled_from(["a", "b", "1"]), min_size=1, max_size=3),
                   st.lists(st.sampled_from([1, 2.0]), min_size=1, max_size=3),
                   st.booleans().map(lambda b: [b]))


def expression(key: str) -> Any:
    return st.one_of(
        st.builds(lambda v: {"key": key, "operator": "In", "values": v}, VALUES),
        st.builds(lambda v: {"key": key, "operator": "NotIn", "values": v}, VALUES),
        st.just({"key": key, "operator": "Exists"}),
    )


def _rule(labels: list[Any], vendors: list[str] | None) -> dict[str, Any]:
    rule: dict[str, Any] = {"labelSelector": {"matchExpressions": labels}}
    if vendors is not None:  # a property clause too: the index must then read properties
        rule["propertySelector"] = {"matchExpressions": [
            {"key": "/vendor", "operator": "In", "values": vendors}]}
    return rule


rules = st.lists(
    st.builds(_rule, st.lists(st.sampled_from(["zone", "tier"]).flatmap(expression),
                              min_size=1, max_size=2),
              st.one_of(st.none(), st.lists(st.sampled_from(["v0", "v1"]), min_size=1,
                                            max_size=2, unique=True))),
    max_size=3)


def device(index: int, labels: dict[str, Any]) -> dict[str, Any]:
    return {"properties": {"id": f"d{index}", "vendor": f"v{index % 2}", "modelNumber": "m",
                           "serialNumber": "s"}, "labels": labels}


@settings(max_examples=150, deadline=None)
@given(selectors=rules, explicit=st.lists(st.sampled_from(["d0", "d3", "nope"]), unique=True),
       fleet=st.lists(st.dictionaries(st.sampled_from(["zone", "tier"]), LABEL_VALUES),
                      min_size=1, max_size=8))
def test_index_equals_direct_evaluation(selectors: list[Any], explicit: list[str],
                                        fleet: list[dict[str, Any]]) -> None:
    spec: dict[str, Any] = {"application": {"id": "app"}, "targets": {}}
    if selectors or not explicit:
        spec["targets"]["selectors"] = selectors
    if explicit:
        spec["targets"]["devices"] = explicit
    intent = load_intent(LoadedDocument.unlocated({
        "apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
        "metadata": {"name": "i"}, "spec": spec}))
    snapshot = snapshot_from_documents({f"d{i}": device(i, labels)
                                        for i, labels in enumerate(fleet)})
    index = TargetIndex(snapshot.devices)
    for device_id, d in snapshot.devices.items():
        assert index.targets(intent, device_id) == intent.targets(device_id, d.properties,
                                                                  d.labels)


def test_selector_problems_point_at_the_intent_field() -> None:
    import pytest

    from margo.errors import DocumentError

    with pytest.raises(DocumentError) as info:
        load_intent(LoadedDocument.unlocated({
            "apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
            "metadata": {"name": "i"}, "spec": {"application": {"id": "app"}, "targets": {
                "selectors": [{"labelSelector": {"matchExpressions": [
                    {"key": "zone", "operator": "Gt", "values": [1, 2]}]}}]}}}))
    assert info.value.problems[0].json_path.startswith(
        "$.spec.targets.selectors[0].labelSelector.matchExpressions[0]")
