"""The capability snapshot: the latest DeviceCapabilitiesManifest of every device.

Offline compiles read it from a directory (one document per file, any spec shape) or from
one YAML/JSON file keyed by device id; the fleet server builds the same from its database
with `snapshot_from_documents`, telling each device's generation too (`ReportedDocuments`:
the API its client called, which the document's shape cannot always tell). A broken
document is a located problem and its device is left alone (its previous desired state
stays), never dropped; so is a device whose id is not a valid
`margo.identifiers.DEVICE_ID` (one stored before the server bounded ids: no branch can be
named for it). A cluster proposal's `ClusterCapabilitiesManifest` is read
as the rc.3 document `margo.cluster` converts it to, exactly as the server stores it, so
both bodies of one cluster compile alike.

A keyed JSON file is read member by member (`_read_members`): each document decoded and
checked on its own, never the whole file at once. Reading a large one again costs decoding
it and one digest per device; when its bytes are exactly those the last compile read
(`SnapshotMemo`, kept in the compiler's state), the documents the state trusts are taken
from their recorded place in the text and digest without being decoded, and a file whose
documents it all trusts is not decoded at all: each device's document is decoded when
first used, and a recompile uses few of them.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.gcpause import collection_paused
from compiler.gitformat import all_plain_device_ids, branch_problem
from compiler.jsonspans import (
    Lines,
    MemberPositions,
    MemberRefused,
    json_text,
    member_spans,
    member_value,
    members_of,
)
from compiler.snapshotdevice import Device
from margo.cluster import device_capabilities_from_cluster, is_cluster_manifest
from margo.digests import data_digest
from margo.errors import DocumentError, Problem, short_repr
from margo.kinds import GENERATIONS, Kind
from margo.loading import Limits, LoadedDocument, load_document, load_path
from margo.models import DeviceCapabilities
from margo.validation import validate_loaded

__all__ = ["Device", "LazyDevices", "ReportedDocuments", "Snapshot", "SnapshotError",
           "SnapshotMemo", "TrustedDigests", "load_snapshot", "snapshot_from_documents",
           "used_as_reported"]

_SUFFIXES = (".json", ".yaml", ".yml")
#: One file holding every device of a large fleet is legitimately big (0.5 to 1 KiB per
#: device): 2 GiB holds a fleet of a million devices and more (256 MiB had refused one).
KEYED_SNAPSHOT_LIMITS = Limits(max_bytes=2 * 1024 * 1024 * 1024)
#: Bumped whenever the same bytes could be read differently (digests, cluster conversion),
#: so a memo written by an older reader is never taken for this one's.
MEMO_VERSION = "1"


class SnapshotError(RuntimeError):
    """The snapshot as a whole cannot be read."""




@dataclass(frozen=True)
class SnapshotMemo:
    """What reading one keyed snapshot file established: `key` identifies its exact bytes
    (and this reader, `MEMO_VERSION`); `digests` maps each device read from it without
    problems to its document's digest.

    For a JSON file, `spans` gives every key's document as (start, end) character offsets
    in the file's text, and `plain` the keys whose document is a device capabilities
    document (not a cluster manifest) reporting that key as its id: what lets a file the
    state wholly trusts be used without decoding it (`load_snapshot`). Both are empty for
    other files.
    """

    key: str
    digests: Mapping[str, str]
    spans: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    plain: frozenset[str] = frozenset()

    @functools.cached_property
    def ids(self) -> list[str]:
        """The keys of `spans`, sorted (once for every compile that reads these bytes)."""
        return sorted(self.spans)

    @functools.cached_property
    def plain_ids(self) -> bool:
        """Whether every key of `spans` is a plain device id (`all_plain_device_ids`)."""
        return all_plain_device_ids(self.spans.keys())

    @functools.cached_property
    def all_plain_digested(self) -> bool:
        """Whether the plain keys are exactly the keys with a digest."""
        return self.plain == self.digests.keys()

    def establish(self, ids: list[str]) -> None:
        """Work out now, while the compile that read the file holds it, what every
        recompile of the same bytes asks of the memo (`ids`: the keys of `spans`, sorted,
        which the caller has; `plain_ids`; `all_plain_digested`). Why: asked lazily, the
        first no-op after a full compile paid them (0.45 s of 2.2 s at a million devices),
        where the full compile that made the memo pays the same in a run of minutes."""
        self.__dict__["ids"] = ids if self.spans else []  # (checking it would cost as much)
        _ = self.plain_ids, self.all_plain_digested


class LazyDevices(MutableMapping[str, Device]):
    """The devices of a keyed JSON file whose every document the state trusts: each
    `Device` is built when first asked for, from its memo's digest and span.

    Why: a recompile that changes nothing builds none of them (0.1-0.16 s at 100,000
    devices); it reads the digests (`digests`) and the sorted ids (`ids`) of the memo.
    Changing the mapping builds every device first, then it behaves as a dict."""

    __slots__ = ("_all", "_data", "_file", "_made", "_memo", "_text", "_vouched_by")

    def __init__(self, memo: SnapshotMemo, data: bytes, file: str,
                 vouched_by: TrustedDigests | None = None) -> None:
        """`data`: the file's bytes, decoded when a first device is built (a recompile
        that builds none does not decode 45 MB for 100,000 devices). `vouched_by`: trusted
        digests that hold every digest of the memo under its key (`_all_trusted`), so a
        compile that gets its recorded digests from the same `source` need not compare
        them again (`compiler.planning`)."""
        self._memo, self._data, self._file = memo, data, file
        self._vouched_by = vouched_by
        self._text: str | bytes | None = None
        self._made: dict[str, Device] = {}
        self._all: dict[str, Device] | None = None  # once changed

    @property
    def digests(self) -> Mapping[str, str]:
        """Device id -> `Device.digest`, every device's, without building any (until the
        mapping is changed: then each device's own)."""
        return self._memo.digests if self._all is None else {
            key: device.digest for key, device in self._all.items()}

    @property
    def vouched_by(self) -> TrustedDigests | None:
        """The trusted digests given at construction, until the mapping is changed."""
        return self._vouched_by if self._all is None else None

    @property
    def ids(self) -> list[str]:
        """The ids, sorted (the order of iteration); the caller's own list."""
        return list(self._memo.ids) if self._all is None else sorted(self._all)

    @property
    def plain_ids(self) -> bool:
        """Whether every id is a plain one (`all_plain_device_ids`), known from the memo."""
        return self._all is None and self._memo.plain_ids

    def __getitem__(self, key: str) -> Device:
        if self._all is not None:
            return self._all[key]
        device = self._made.get(key)
        if device is None:
            start, end = self._memo.spans[key]
            if self._text is None:  # ASCII: offsets in bytes are offsets in characters,
                # and `json` reads the bytes of a span as their text (not decoding 45 MB
                # for the tenth of 100,000 devices a recompile builds: 25-35 ms)
                self._text = self._data if self._data.isascii() else json_text(self._data)
            device = self._made[key] = Device(key, None, self._memo.digests[key], self._file,
                                              span=(self._text, start, end))
        return device

    def __contains__(self, key: object) -> bool:
        return key in (self._memo.spans if self._all is None else self._all)

    def __iter__(self) -> Iterator[str]:
        return iter(self._memo.ids if self._all is None else self._all)

    def __len__(self) -> int:
        return len(self._memo.spans if self._all is None else self._all)

    def __setitem__(self, key: str, device: Device) -> None:
        self._changed()[key] = device

    def __delitem__(self, key: str) -> None:
        del self._changed()[key]

    def _changed(self) -> dict[str, Device]:
        if self._all is None:
            self._all = {key: self[key] for key in self._memo.ids}
        return self._all

    def __repr__(self) -> str:
        return f"LazyDevices({len(self)} devices of {self._file!r})"


