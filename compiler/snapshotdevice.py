"""One device of a capability snapshot (`compiler.snapshot`): its id, digest and file, and
its capability model, built from its document or its JSON text only when something asks.

Why a module of its own: what a device holds between loading and compiling is what bounds
a large compile's memory (a million devices), so what it keeps, and when it lets go, is
kept in one place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from margo.constraints import matching_view
from margo.kinds import Kind, detect
from margo.models import DeviceCapabilities
from margo.normalize import normalise

__all__ = ["Device"]


class Device:
    """One device of the snapshot: its id, capability model, document digest and file.

    The model of a document trusted from an earlier compile (same digest, validated then) is
    built on first use: a recompile that skips most devices only reads their labels (to
    index selectors), which come straight from the document, exactly as normalising copies
    them. Immutable once built (`release` only drops what its text builds again alike).
    """

    __slots__ = ("_capabilities", "_document", "_generation", "_labels", "_matching", "_source",
                 "_span", "digest", "file", "id")

    id: str
    #: sha256 of the document's sorted-key compact JSON, and of the generation the device
    #: speaks when the server told it (`_with_generation`): changes iff either does.
    digest: str
    file: str | None

    def __init__(self, id: str, capabilities: DeviceCapabilities | None, digest: str,
                 file: str | None = None, *, document: Mapping[str, Any] | None = None,
                 span: tuple[str | bytes, int, int] | None = None,
                 generation: str | None = None) -> None:
        """Give `capabilities`, or the `document` of an already validated device (whose
        ``properties.id`` is `id`) to normalise when first needed, or the `span` of JSON
        text (text, or its bytes when ASCII, start, end) that decodes to that document.
        `generation`: the spec generation the device's client speaks, when known otherwise
        than from its document (the server sees which API it calls)."""
        if capabilities is None and document is None and span is None:
            raise ValueError("a Device needs its capabilities or its validated document")
        self.id, self.digest, self.file = id, digest, file
        self._capabilities = capabilities
        self._document = document
        self._span = span
        self._source = span  # the text the model is built from again (`release`)
        self._matching: Mapping[str, Any] | None = None
        self._labels: Mapping[str, Any] | None = None
        self._generation = generation

    def __repr__(self) -> str:
        return f"Device({self.id!r}, digest={self.digest!r}, file={self.file!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        return ((self.id, self.digest, self.file, self.capabilities)
                == (other.id, other.digest, other.file, other.capabilities))

    __hash__ = None  # type: ignore[assignment]  # like the frozen model it holds: by value

    @property
    def capabilities(self) -> DeviceCapabilities:
        if self._capabilities is None:
            document = self._validated_document()
            detection = detect(document, expect=Kind.DEVICE_CAPABILITIES)
            assert detection.kind is not None and detection.shape is not None
            self._capabilities = normalise(detection.kind, detection.shape, document)
            self._document = None
        return self._capabilities

    @property
    def generation(self) -> str:
        """The spec generation the device speaks, whose shape its documents are written in
        unless an intent forces one: what the server saw its client use, else the shape of
        its capability report (an offline compile knows nothing more)."""
        if self._generation is not None:
            return self._generation
        return str(self.capabilities.shape)

    def keep_span(self, span: tuple[str | bytes, int, int]) -> None:
        """Name the JSON text (as `span` in `__init__`) that decodes to the very document
        the model was validated from, so that `release` may drop the model."""
        self._source = span

    def release(self, *, keep_labels: bool = False) -> None:
        """Drop the model, if its text can build it again (the next use does), and its
        labels unless `keep_labels`. Why: once a device's result is accounted its model
        (about 3.5 KB) is not used again; dropped as the results stream, the results reuse
        its memory instead of the compile growing by both (`compiler.writing`). A device
        just validated while its file is read keeps its labels, which the planning reads
        of every device (`compiler.snapshot`)."""
        if self._source is not None:
            labels = self.labels if keep_labels else None
            self._capabilities = self._matching = self._document = None
            self._labels, self._span = labels, self._source

    def _validated_document(self) -> Mapping[str, Any]:
        if self._document is None:
            assert self._span is not None
            text, start, end = self._span
            self._document, self._span = json.loads(text[start:end]), None
        return self._document

    @property
    def matching(self) -> Mapping[str, Any]:
        """What constraints and selectors are evaluated against
        (`margo.constraints.matching_view`: properties + root extensions + cluster sections),
        built once per device, not per match."""
        if self._matching is None:
            caps = self.capabilities
            self._matching = matching_view(caps.properties, caps.extensions)
        return self._matching

    @property
    def properties(self) -> Mapping[str, Any]:
        return self.capabilities.properties

    @property
    def labels(self) -> Mapping[str, Any]:
        """The document's labels; without a model, read from its document or text and kept
        alone. Why: a compile's planning reads every device's labels (to index selectors)
        and builds no model for a label selector; keeping the decoded document instead
        would hold a million of them (`compiler.snapshot`'s member-by-member reading)."""
        if self._capabilities is not None:
            return self._capabilities.labels
        if self._labels is None:
            if self._document is not None:
                self._labels = _document_labels(self._document)
            else:
                assert self._span is not None
                text, start, end = self._span
                self._labels = _document_labels(json.loads(text[start:end]))
        return self._labels


def _document_labels(document: Mapping[str, Any]) -> Mapping[str, Any]:
    """A capability document's labels as its model holds them (every shape copies the
    root ``labels`` mapping; a test holds this to `margo.normalize`), without the copy."""
    labels = document.get("labels")
    return labels if labels else _NO_LABELS


_NO_LABELS: Mapping[str, Any] = MappingProxyType({})
