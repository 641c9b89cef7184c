"""Remembered token lookups (`wfm.identity.credentialcache`): a running server keeps answering from
what it remembers, and still refuses a retired client or a replaced token within about a
second of the write that changed it, whichever process made that write (here `margo
clients`, beside the running server). test_credential_cache_replicas.py runs the server test
on two replicas, where the epoch is shared through PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.serverkit import add_client, margo, running_server, store_args

from tools.polling import poll_until
from wfm.identity import credentialcache
from wfm.identity.clients import ClientRegistry, TokenLookup, token_hash
from wfm.identity.credentialcache import CredentialCache
from wfm.store.sqlitedb import SqliteDatabase


def _status(base: str, token: str) -> int:
    return httpx.get(f"{base}/api/v1/deployments", timeout=10,
                     headers={"Authorization": f"Bearer {token}"}).status_code


def test_a_retired_client_and_a_replaced_token_are_refused_within_seconds(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    tokens = {name: add_client(data, name) for name in ("edge-1", "edge-2")}
    with running_server(data) as base:
        assert _status(base, tokens["edge-1"]) == 200 and _status(base, tokens["edge-2"]) == 200
        margo("clients", "retire", "edge-1", "--data", str(data), *store_args(data))
        retired_at = time.monotonic()
        # Four answers in a row: on replicas behind the round-robin balancer, both of them.
        poll_until("the retired client refused", lambda: all(
            _status(base, tokens["edge-1"]) == 403 for _ in range(4)), timeout=10, interval=0.05)
        refused_after = time.monotonic() - retired_at
        assert _status(base, tokens["edge-2"]) == 200  # the others' lookups still stand

        old = tokens["edge-2"]
        tokens["edge-2"] = add_client(data, "edge-2")  # a new token replaces the old one
        poll_until("the replaced token refused", lambda: all(
            _status(base, old) == 401 for _ in range(4)), timeout=10, interval=0.05)
        assert all(_status(base, tokens["edge-2"]) == 200 for _ in range(4))
        tokens["edge-1"] = add_client(data, "edge-1", reactivate=True)  # a new token
        assert _status(base, tokens["edge-1"]) == 200
    # The bound is one epoch check (1 s) plus this machine's request latency, with room
    # for a busy test machine: the old two-second time-to-live would also pass, but a cache
    # that never noticed the write would not.
    assert refused_after < 8


@pytest.fixture
def registry(tmp_path: Path) -> ClientRegistry:
    return ClientRegistry(SqliteDatabase(tmp_path / "wfm.sqlite"))


def _cache(registry: ClientRegistry,
           lookup: Callable[[str], Awaitable[TokenLookup]] | None = None) -> CredentialCache:
    """A cache over `registry`'s queries (`lookup` instead of its token lookup)."""
    async def epoch() -> int:
        return registry.credentials_epoch()

    async def token_lookup(token: str) -> TokenLookup:
        return registry.token_lookup(token)

    return CredentialCache(epoch, lookup or token_lookup)