class TrustedDigests(dict[str, str]):
    """Device id -> digest of a document that validated before, as `load_snapshot` takes
    it; `memo` is the keyed snapshot file the last compile read, if any.

    Why a dict carrying a memo: callers already pass the state's trusted digests through
    (``load_snapshot(caps, trusted=state.trusted_digests())``), and both are facts the
    state remembers about the same last compile. `source` is whatever the state copied
    the digests from (`CompilerState.records_are_those_of` asks it back).
    """

    def __init__(self, digests: Mapping[str, str], memo: SnapshotMemo | None = None, *,
                 source: object = None) -> None:
        super().__init__(digests)
        self.memo, self.source = memo, source


def memo_key(data: bytes) -> str:
    """The `SnapshotMemo.key` of a keyed snapshot file with these exact bytes."""
    return f"{MEMO_VERSION}:{hashlib.sha256(data).hexdigest()}"


@dataclass
class Snapshot:
    #: A dict, or for a keyed file the state wholly trusts, `LazyDevices`.
    devices: MutableMapping[str, Device] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    broken: set[str] = field(default_factory=set)  # device ids (or file stems) not usable
    #: For a keyed file: what reading it established, for the state to remember (else None).
    memo: SnapshotMemo | None = None

    @property
    def digest(self) -> str:
        """One digest over every device's document digest (for commit trailers)."""
        h = hashlib.sha256()
        for device_id in sorted(self.devices):
            h.update(f"{device_id}\0{self.devices[device_id].digest}\n".encode())
        return "sha256:" + h.hexdigest()


