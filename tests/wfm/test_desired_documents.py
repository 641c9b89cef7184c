"""The served-document reader: ids read from our emitter's first lines are exactly what a
YAML reader finds, for every shape we emit, and anything else is read in full."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from margo.canonical import canonical_yaml
from margo.emit import deployment_yaml
from margo.kinds import Shape
from margo.models import ApplicationDeployment
from margo.validation import validate_document
from wfm.fleet.desired import _Document

OCT_2024 = {"apiVersion": "application.margo.org/v1alpha1", "kind": "ApplicationDeployment",
            "metadata": {"annotations": {"id": "a3e2f5dc-912e-494f-8395-52cf3769bc06",
                                         "applicationId": "com-example-app"},
                         "name": "app", "namespace": "margo",
                         "labels": {"margo-gitops.dev/intent": "web-everywhere"}},
            "spec": {"deploymentProfile": {"type": "helm.v3", "components": [
                {"name": "web", "properties": {"repository": "oci://r/web",
                                               "revision": "1.0.0"}}]}}}


def _model() -> ApplicationDeployment:
    model: ApplicationDeployment = validate_document(canonical_yaml(OCT_2024),
                                                      file="app.yaml").model
    return model


def _full(data: bytes) -> tuple[Any, Any, Any]:
    doc = yaml.safe_load(data)
    annotations = doc["metadata"].get("annotations") or {}
    return (doc.get("id") or annotations.get("id"),
            (doc["metadata"].get("labels") or {}).get("margo-gitops.dev/intent"),
            (doc.get("spec") or {}).get("applicationId") or annotations.get("applicationId"))


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(device=texts, name=texts, intent=texts, value=texts,
       shape=st.sampled_from([Shape.RC3, Shape.RC2, Shape.OCT_2024]), seed=st.integers(0, 2**64))
def test_emitted_documents_read_as_a_yaml_reader_reads_them(
        device: str, name: str, intent: str, value: str, shape: str, seed: int) -> None:
    deployment_id = str(uuid.UUID(int=seed % 2**128, version=5))
    model = dataclasses.replace(_model(), id=deployment_id, device_id=device or None,
                                name=name or "app",
                                labels={"margo-gitops.dev/intent": intent, "x": value})
    data = deployment_yaml(model, shape=shape)
    document = _Document.read(data)
    assert document is not None
    assert document._details is None  # read from the first lines, not parsed
    assert (document.deployment_id, *document.details()) == _full(data)
    assert document.data == data and document.digest.startswith("sha256:")


def test_documents_not_in_our_emitters_layout_are_read_in_full() -> None:
    data = canonical_yaml({"metadata": {"name": "x"}, "id": "not-a-uuid",
                           "spec": {"applicationId": "app"}})
    document = _Document.read(data)
    assert document is not None and document.deployment_id == "not-a-uuid"
    assert document.details() == (None, "app")
    # the id looks like ours but is not the first key: a YAML reader decides
    moved = b"metadata:\n  name: x\nid: 6f1c3e1a-0a8e-5f6e-9d1b-3b1f0c2a4d5e\n"
    assert _Document.read(moved).deployment_id == "6f1c3e1a-0a8e-5f6e-9d1b-3b1f0c2a4d5e"
    quoted = b"id: '6f1c3e1a-0a8e-5f6e-9d1b-3b1f0c2a4d5e'\nmetadata: {}\n"
    assert _Document.read(quoted).deployment_id == "6f1c3e1a-0a8e-5f6e-9d1b-3b1f0c2a4d5e"


def test_what_is_not_a_deployment_document_is_not_served() -> None:
    assert _Document.read(b"- a\n- b\n") is None
    assert _Document.read(b"id: [unclosed\n") is None
    assert _Document.read(b"metadata: {}\n") is None
    assert _Document.read(b"id: 7\n") is None
