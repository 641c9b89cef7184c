"""What crosses back from a compile worker (`compiler.workers._pack`/`_unpack`): the same
work, with the names every device repeats (files, intents, actions, reasons, profiles)
unpickled once per range of devices rather than once per device, and the new tree's files
as the JSON text the state records, since the parent holds every result until the
branches move (docs/benchmarks.md, issue 35)."""

from __future__ import annotations

import pickle

from compiler import workers
from compiler.device_compile import DeviceWork
from compiler.messages import Change
from compiler.outcome import DeviceOutcome
from compiler.state import PlacementRecord, files_json


def _fresh(text: str) -> str:
    """An equal string that is not the same object (as each device's rendering makes)."""
    return "".join(list(text))


def _work(device: str) -> DeviceWork:
    name, intent = _fresh("intent-03.yaml"), _fresh("intent-03")
    outcome = DeviceOutcome(
        {name: b"x"}, [], [Change(name, intent, _fresh("add"), (_fresh("intent added"),))],
        [], [], None, {_fresh("kept.yaml"): "b" * 40}, {name: device * 10},
        moves=[])
    placement = PlacementRecord(device, _fresh("intent-03"), True, True, None,
                                _fresh("profile-a"), False)
    return DeviceWork(outcome, "message", "t" * 40, 1, None, False, (), dict(outcome.ids),
                      False, (placement,), ())


def test_results_cross_equal_and_share_their_names() -> None:
    works = [_work("a"), _work("b")]
    crossed = [workers._unpack(packed) for packed in
               pickle.loads(pickle.dumps([workers._pack(w) for w in works]))]
    for sent, got in zip(works, crossed, strict=True):
        assert got.outcome.changes == sent.outcome.changes
        assert got.outcome.files == sent.outcome.files and got.ids is None
        assert got.files_json() == files_json(sent.ids or {}) == sent.files_json()
        assert got.file_count == sent.file_count == 1 and not got.failed
        assert got.outcome.kept == sent.outcome.kept
        assert got.placements_written == sent.placements_written
        assert (got.message, got.tree, got.stored_files) == ("message", "t" * 40, 1)
    first, second = (work.outcome.changes[0] for work in crossed)
    assert first.file is second.file and first.intent is second.intent
    assert first.action is second.action and first.reasons is second.reasons
    rows = [work.placements_written[0] for work in crossed]
    assert rows[0].intent is rows[1].intent and rows[0].profile is rows[1].profile


def test_a_failed_device_crosses_as_failed() -> None:
    work = _work("a")
    failed = DeviceWork(work.outcome, None, None, 3, None)
    [crossed] = [workers._unpack(pickle.loads(pickle.dumps(workers._pack(failed))))]
    assert crossed.failed and crossed.stored_files == 3 and crossed.ids_json is None