def used_as_reported(device_id: str, document: Any) -> bool:
    """Whether a device's reported document is its capability document as it stands: it
    claims that id and is not a cluster manifest (of which the compiler makes another
    document). Only such a document can be remembered by its bytes alone."""
    return _claimed_id(document) == device_id and not is_cluster_manifest(document)


def _claimed_id(doc: Any) -> str | None:
    properties = doc.get("properties") if isinstance(doc, dict) else None
    claimed = properties.get("id") if isinstance(properties, dict) else None
    return claimed if isinstance(claimed, str) else None


def _is_trusted(doc: Any, digest: str, trusted: Mapping[str, str]) -> bool:
    """Whether this exact content validated before (same digest under the id it claims):
    its model can then be built without validating it again."""
    claimed = _claimed_id(doc)
    return claimed is not None and trusted.get(claimed) == digest


def _from_cluster_manifest(snapshot: Snapshot, loaded: LoadedDocument,
                           key: str | None) -> LoadedDocument | None:
    """The rc.3 document of a cluster manifest; None (problems located) when invalid."""
    try:
        converted = device_capabilities_from_cluster(loaded.value)
    except DocumentError as exc:
        snapshot.problems.extend(loaded.locate(p) for p in exc.problems)
        metadata = loaded.value.get("metadata")
        cluster_id = metadata.get("id") if isinstance(metadata, dict) else None
        snapshot.broken.add(str(cluster_id if isinstance(cluster_id, str) else key))
        return None
    return LoadedDocument.unlocated(converted, loaded.file)


def _add(snapshot: Snapshot, loaded: LoadedDocument, key: str | None,
         trusted: Mapping[str, str], known: Mapping[str, str] | None = None, *,
         generation: str | None = None) -> None:
    """Add one document; `known` maps keys to digests established for these exact bytes;
    `generation`: the one the device speaks, when the server told it."""
    if is_cluster_manifest(loaded.value):
        converted = _from_cluster_manifest(snapshot, loaded, key)
        if converted is None:
            return
        loaded = converted
    digest = known.get(key) if known and key is not None else None
    if digest is None:
        digest = data_digest(loaded.value)
    if generation is not None:
        digest = _with_generation(digest, generation)
    caps: DeviceCapabilities | None = None
    if trusted and _is_trusted(loaded.value, digest, trusted):
        device_id = _claimed_id(loaded.value)
        assert device_id is not None
    else:
        report = validate_loaded(loaded, expect=Kind.DEVICE_CAPABILITIES)
        if not report.valid:
            snapshot.problems.extend(report.problems)
            snapshot.broken.add(str(_claimed_id(loaded.value) or key))
            return
        caps = report.model
        device_id = caps.device_id
    if key is not None and key != device_id:
        snapshot.problems.append(loaded.locate(Problem(
            ("properties", "id"), f"filed under {key!r} but reports id {device_id!r}",
            expected=key, found=device_id)))
        snapshot.broken.add(key)
        return
    problem = branch_problem(device_id)
    if problem is not None:  # e.g. stored before the server bounded ids: no branch for it
        snapshot.problems.append(loaded.locate(Problem(
            ("properties", "id"), f"device {short_repr(device_id)} is left alone: {problem}",
            found=short_repr(device_id))))
        snapshot.broken.add(device_id)
        return
    if device_id in snapshot.devices:
        snapshot.problems.append(loaded.locate(Problem(
            ("properties", "id"), f"device {device_id!r} is reported twice (also in "
                                  f"{snapshot.devices[device_id].file})")))
        snapshot.broken.add(device_id)
        return
    snapshot.devices[device_id] = Device(device_id, caps, digest, loaded.file,
                                         document=None if caps else loaded.value,
                                         generation=generation)


