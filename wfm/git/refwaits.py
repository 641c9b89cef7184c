"""The ref advertisement's validator and waiting polls, for Git-source devices.

`GET .../info/refs?service=git-upload-pack` carries an ETag naming what it advertises: the
device branch and its tip (weak, `W/"sha256:..."`: the advertisement's bytes also depend on
the protocol version and Git's capabilities, its meaning only on the tip). A request with
`If-None-Match` naming it is answered 304, and one that also carries `Prefer: wait=N` is
held until the branch moves or N seconds pass, as the REST manifests' waiting polls are
(`wfm.fleet.waiters`). Git itself never sends either header, so a plain `git fetch` or
`git clone` is served exactly as before; the device client (`reconciler.sources.git_refs`)
sends both, and fetches with Git only once the tip moved. Every generation's devices can
use it: Oct-2024 devices know only Git.

A device without a branch has nothing to wait on (404, as before): it learns its first
state at its next poll.

An advertisement answered 304 after its wait leaves itself on its connection as the renewal
of the same request (`wfm.admission.parking`): the device's next poll, byte for byte the
same, is authorized again and held again without going through the request stack.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from wfm.admission.parking import PARKED, ParkingSlot, park, parking_slot
from wfm.fleet.waiters import (
    CLOSING_SCOPE_KEY,
    DEFAULT_MAX_WAIT,
    Closing,
    Outcome,
    SoonHold,
    Waiters,
    device_key,
    prefer_values,
    requested_wait,
    wait_headers,
)
from wfm.identity.proofs import SIGNED_SCOPE_KEY

__all__ = ["Fresh", "RefWaits", "refs_etag"]

#: Headers added to a ref advertisement (names lowercase, as ASGI sends them).
Headers = list[tuple[bytes, bytes]]
#: The device branch's tip now (None: it has none any more).
TipOf = Callable[[], Awaitable[str | None]]
#: The advertisement served afresh after a held request's branch moved, saying the wait
#: was applied (the `Preference-Applied` value).
Fresh = Callable[[str], Awaitable[Response]]
#: Raises what the caller would be refused with now (a retired client, a replaced token).
Authorized = Callable[[], Awaitable[None]]


def refs_etag(ref: str, tip: str) -> str:
    """The advertisement's validator: the branch and its tip, digested."""
    digest = hashlib.sha256(f"{ref} {tip}".encode()).hexdigest()
    return f'W/"sha256:{digest}"'


def _matches(condition: str | None, etag: str) -> bool:
    """Weak comparison (RFC 9110, 13.1.2), as `If-None-Match` is always evaluated."""
    if not condition:
        return False
    wanted = etag.removeprefix("W/")
    return any(c.strip() == "*" or c.strip().removeprefix("W/") == wanted
               for c in condition.split(","))


class RefWaits:
    """Conditional and waiting ref advertisements over one server's `Waiters`."""

    def __init__(self, waiters: Waiters | None = None, *,
                 max_wait: float = DEFAULT_MAX_WAIT,
                 epoch: Callable[[], object] = lambda: None) -> None:
        """`epoch()`: the server's credentials epoch (`wfm.identity.credentialcache`): a
        held request's caller is authorized again after a wake that finds it moved."""
        self.waiters, self.max_wait, self.epoch = waiters, max_wait, epoch

    def mark(self) -> int:
        """Before the tip is read (`Waiters.mark`: a move after it is not missed)."""
        return self.waiters.mark() if self.waiters is not None else 0

    async def answer(self, request: Request, device_id: str, ref: str, tip: str,
                     tip_of: TipOf, fresh: Fresh, *, since: int, authorized: Authorized,
                     applied: str | None = None) -> Response | Headers:
        """Before Git advertises `tip` (read after `since` was `mark`ed): a 304 when the
        caller holds it (after holding a waiting poll until the branch moves: then what
        `fresh` serves), else the headers the advertisement gets. `applied`: this is the
        advertisement served after a held request, which is not held again. A held
        request waits outside the ASGI stack (`wfm.admission.parking`): its handler
        returns `PARKED`; `Parking` sends the answer the hold comes to. A
        held request whose caller would now be refused (`authorized` raises, asked after
        a wake once the credentials `epoch` moved) ends with that refusal."""
        etag = refs_etag(ref, tip)
        extra = {"Preference-Applied": applied} if applied else {}
        if not _matches(request.headers.get("if-none-match"), etag):
            return [(name.lower().encode(), value.encode())
                    for name, value in {"ETag": etag, **extra}.items()]
        wait = None
        if self.waiters is not None and applied is None:
            wait = requested_wait(prefer_values(request.scope["headers"]),
                                  limit=self.max_wait)
        if not wait or self.waiters is None:
            return _not_modified(etag, extra)
        held = _HeldAdvertisement(self.waiters, device_id, tip, etag, wait, since, tip_of,
                                  fresh, request.receive, request.scope.get(CLOSING_SCOPE_KEY),
                                  self.epoch, authorized)
        slot = park(request.scope, held.answer)
        if slot is None:
            return await held.answer()
        if request.scope.get(SIGNED_SCOPE_KEY) is None:  # a signature is checked every time
            held.parked = slot
        return PARKED


