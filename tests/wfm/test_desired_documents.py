"""The served-document reader: ids read from our emitter's first lines are exactly what a
YAML reader finds, for every shape we emit, and anything else is read in full; and the
manifest's bytes are JCS."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from margo.canonical import canonical_json, canonical_yaml
from margo.emit import deployment_yaml
from margo.kinds import Shape
from margo.models import ApplicationDeployment
from margo.validation import validate_document
from wfm.fleet.desired import BUNDLE_MEDIA_TYPE, ClientState, _Document, manifest_body

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


@dataclasses.dataclass(frozen=True)
class _Served:
    """What `manifest_body` reads of a served deployment."""

    deployment_id: str
    digest: str
    data: bytes


@settings(max_examples=300, deadline=None)
@given(version=st.integers(min_value=1, max_value=2**64 - 1), prefix=st.text(max_size=20),
       deployments=st.lists(st.tuples(st.text(max_size=12), st.text(max_size=12),
                                      st.binary(max_size=40)), max_size=4),
       bundle=st.one_of(st.none(), st.tuples(st.binary(max_size=40), st.text(max_size=12))))
def test_a_manifest_is_its_canonical_json(version: int, prefix: str,
                                          deployments: list[tuple[str, str, bytes]],
                                          bundle: tuple[bytes, str] | None) -> None:
    """`manifest_body` writes the manifest with one `json.dumps`; the bytes are JCS
    (`canonical_json`) for any ids, digests and prefix (escapes, non-ASCII, astral
    characters), manifest versions past 2^53, with and without a bundle."""
    state = ClientState(tuple(_Served(*d) for d in deployments), "sha256:s",  # type: ignore[arg-type]
                        bundle[0] if bundle else None, bundle[1] if bundle else None)
    bundle_doc = None if bundle is None else {
        "mediaType": BUNDLE_MEDIA_TYPE, "digest": bundle[1],
        "url": f"{prefix}/bundles/{bundle[1]}", "sizeBytes": len(bundle[0])}
    expected = canonical_json({"manifestVersion": version, "bundle": bundle_doc, "deployments": [
        {"deploymentId": i, "digest": d, "url": f"{prefix}/deployments/{i}/{d}",
         "sizeBytes": len(data)} for i, d, data in deployments]})
    assert manifest_body(version, state, prefix) == expected