class ReportedDocuments(dict[str, Any]):
    """Device id -> capability document as the fleet server stored it, carrying
    `generations`: device id -> the spec generation its client spoke when it reported it
    (the API it called), which its documents are written in.

    Why a dict carrying the generations: every caller hands the store's documents straight
    to `snapshot_from_documents` (the compile, the explanations), and both come from the
    same rows in one read, so they always agree (as `TrustedDigests` carries its memo).
    """

    def __init__(self, documents: Mapping[str, Any], generations: Mapping[str, str]) -> None:
        super().__init__(documents)
        self.generations = dict(generations)


def _with_generation(digest: str, generation: str) -> str:
    """A device's `Device.digest` when the server told its generation: a client that moves
    to another API generation changes what its documents are, like a new report does."""
    return "sha256:" + hashlib.sha256(f"{digest}\0{generation}".encode()).hexdigest()


@collection_paused()
def snapshot_from_documents(documents: Mapping[str, Any], *, file: str | None = None,
                            trusted: Mapping[str, str] | None = None) -> Snapshot:
    """A snapshot from already-decoded documents keyed by device id (e.g. the WFM's store;
    a `ReportedDocuments` also tells each device's generation: one that is not a known
    generation is ignored, and the device's report tells it)."""
    snapshot = Snapshot()
    generations = getattr(documents, "generations", None) or {}
    for key in sorted(documents):
        generation = generations.get(key)
        _add(snapshot, LoadedDocument.unlocated(documents[key], file), key, trusted or {},
             generation=generation if generation in GENERATIONS else None)
    return snapshot


