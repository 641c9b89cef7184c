"""What crosses back from a compile worker (`compiler.workers._pack`/`_unpack`): the same
work, and the names every device repeats (files, intents, actions, reasons, profiles)
unpickled once per range of devices rather than once per device, since the parent holds
every result until the branches move (about 8 % of a full compile's peak, measured)."""

from __future__ import annotations

import pickle

from compiler import workers
from compiler.device_compile import DeviceWork
from compiler.messages import Change
from compiler.outcome import DeviceOutcome
from compiler.state import PlacementRecord


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
        assert got.outcome.files == sent.outcome.files and got.ids == sent.ids
        assert got.outcome.kept == sent.outcome.kept
        assert got.placements_written == sent.placements_written
        assert (got.message, got.tree, got.stored_files) == ("message", "t" * 40, 1)
    first, second = (work.outcome.changes[0] for work in crossed)
    assert first.file is second.file and first.intent is second.intent
    assert first.action is second.action and first.reasons is second.reasons
    assert next(iter(crossed[0].ids)) is next(iter(crossed[1].ids))
    rows = [work.placements_written[0] for work in crossed]
    assert rows[0].intent is rows[1].intent and rows[0].profile is rows[1].profile