def test_a_lookup_that_straddles_a_retirement_is_not_kept(
        registry: ClientRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row is read before the retirement commits and the epoch is read after it, while
    the lookup is still out: that lookup must not be remembered under the new epoch."""
    monkeypatch.setattr(credentialcache, "EPOCH_CHECK_SECONDS", 0.0)
    _, token = registry.add("edge-1")
    _, other = registry.add("edge-2")

    async def straddling(t: str) -> TokenLookup:
        found = registry.token_lookup(t)
        if t == token and not found.client.retired:  # type: ignore[union-attr]
            registry.retire("edge-1")
            await cache.client(other)  # another request reads the moved epoch meanwhile
        return found

    cache = _cache(registry, straddling)

    async def run() -> tuple[bool, bool]:
        first = await cache.client(token)  # in flight across the retirement: answered as read
        second = await cache.client(token)
        assert first is not None and second is not None
        return first.retired, second.retired

    assert asyncio.run(run()) == (False, True)


def test_an_access_token_is_forgotten_when_it_expires(registry: ClientRegistry,
                                                      tmp_path: Path) -> None:
    registry.add("edge-1")
    db = SqliteDatabase(tmp_path / "wfm.sqlite")
    db.write_sync(lambda conn: conn.execute("INSERT INTO access_tokens VALUES (?, ?, ?)",
                                            (token_hash("short-lived"), "edge-1",
                                             time.time() + 1.0)))
    cache = _cache(registry)

    async def run() -> tuple[bool, bool]:
        before = await cache.client("short-lived")
        await asyncio.sleep(1.3)
        return before is not None, await cache.client("short-lived") is None

    assert asyncio.run(run()) == (True, True)


def test_writes_that_change_no_credential_leave_the_epoch_alone(
        registry: ClientRegistry) -> None:
    """A fleet onboarding new clients all day must not make every server forget every
    lookup: only writes that change what an existing token proves move the epoch."""
    start = registry.credentials_epoch()
    registry.add("edge-1")
    registry.add("edge-2")
    registry.ensure("edge-3")
    assert registry.credentials_epoch() == start
    registry.add("edge-1")
    assert registry.credentials_epoch() == start + 1
    registry.retire("edge-2")
    assert registry.credentials_epoch() == start + 2
    registry.register_identity("edge-2", spiffe_id="spiffe://x/edge-2", certificate="-",
                               not_after=0.0, source="issued")
    assert registry.credentials_epoch() == start + 3
    registry.register_identity("edge-3", spiffe_id="spiffe://x/edge-3", certificate="-",
                               not_after=0.0, source="issued")
    assert registry.credentials_epoch() == start + 3  # edge-3 was never retired


def test_whoever_waits_is_told_of_every_epoch_it_reads_anew(
        registry: ClientRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """`on_change` (held polls authenticate again): at the first read (a request may have
    been admitted by an SVID or a signature before any token lookup read it), at each move,
    and not when the epoch is unchanged; `refresh` reads it no more than once a second."""
    _, token = registry.add("edge-1")
    told: list[int | None] = []
    cache = CredentialCache(lambda: _async(registry.credentials_epoch()),
                            lambda t: _async(registry.token_lookup(t)),
                            on_change=lambda: told.append(cache.epoch))

    async def run() -> None:
        await cache.refresh()
        await cache.client(token)  # read within the second: not again
        monkeypatch.setattr(credentialcache, "EPOCH_CHECK_SECONDS", 0.0)
        await cache.refresh()  # unchanged
        registry.retire("edge-1")
        found = await cache.client(token)
        assert found is not None and found.retired

    start = registry.credentials_epoch()
    asyncio.run(run())
    assert told == [start, start + 1]


async def _async(value: Any) -> Any:
    return value


def test_watching_the_epoch_logs_a_store_that_fails_once_and_its_return(
        registry: ClientRegistry, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """While requests are held, the epoch is read every second; a store that cannot be read
    (a double: the real store cannot be made to fail on demand between two reads) is
    logged once, not every second, and once more when it answers; the first read that
    works tells `on_change`; nothing is read while nothing is held."""
    monkeypatch.setattr(credentialcache, "EPOCH_CHECK_SECONDS", 0.01)
    away, holding, reads, told = [True], [True], [0], [0]

    async def epoch() -> int:
        reads[0] += 1
        if away[0]:
            raise OSError("the store is away")
        return registry.credentials_epoch()

    cache = CredentialCache(epoch, lambda t: _async(registry.token_lookup(t)),
                            on_change=lambda: told.__setitem__(0, told[0] + 1))

    async def run() -> int:
        watching = asyncio.ensure_future(credentialcache.watch_epoch(cache, lambda: holding[0]))
        await asyncio.sleep(0.3)
        away[0] = False
        await asyncio.sleep(0.2)
        holding[0] = False
        await asyncio.sleep(0.05)
        idle_from = reads[0]
        await asyncio.sleep(0.2)
        watching.cancel()
        return reads[0] - idle_from

    with caplog.at_level("INFO", logger="margo.wfm.credentials"):
        read_while_idle = asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records if r.name == "margo.wfm.credentials"]
    assert sum("not read" in m for m in messages) == 1, messages
    assert sum("read again" in m for m in messages) == 1, messages
    assert reads[0] > 10 and read_while_idle == 0 and told[0] == 1