@collection_paused()
def load_snapshot(path: str | os.PathLike[str], *,
                  trusted: Mapping[str, str] | None = None) -> Snapshot:
    """A directory of capability documents, or one file mapping device id -> document.

    `trusted` maps device ids to digests of documents that validated before (the
    compiler's state): a document with exactly that content is normalised without
    validating it again, which is what makes a no-op recompile of a large fleet cheap.
    A `TrustedDigests` may also carry the `SnapshotMemo` of the keyed file the last compile
    read: if this file's bytes are exactly those, the digests are taken from it and the
    file-level JSON checks (duplicate keys, depth, non-finite numbers), which those bytes
    passed, are not repeated. Any other bytes are read in full.
    """
    trusted = {} if trusted is None else trusted  # an empty TrustedDigests may carry a memo
    root = Path(path)
    snapshot = Snapshot()
    try:
        if root.is_dir():
            for file in sorted(p for p in root.iterdir() if p.suffix in _SUFFIXES):
                try:
                    _add(snapshot, load_path(str(file)), None, trusted)
                except DocumentError as exc:
                    snapshot.problems.extend(exc.problems)
                    snapshot.broken.add(file.stem)
            return snapshot
        with open(root, "rb") as handle:  # exactly what `load_path` reads
            data = handle.read(KEYED_SNAPSHOT_LIMITS.max_bytes + 1)
        key = memo_key(data)
        memo = getattr(trusted, "memo", None)
        if not (isinstance(memo, SnapshotMemo) and memo.key == key):
            memo = None
        if memo is not None and _add_trusted_spans(snapshot, data, str(root), memo, trusted):
            snapshot.memo = memo
            return snapshot
        read = _read_members(data, str(root), key, memo, trusted)
        if read is not None:
            return read
        # What the member read declines: YAML, or a file it refuses (read whole to locate).
        known = memo.digests if memo is not None else None
        loaded = load_document(data, file=str(root), limits=KEYED_SNAPSHOT_LIMITS)
    except DocumentError as exc:
        raise SnapshotError("\n".join(p.format() for p in exc.problems)) from None
    except OSError as exc:
        raise SnapshotError(f"{root}: cannot read: {exc.strerror or exc}") from None
    if not isinstance(loaded.value, dict):
        raise SnapshotError(f"{root}: expected a mapping of device id to capabilities document")
    keys = sorted(loaded.value)
    if (known is None and len(keys) >= PARALLEL_VALIDATION
            and "fork" in multiprocessing.get_all_start_methods()):
        _add_in_two_processes(snapshot, loaded, keys, trusted)
    elif known is not None:
        _add_known(snapshot, loaded, keys, trusted, known)
    else:
        for device_id in keys:
            _add(snapshot, _keyed(loaded, device_id), device_id, trusted, known)
    spans, plain = (memo.spans, memo.plain) if memo is not None else _json_spans(data, loaded)
    snapshot.memo = SnapshotMemo(key, {d: device.digest for d, device in
                                       snapshot.devices.items()}, spans, plain)
    snapshot.memo.establish(keys if spans else [])  # (`_json_spans`: spans has `keys`)
    _keep_spans(snapshot.devices, data, spans, plain)
    return snapshot


def _keep_spans(devices: Mapping[str, Device], data: bytes,
                spans: Mapping[str, tuple[int, int]], plain: frozenset[str]) -> None:
    """`Device.keep_span` for each device of a plain document: `_add` kept it only under
    the id its document reports, so it was built from exactly what its span decodes to."""
    keys = spans.keys() & plain & devices.keys()
    text = (data if data.isascii() else json_text(data)) if keys else b""  # (`LazyDevices`)
    for key in keys:
        devices[key].keep_span((text, *spans[key]))


def _add_trusted_spans(snapshot: Snapshot, data: bytes, file: str, memo: SnapshotMemo,
                       trusted: Mapping[str, str]) -> bool:
    """Add every device of a JSON file without decoding it, if the memo of these bytes has
    every key's span and each key's document is plain and trusted with its recorded digest
    (what `_add_known` would add directly); False, adding nothing, otherwise."""
    if not memo.spans or len(memo.plain) != len(memo.spans):
        return False
    if not _all_trusted(memo, trusted):
        return False
    snapshot.devices = LazyDevices(memo, data, file, vouched_by=trusted
                                   if isinstance(trusted, TrustedDigests) else None)
    return True


def _all_trusted(memo: SnapshotMemo, trusted: Mapping[str, str]) -> bool:
    """Whether each key has a recorded digest, `trusted` vouches for that digest under the
    key, and the key is a valid device id. Asked of every device on every recompile, so
    the usual case is answered by C loops: the memo's digests are exactly the keys' and
    all of them are trusted (dict views), and the ids are all plain ones (one regular
    expression, `all_plain_device_ids`, once per memo); anything else is checked key by
    key."""
    keys, digests = memo.plain, memo.digests
    if (memo.all_plain_digested and memo.plain_ids
            and (digests == trusted or digests.items() <= trusted.items())):
        return True
    for key in keys:
        digest = digests.get(key)
        if digest is None or trusted.get(key) != digest or branch_problem(key) is not None:
            return False
    return True


def _json_spans(data: bytes, loaded: LoadedDocument,
                ) -> tuple[dict[str, tuple[int, int]], frozenset[str]]:
    """Where each top-level member's value lies in a keyed JSON file's text, and which
    members are plain (see `SnapshotMemo`); nothing for text `json` does not read as one
    object with exactly the keys `loaded` has (YAML, for one)."""
    try:
        text = json_text(data)
        spans = member_spans(text)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return {}, frozenset()
    if spans is None or not isinstance(loaded.value, dict) or spans.keys() != loaded.value.keys():
        return {}, frozenset()
    plain = frozenset(key for key, value in loaded.value.items()
                      if used_as_reported(key, value))
    return spans, plain


