"""Git backends (the hosted source's and the device hosting's): their answer is passed on
even when they exit before reading the request body (with uvloop, as the server runs,
writing to them then raises)."""

from __future__ import annotations

import asyncio

import uvloop

from wfm.git.backend import write_to_backend
from wfm.git.sourcehost import _communicate


async def _answer_of_a_backend_that_has_exited(feed) -> bytes:  # type: ignore[no-untyped-def]
    process = await asyncio.create_subprocess_exec(
        "sh", "-c", "printf 'Status: 405\\r\\n\\r\\nno'", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    await process.wait()  # it has exited without reading anything
    return await feed(process, b"x" * 10)


def test_a_backend_that_exits_without_reading_its_input_is_answered() -> None:
    assert uvloop.run(_answer_of_a_backend_that_has_exited(_communicate)) == (
        b"Status: 405\r\n\r\nno")


def test_asyncio_communicate_is_what_failed_there() -> None:
    """Why `_communicate` exists: `communicate` raises in the same situation (if uvloop
    stops raising, this fails and `_communicate` can go)."""
    async def communicate(process, body):  # type: ignore[no-untyped-def]
        return (await process.communicate(body))[0]

    try:
        uvloop.run(_answer_of_a_backend_that_has_exited(communicate))
    except RuntimeError as exc:
        assert "handler is closed" in str(exc)
    else:
        raise AssertionError("communicate no longer fails: _communicate may be unneeded")


def test_writing_to_a_backend_that_has_exited_says_so() -> None:
    """The device hosting feeds request bodies through the same helper: under uvloop a
    backend that stopped reading is reported (False), not raised as a server error."""
    async def write() -> bool:
        process = await asyncio.create_subprocess_exec(
            "true", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL)
        await process.wait()
        assert process.stdin is not None
        return await write_to_backend(process.stdin, b"x" * 10)

    assert uvloop.run(write()) is False
