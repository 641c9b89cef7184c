"""What the server last made of the fleet source: compiled cleanly, compiled with problems,
or could not read it (and kept the previous desired state).

A mirrored source (`--source-url`, fetched on push hooks) cannot refuse a bad push the way
the hosted one does (`wfm.git.receivehook`), so its failures must be visible somewhere other
than the server log: the condition is stored with the fleet state (so every replica shows
what the compiling one found) and served by `GET /api/fleet/source`, `margo status` and the
dashboard.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from compiler.compilation import CompileReport
from wfm.store import fleet_rows
from wfm.store.database import Connection

__all__ = ["MAX_PROBLEMS", "SourceCondition", "load_condition", "store_condition"]

#: Problems kept per condition (the count says how many there were).
MAX_PROBLEMS = 100


@dataclass(frozen=True, slots=True)
class SourceCondition:
    #: `ready` (compiled, no problems), `invalid` (compiled; what has problems kept its
    #: previous state, see `problems`), `unreadable` (not compiled; the previous desired
    #: state stays), `waiting` (nothing pushed or fetched yet).
    state: str
    revision: str | None = None
    message: str | None = None
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0
    checked_at: float = 0.0

    @classmethod
    def of_report(cls, report: CompileReport) -> SourceCondition:
        found = [problem.format() if device is None else f"{device}: {problem.format()}"
                 for device, problem in report.errors]
        message = (f"{len(found)} problem(s); what they affect stays as it was (a broken "
                   "intent or application keeps its devices' previous deployments)"
                   ) if found else None
        return cls("invalid" if found else "ready", report.revision, message,
                   found[:MAX_PROBLEMS], len(found), time.time())

    @classmethod
    def not_compiled(cls, state: str, message: str) -> SourceCondition:
        return cls(state, None, message, [], 0, time.time())

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        return {"state": doc["state"], "revision": doc["revision"], "message": doc["message"],
                "problems": doc["problems"], "problemCount": doc["problem_count"],
                "checkedAt": doc["checked_at"]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SourceCondition:
        return cls(str(doc["state"]), doc.get("revision"), doc.get("message"),
                   list(doc.get("problems") or []), int(doc.get("problemCount") or 0),
                   float(doc.get("checkedAt") or 0.0))


def store_condition(conn: Connection, condition: SourceCondition) -> None:
    fleet_rows.save_source_condition(conn, condition.to_json())


def load_condition(conn: Connection) -> SourceCondition | None:
    """The stored condition (None before the first compile)."""
    stored = fleet_rows.source_condition(conn)
    return None if stored is None else SourceCondition.from_json(stored)
