"""Is a device on its desired state, on its way, failing on it, or silent?

`current`: every deployment the device's branch holds has an `installed` status for the
deployment's current bytes; `pending`: not yet; `failed-on-current`: one of them reported
`failed` for its current bytes; `stale`: nothing heard from the device (capability report,
manifest poll, Git fetch, status) for `STALE_POLLS` of its observed polling interval (or
`STALE_AFTER` seconds while its interval is unknown), whatever its statuses say.

A status belongs to the current bytes when the bytes it is about (`applied`: the digest of
the deployment's document the device had adopted when it reported, `wfm.fleet.attribution`) are
the bytes the branch holds now, whatever the device's generation or source. A deployment
that was only reconfigured therefore waits for a new report: an `installed` from before
the change says nothing about the new values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MIN_STALE", "STALE_AFTER", "STALE_POLLS", "Freshness", "device_freshness",
           "status_for_current"]

#: A device is stale after this many polling intervals without a word.
STALE_POLLS = 3
#: ... and never sooner than this (seconds): a device polling every second is not stale
#: after three seconds of a busy network.
MIN_STALE = 60.0
#: Until a device's polling interval has been seen (two polls), silence this long is stale.
STALE_AFTER = 900.0


@dataclass(frozen=True, slots=True)
class Freshness:
    state: str  # current | pending | failed-on-current | stale
    last_seen: float | None
    poll_interval: float | None
    stale_after: float  # seconds of silence that make the device stale

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "lastSeen": self.last_seen,
                "pollInterval": self.poll_interval, "staleAfter": self.stale_after}


def device_freshness(*, deployments: dict[str, str], statuses: dict[str, dict[str, Any]],
                     last_seen: float | None, poll_interval: float | None, now: float,
                     stale_polls: float = STALE_POLLS) -> Freshness:
    """`deployments`: what the branch holds now (id -> digest); `statuses`: the stored
    status per deployment id (`state`, `applied`: the digest the report is about)."""
    stale_after = (STALE_AFTER if poll_interval is None
                   else max(MIN_STALE, stale_polls * poll_interval))
    def result(state: str) -> Freshness:
        return Freshness(state, last_seen, poll_interval, stale_after)

    if last_seen is None or now - last_seen > stale_after:
        return result("stale")
    current = {deployment_id: status["state"] for deployment_id, status in statuses.items()
               if deployment_id in deployments
               and status_for_current(deployments[deployment_id], status)}
    if any(state == "failed" for state in current.values()):
        return result("failed-on-current")
    if all(current.get(deployment_id) == "installed" for deployment_id in deployments):
        return result("current")
    return result("pending")


def status_for_current(digest: str, status: dict[str, Any]) -> bool:
    """Whether a stored status (`applied`: the digest of the document it is about) is about
    the deployment's bytes `digest`."""
    return status.get("applied") == digest
