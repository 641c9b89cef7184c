"""What compiling one device decides: its new tree, what the state records of it, the
changes and notes people read, and the problems of intents that could not be rendered.

Kept apart from `compiler.device_compile` so that the parts of a device's compile that live
in their own modules (`compiler.decisions`: one intent's decision; `compiler.holding`: the
capacity round) work on the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compiler.gitstore import StoredTree
from compiler.messages import Change
from compiler.state import PlacementRecord
from margo.errors import Problem

__all__ = ["NO_TREE", "DeviceOutcome"]


@dataclass
class DeviceOutcome:
    files: dict[str, bytes]  # rendered now
    placements: list[PlacementRecord]
    changes: list[Change]
    problems: list[Problem]  # intents that could not be rendered (each keeps its file)
    notes: list[str]
    grace_until: float | None = None
    kept: dict[str, str] = field(default_factory=dict)  # left as stored: name -> blob id
    ids: dict[str, str] = field(default_factory=dict)  # the whole new tree: name -> blob id
    #: (intent, blob id of the file before) for each file a rollout moves to its new revision.
    moves: list[tuple[str, str]] = field(default_factory=list)
    #: Intents whose file in the new tree is not what they render now (a rollout or an
    #: error kept it, or it is held for capacity): what they take is read from that file.
    stale: set[str] = field(default_factory=set)

    def keep(self, fname: str, current: StoredTree) -> None:
        """Keep a stored file as it is, by its blob id (its content is never read)."""
        self.kept[fname] = self.ids[fname] = current.ids[fname]

    def add(self, fname: str, data: bytes, oid: str) -> None:
        self.files[fname] = data
        self.ids[fname] = oid


#: The tree of a device without a branch.
NO_TREE = StoredTree(None, "", {})