class _HeldAdvertisement:
    """A waiting ref advertisement while it is held (one object: see
    `wfm.http.manifest_waits._HeldPoll`); and, answered 304 after its wait, the renewal of
    the same request (module docstring)."""

    __slots__ = ("authorized", "closing", "epoch", "epoch_of", "etag", "fresh", "keys",
                 "parked", "receive", "since", "tip", "tip_of", "until", "wait", "waiters")

    def __init__(self, waiters: Waiters, device_id: str, tip: str, etag: str, wait: int,
                 since: int, tip_of: TipOf, fresh: Fresh, receive: Receive,
                 closing: Closing | None, epoch_of: Callable[[], object],
                 authorized: Authorized) -> None:
        """`authorized()` is asked after a wake that finds `epoch_of()` moved since."""
        self.waiters, self.keys = waiters, frozenset((device_key(device_id),))
        self.tip, self.etag, self.wait, self.since = tip, etag, wait, since
        self.tip_of, self.fresh, self.receive, self.closing = tip_of, fresh, receive, closing
        self.epoch_of, self.epoch, self.authorized = epoch_of, epoch_of(), authorized
        self.parked: ParkingSlot | None = None  # where a parked one leaves its renewal
        self.until: float | None = None  # the next hold's end, when it continues one

    async def check(self) -> tuple[bool, frozenset[str]]:
        """After a wake: whether the branch moved (the caller authorized again first, if
        credentials changed since it was: its refusal is raised)."""
        epoch = self.epoch_of()
        if epoch != self.epoch:
            self.epoch = epoch
            await self.authorized()
        return await self.tip_of() != self.tip, self.keys

    async def answer(self) -> Response:
        """Held until the branch moves (then served afresh) or the wait runs out (304)."""
        until, self.until = self.until, None
        outcome = await self.waiters.hold(self.keys, self.wait, since=self.since,
                                          receive=self.receive, check=self.check,
                                          closing=self.closing, until=until)
        applied = wait_headers(self.wait, outcome)
        if outcome is Outcome.CHANGED:
            return await self.fresh(applied["Preference-Applied"])
        parked, self.parked = self.parked, None
        if outcome is Outcome.TIMEOUT and parked is not None:
            parked.renewal = self
        return _not_modified(self.etag, applied)

    def hold_soon(self, then: Callable[[Outcome], None]) -> SoonHold | None:
        """Held again as `answer` would, without a coroutine (`Waiters.hold_soon`)."""
        if self.closing is None:
            return None
        return self.waiters.hold_soon(self.keys, self.wait, since=self.since,
                                      closing=self.closing, then=then)

    def timed_out(self) -> Response:
        """The answer once its wait ran out unchanged (what `answer` answers then)."""
        return _not_modified(self.etag, wait_headers(self.wait, Outcome.TIMEOUT))

    async def renew(self, scope: Scope, receive: Receive) -> _HeldAdvertisement | None:
        """This advertisement held again for `scope`, the same request again on its
        connection, when its caller is still authorized (as a request arriving now: its
        credentials, and the device still its own) and the branch has not moved: what
        the handler would have done, without the stack (`wfm.admission.parking`). None
        otherwise (or the refusal raised): the stack answers it, as any request."""
        epoch = self.epoch_of()
        await self.authorized()
        since = self.waiters.mark()
        if await self.tip_of() != self.tip:
            return None
        self.epoch, self.since, self.receive = epoch, since, receive
        self.closing, self.parked = scope.get(CLOSING_SCOPE_KEY), parking_slot(scope)
        return self


def _not_modified(etag: str, extra: dict[str, str] | None = None) -> Response:
    return Response(status_code=304, headers={"ETag": etag, "Cache-Control": "no-cache",
                                              **(extra or {})})