#: A keyed file of at least this many documents read without a memo (the first compile, or
#: any change to the file) is digested and validated by two processes: digesting is about
#: 40 us per document, validating about 0.2 ms, both pure Python.
PARALLEL_VALIDATION = 2_000
#: What the forked validator inherits: how it reads each key's document (None: left to the
#: parent), the sorted keys, the trusted digests, the file.
_FORKED: tuple[Callable[[str], Any], list[str], Mapping[str, str], str | None] | None = None


def _add_known(snapshot: Snapshot, loaded: LoadedDocument, keys: list[str],
                trusted: Mapping[str, str], known: Mapping[str, str]) -> None:
    """`_add` every key of a file whose bytes the last compile read: the common case, a
    plain document the state vouches for under its own id, is added directly (what `_add`
    would do, minus locating and re-checking); anything else takes `_add`."""
    devices, file = snapshot.devices, loaded.file
    for key in keys:
        value = loaded.value[key]
        digest = known.get(key)
        if (digest is not None and trusted.get(key) == digest and key not in devices
                and used_as_reported(key, value) and branch_problem(key) is None):
            devices[key] = Device(key, None, digest, file, document=value)
        else:
            _add(snapshot, _keyed(loaded, key), key, trusted, known)


def _keyed(loaded: LoadedDocument, key: str) -> LoadedDocument:
    """The document filed under `key`, located inside the keyed file."""
    return LoadedDocument(loaded.value[key], loaded.file,
                          _Shifted(loaded, key))  # type: ignore[arg-type]


