"""Waiting manifest polls (rc.3 and rc.2): a conditional `GET .../deployments` that matches
the current ETag and carries `Prefer: wait=N` is held until the client's manifest changes or
N seconds pass (`wfm.fleet.waiters` has the whole design), then answered exactly as an
immediate poll: 200 with the new manifest, or 304; with `Preference-Applied: wait=N` when it
was held. Every other request is answered as before, so a client that does not know the
extension sees no difference.

A poll answered 304 after its wait leaves itself on its connection as the renewal of the
same request (`wfm.admission.parking`): the device's next poll, byte for byte the same, is
authenticated again and held again without going through the request stack.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from wfm.admission.parking import PARKED, ParkingSlot, park, parking_slot
from wfm.fleet.waiters import (
    CLOSING_SCOPE_KEY,
    Closing,
    Outcome,
    SoonHold,
    client_key,
    device_key,
    prefer_values,
    requested_wait,
    wait_headers,
)
from wfm.http.callers import Admission
from wfm.http.device_api import Api
from wfm.http.httpcache import etag_matches
from wfm.identity.clients import Client
from wfm.identity.proofs import SIGNED_SCOPE_KEY

__all__ = ["MANIFEST_MEDIA_TYPE", "Current", "manifest_answer"]

MANIFEST_MEDIA_TYPE = "application/vnd.margo.manifest.v1+json"
#: The client's manifest now: its exact bytes and ETag.
Current = Callable[[], Awaitable[tuple[bytes, str]]]


async def manifest_answer(request: Request, api: Api, client: Client, *, since: int,
                          condition: str | None, body: bytes, etag: str, current: Current,
                          admission: Callable[[Request, Client], Admission]) -> Response:
    """The answer to a manifest poll whose manifest, when `since` was marked, was `body`
    under `etag`: held first when it is a waiting poll (module docstring). A held poll's
    `admission(request, client)()` (made only for a poll that is held) raises once the
    caller would be refused (a retired client, a replaced token): asked at each wake, it
    ends the hold with that refusal."""
    if not etag_matches(condition, etag):
        return _manifest(body, etag)
    wait = requested_wait(prefer_values(request.scope["headers"]), limit=api.max_wait)
    if not wait:
        return _not_modified(etag)
    devices = await api.served_devices(client)
    poll = _HeldPoll(api, client, condition, current, (body, etag), wait, since,
                     devices, request.receive,
                     request.scope.get(CLOSING_SCOPE_KEY), admission(request, client))
    slot = park(request.scope, poll.answer)  # waits outside the stack (`wfm.admission.parking`)
    if slot is None:
        return await poll.answer()
    if request.scope.get(SIGNED_SCOPE_KEY) is None:  # a signature is checked every time
        poll.parked = slot
    return PARKED


class _HeldPoll:
    """A waiting poll while it is held: one object, not a closure per callback (10,000 of
    them are held at once, and each container they keep is walked by the collector); and,
    answered 304 after its wait, the renewal of the same request (module docstring)."""

    __slots__ = ("admitted", "api", "client", "closing", "condition", "current", "devices",
                 "keys", "latest", "parked", "receive", "since", "unchanged", "until", "wait")

    def __init__(self, api: Api, client: Client, condition: str | None, current: Current,
                 latest: tuple[bytes, str], wait: int, since: int, devices: tuple[str, ...],
                 receive: Receive, closing: Closing | None, admitted: Admission) -> None:
        self.api, self.client, self.condition, self.current = api, client, condition, current
        self.latest, self.wait, self.since = latest, wait, since
        self.devices, self.keys = devices, _keys(client, devices)
        self.receive, self.closing, self.admitted = receive, closing, admitted
        self.parked: ParkingSlot | None = None  # where a parked poll leaves its renewal
        self.until: float | None = None  # the next hold's end, when it continues one
        #: The 304 a wait that ran out answers, for the ETag it names (`timed_out`).
        self.unchanged: tuple[str, Response] | None = None

    async def check(self) -> tuple[bool, frozenset[str]]:
        """After a wake: whether the manifest changed, and what wakes the poll now; raises
        the refusal the caller would get now, if it would be refused (then nothing
        published after that is answered)."""
        await self.admitted()
        self.latest = await self.current()
        return (not etag_matches(self.condition, self.latest[1]),
                await self._served_keys())

    async def _served_keys(self) -> frozenset[str]:
        """What wakes this poll now: made again only when the client's devices changed
        (the served list is the same tuple until they do, `Api.served_devices`), as a
        renewal asks every minute for each waiting device."""
        devices = await self.api.served_devices(self.client)
        if devices is not self.devices:
            self.devices, self.keys = devices, _keys(self.client, devices)
        return self.keys

    async def answer(self) -> Response:
        """Held until the manifest changes or the wait runs out; then answered (and, run
        out, left as the renewal of the same request)."""
        until, self.until = self.until, None
        outcome = await self.api.waiters.hold(self.keys, self.wait, since=self.since,
                                              receive=self.receive, check=self.check,
                                              closing=self.closing, until=until)
        applied = wait_headers(self.wait, outcome)
        if outcome is Outcome.CHANGED:
            return _manifest(*self.latest, extra=applied)
        parked, self.parked = self.parked, None
        if outcome is Outcome.TIMEOUT and parked is not None:
            parked.renewal = self
        return _not_modified(self.latest[1], extra=applied)

    def hold_soon(self, then: Callable[[Outcome], None]) -> SoonHold | None:
        """Held again as `answer` would, without a coroutine (`Waiters.hold_soon`)."""
        if self.closing is None:
            return None
        return self.api.waiters.hold_soon(self.keys, self.wait, since=self.since,
                                          closing=self.closing, then=then)

    def timed_out(self) -> Response:
        """The answer once its wait ran out unchanged (what `answer` answers then): made
        once for each ETag, since a waiting device's renewals answer the same 304 each
        minute until its manifest changes (only its headers are read: `wfm.server.wire`)."""
        etag = self.latest[1]
        if self.unchanged is None or self.unchanged[0] != etag:
            self.unchanged = etag, _not_modified(
                etag, extra=wait_headers(self.wait, Outcome.TIMEOUT))
        return self.unchanged[1]

    async def renew(self, scope: Scope, receive: Receive) -> _HeldPoll | None:
        """This poll held again for `scope`, the same request again on its connection, when
        its caller is still admitted and its manifest unchanged: what its handler would
        have done, without the stack (`wfm.admission.parking`). None otherwise: the stack
        answers it, as any request (a new manifest; a refusal or a failing store, raised
        here, too)."""
        await self.admitted()
        self.api.polls.seen(self.client.client_id)
        since = self.api.waiters.mark()
        latest = await self.current()
        if not etag_matches(self.condition, latest[1]):
            return None
        await self._served_keys()
        self.since, self.latest, self.receive = since, latest, receive
        self.closing, self.parked = scope.get(CLOSING_SCOPE_KEY), parking_slot(scope)
        return self


def _keys(client: Client, devices: tuple[str, ...]) -> frozenset[str]:
    """What wakes the client's held poll: the client itself and each of its devices."""
    return frozenset((client_key(client.client_id), *map(device_key, devices)))


def _headers(etag: str, extra: dict[str, str] | None) -> dict[str, str]:
    return {"ETag": etag, "Cache-Control": "private", **(extra or {})}


def _manifest(body: bytes, etag: str, *, extra: dict[str, str] | None = None) -> Response:
    return Response(body, media_type=MANIFEST_MEDIA_TYPE, headers=_headers(etag, extra))


def _not_modified(etag: str, *, extra: dict[str, str] | None = None) -> Response:
    return Response(status_code=304, headers=_headers(etag, extra))
