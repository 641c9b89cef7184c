"""A device's deletion, published to every replica (`wfm.fleet.coordination` has the
design): its branch's ref written as deleted under the next generation, in the
transaction that deletes the device's rows; and the generation that did, for an id
registered again."""

from __future__ import annotations

import contextlib
from typing import Any

from compiler.gitstore import device_ref
from wfm.store import replica_rows

__all__ = ["REPO", "deletion_generation", "publish_deletion"]

#: The replicated repository of the devices' branches.
REPO = "devices"


def publish_deletion(conn: Any, device_ids: list[str]) -> int:
    """Publish that these devices' branches are deleted, under the next generation, in the
    caller's transaction (the one that deletes the devices' rows): every replica removes
    the refs when it syncs to it, and no later sync, repair or compaction restores them
    (a ref row without a target is what every replica applies as "no such branch"). The
    generation it published."""
    generation = replica_rows.lock_device_generation(conn) + 1
    refs: dict[str, str | None] = {}
    for device_id in device_ids:
        with contextlib.suppress(ValueError):  # an id that cannot have a branch has none
            refs[device_ref(device_id)] = None
    replica_rows.publish_rows(conn, REPO, generation, b"", refs, compact=False)
    replica_rows.set_counter(conn, REPO, generation)
    replica_rows.announce(conn, f"{REPO} {generation}")
    return generation


def deletion_generation(conn: Any, device_id: str) -> int | None:
    """The generation that published the device's branch as deleted (None: it was not, or
    a later compile gave the id a branch again)."""
    try:
        name = device_ref(device_id)
    except ValueError:
        return None
    return replica_rows.deleted_at(conn, REPO, name)