def _add_in_two_processes(snapshot: Snapshot, loaded: LoadedDocument, keys: list[str],
                          trusted: Mapping[str, str]) -> None:
    """`_add` every key in order, while a forked process digests and validates the second
    half.

    The child only says which of its documents are valid (with their digests); the parent
    then trusts those exactly as it trusts documents validated by an earlier compile, and
    validates the others itself, so problems and their order are what one process gives.
    """
    def add_first(first: list[str]) -> None:
        for device_id in first:
            _add(snapshot, _keyed(loaded, device_id), device_id, trusted)

    valid = _validating_second_half(keys, trusted, loaded.file, loaded.value.get, add_first)
    vouched = {**trusted, **valid}
    for device_id in keys[len(keys) // 2:]:
        _add(snapshot, _keyed(loaded, device_id), device_id, vouched, valid)


def _validating_second_half(keys: list[str], trusted: Mapping[str, str], file: str | None,
                            value_of: Callable[[str], Any],
                            add_first: Callable[[list[str]], None]) -> dict[str, str]:
    """`add_first(keys[:half])` while a forked process validates keys[half:]
    (`_valid_digests`, each document taken by `value_of`, None for one it must leave to
    the parent); what that process found valid."""
    global _FORKED
    half = len(keys) // 2
    _FORKED = (value_of, keys, trusted, file)
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            pending = pool.apply_async(_valid_digests, ((half, len(keys)),))
            add_first(keys[:half])
            return pending.get()
    finally:
        _FORKED = None


def _valid_digests(bounds: tuple[int, int]) -> dict[str, str]:
    """In the forked validator: key -> digest of each valid plain capability document of
    keys[start:end] that reports its key as id (cluster manifests are left to the parent);
    a document the state trusts with that digest is not validated again."""
    assert _FORKED is not None
    value_of, keys, trusted, file = _FORKED
    valid: dict[str, str] = {}
    for key in keys[slice(*bounds)]:
        value = value_of(key)
        if value is None or not used_as_reported(key, value):
            continue
        digest = data_digest(value)
        if trusted.get(key) == digest or validate_loaded(
                LoadedDocument.unlocated(value, file),
                expect=Kind.DEVICE_CAPABILITIES).valid:
            valid[key] = digest
    return valid


def _read_members(data: bytes, file: str, key: str, memo: SnapshotMemo | None,
                  trusted: Mapping[str, str]) -> Snapshot | None:
    """A keyed JSON file read member by member: each device's document decoded and checked
    on its own, as the whole would be (`compiler.jsonspans.member_value`), validated, and
    its model dropped at once (its text builds it again where it compiles; its labels
    kept for the planning); a document known valid for these bytes (by the state's memo, or
    the forked validator) is not even decoded. None when the file must be read whole
    (`members_of`; a member failing a check), which then locates what is wrong.

    Why: decoding the whole file first held every device's decoded document and model at
    once, about 4.6 KB a device after loading (7 GB at the peak of a million-device
    compile, most of it this), where the compile needs each only while it compiles it."""
    if memo is not None and not memo.spans:  # (not JSON, as the last compile read it)
        return None
    members = members_of(data, KEYED_SNAPSHOT_LIMITS, memo.spans if memo is not None else None)
    if members is None:
        return None
    text, spans = members
    keys, lines = memo.ids if memo is not None else sorted(spans), Lines(text)
    snapshot, plain = Snapshot(), set[str]()

    def add(some: list[str], vouched: Mapping[str, str]) -> None:
        _add_members(snapshot, file, (text, spans, lines), some, trusted, vouched, plain)

    try:
        if memo is not None:
            add(keys, {device_id: digest for device_id, digest in memo.digests.items()
                       if device_id in memo.plain and trusted.get(device_id) == digest})
        elif len(keys) >= PARALLEL_VALIDATION and "fork" in multiprocessing.get_all_start_methods():
            valid = _validating_second_half(
                keys, trusted, file, functools.partial(_member_or_none, text, spans),
                lambda first: add(first, {}))
            add(keys[len(keys) // 2:], valid)
        else:
            add(keys, {})
    except MemberRefused:
        return None
    snapshot.memo = SnapshotMemo(key, {d: device.digest for d, device in
                                       snapshot.devices.items()}, spans,
                                 memo.plain if memo is not None else frozenset(plain))
    snapshot.memo.establish(keys)
    return snapshot


def _member_or_none(text: str, spans: Mapping[str, tuple[int, int]], key: str) -> Any:
    """The forked validator's view of a member: None for one that fails a check (the
    parent then decodes it itself, and refuses the file)."""
    try:
        return member_value(text, spans[key], KEYED_SNAPSHOT_LIMITS)
    except MemberRefused:
        return None


def _add_members(snapshot: Snapshot, file: str,
                 members: tuple[str, Mapping[str, tuple[int, int]], Lines], keys: list[str],
                 trusted: Mapping[str, str], vouched: Mapping[str, str], plain: set[str]) -> None:
    """Add each key's device (see `_read_members`); `vouched`: key -> digest of plain
    documents known valid, added from their text alone; `plain` collects the keys whose
    document is used as reported (`SnapshotMemo.plain`)."""
    text, spans, lines = members
    devices = snapshot.devices
    for key in keys:
        span = spans[key]
        digest = vouched.get(key)
        if digest is not None and key not in devices and branch_problem(key) is None:
            devices[key] = Device(key, None, digest, file, span=(text, *span))
            plain.add(key)
            continue
        value = member_value(text, span, KEYED_SNAPSHOT_LIMITS)
        as_reported = used_as_reported(key, value)
        _add(snapshot, LoadedDocument(value, file, MemberPositions(lines, text, span)),  # type: ignore[arg-type]
             key, trusted)
        if as_reported:
            plain.add(key)
            device = devices.get(key)
            if device is not None:
                device.keep_span((text, *span))
                device.release(keep_labels=True)




class _Shifted:
    """Positions of a sub-document inside a keyed snapshot file."""

    def __init__(self, parent: LoadedDocument, key: str):
        self.parent, self.key = parent, key

    def value_position(self, path: Any) -> tuple[int, int] | None:
        return self.parent.source.value_position((self.key, *path))

    def key_position(self, path: Any) -> tuple[int, int] | None:
        return self.parent.source.key_position((self.key, *path))
