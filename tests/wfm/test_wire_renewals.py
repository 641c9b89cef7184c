"""Renewals answered below the request cycle (issue 34; `wfm.server.wire`): a waiting
device's renewal that arrives in one read, byte for byte the request it renews, is held
again without being parsed, and answered by a request cycle of uvicorn's own. What must hold
on the wire, against the real `margo serve`: bytes that are not exactly one whole request
(a request in two reads, two requests in one) are parsed as always and every request is
answered in order; a server that stops answers such a held renewal at once and closes the
connection; a client that goes away is released; a connection idle after such an answer is
closed after the server's keep-alive timeout. Each test reads which way a renewal was
matched from `margo_waiting_polls_renewed_total{matched}`, so it fails if the way changes.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.fleetserver import FleetServer, one_device_server
from kits.metricskit import figure, held_polls
from kits.serverkit import add_client, margo, store_args, use_store

from tools.margoserver import margo_server
from tools.polling import poll_until

MANIFEST = "application/vnd.margo.manifest.v1+json"
RC3 = "/api/v1/deployments"
DEVICE = "wire-1"
#: The server's keep-alive timeout in these tests (seconds).
KEEP_ALIVE = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    with one_device_server(tmp_path_factory.mktemp("wire"), DEVICE,
                           extra_args=("--keep-alive", str(KEEP_ALIVE))) as running:
        yield running


class Wire:
    """One connection to the server, written as given and read as HTTP/1.1 answers."""

    def __init__(self, base: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.buffer = b""

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def send(self, *pieces: bytes) -> None:
        """Each piece in a write of its own, a moment apart (each arrives in a read)."""
        for index, piece in enumerate(pieces):
            if index:
                time.sleep(0.3)
            self.sock.sendall(piece)

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        """The next answer: its status, headers (names lowercase) and body."""
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip()
                   for name, _, value in (line.partition(":") for line in lines)}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            self._read()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status.split()[1]), headers, body

    def closed_by_server(self) -> bool:
        """Whether the server closed the connection (waits for it, up to the timeout)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def _read(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buffer += data


def waiting_poll(token: str, etag: str, wait: int = 1) -> bytes:
    return (f"GET {RC3} HTTP/1.1\r\nHost: margo\r\nAuthorization: Bearer {token}\r\n"
            f"Accept: {MANIFEST}\r\nIf-None-Match: {etag}\r\nPrefer: wait={wait}\r\n\r\n"
            ).encode()


def plain_poll(token: str, etag: str) -> bytes:
    return (f"GET {RC3} HTTP/1.1\r\nHost: margo\r\nAuthorization: Bearer {token}\r\n"
            f"Accept: {MANIFEST}\r\nIf-None-Match: {etag}\r\n\r\n").encode()


def renewed(base: str, matched: str) -> float:
    return figure(base, f'margo_waiting_polls_renewed_total{{matched="{matched}"}}')


def counts(base: str) -> tuple[float, float]:
    """Renewals so far matched by their bytes, and by their parsed request."""
    return renewed(base, "bytes"), renewed(base, "request")


def held_304(wire: Wire, wait: int = 1) -> dict[str, str]:
    """The next answer, checked to be a held poll's 304; its headers but the date."""
    status, headers, body = wire.answer()
    assert (status, headers.get("preference-applied"), body) == (304, f"wait={wait}", b"")
    return {name: value for name, value in headers.items() if name != "date"}


@contextlib.contextmanager
def held_once(server: FleetServer, wait: int = 1) -> Iterator[tuple[Wire, bytes, dict[str, str]]]:
    """A connection whose waiting poll (of `wait`) was held and answered 304 once: (the
    connection, that poll's bytes, the answer's headers but the date)."""
    _, etag = server.manifest()
    request = waiting_poll(server.token, etag, wait)
    with Wire(server.base) as wire:
        wire.send(request)
        yield wire, request, held_304(wire, wait)


def test_the_same_bytes_again_are_renewed_unparsed_and_answered_as_before(
        server: FleetServer) -> None:
    before = counts(server.base)
    with held_once(server) as (wire, request, first):
        for _ in range(2):
            wire.send(request)
            assert held_304(wire) == first
    assert counts(server.base) == (before[0] + 2, before[1])


def test_a_renewal_in_two_reads_is_parsed_and_the_next_whole_one_is_not(
        server: FleetServer) -> None:
    with held_once(server) as (wire, request, first):
        bytes_before, parsed_before = counts(server.base)
        wire.send(request[:20], request[20:])  # the same request, arriving in two reads
        assert held_304(wire) == first
        assert counts(server.base) == (bytes_before, parsed_before + 1)
        wire.send(request)  # whole again: its bytes were not seen whole before, parsed
        assert held_304(wire) == first
        assert counts(server.base) == (bytes_before, parsed_before + 2)
        wire.send(request)  # and now they were
        assert held_304(wire) == first
        assert counts(server.base) == (bytes_before + 1, parsed_before + 2)


def test_two_requests_in_one_read_are_parsed_and_answered_in_order(
        server: FleetServer) -> None:
    _, etag = server.manifest()
    with held_once(server) as (wire, request, first):
        bytes_before, _ = counts(server.base)
        wire.send(request + plain_poll(server.token, etag))
        assert held_304(wire) == first
        status, headers, _ = wire.answer()  # the plain poll, answered once the first was
        assert (status, headers["etag"], "preference-applied" in headers) == (304, etag, False)
        assert renewed(server.base, "bytes") == bytes_before


def test_a_client_gone_during_a_renewal_is_released(server: FleetServer) -> None:
    gone = figure(server.base, 'margo_waiting_polls_total{outcome="gone"}')
    with held_once(server, wait=4) as (wire, request, _):
        bytes_before, _ = counts(server.base)
        wire.send(request)
        poll_until("the renewal held", lambda: held_polls(server.base) == 1)
        assert renewed(server.base, "bytes") == bytes_before + 1
    poll_until("the renewal released", lambda: held_polls(server.base) == 0)
    assert figure(server.base, 'margo_waiting_polls_total{outcome="gone"}') == gone + 1


def test_a_connection_idle_after_a_renewal_is_closed_after_the_keep_alive_timeout(
        server: FleetServer) -> None:
    with held_once(server) as (wire, request, _):
        bytes_before, _ = counts(server.base)
        wire.send(request)
        held_304(wire)
        answered = time.monotonic()
        assert renewed(server.base, "bytes") == bytes_before + 1
        assert wire.closed_by_server()
    assert KEEP_ALIVE - 0.5 <= time.monotonic() - answered < 20


def test_a_request_sent_while_a_renewal_is_held_is_answered_after_its_whole_wait(
        server: FleetServer) -> None:
    """A renewal held on the wire (no request cycle) goes on in one when more arrives on its
    connection: held to the same deadline (neither answered early nor held anew), then
    the request that came meanwhile answered, in order."""
    _, etag = server.manifest()
    with held_once(server, wait=3) as (wire, request, first):
        bytes_before, _ = counts(server.base)
        wire.send(request)
        sent = time.monotonic()
        poll_until("the renewal held", lambda: held_polls(server.base) == 1)
        wire.send(plain_poll(server.token, etag))
        assert held_304(wire, wait=3) == first
        assert 3 * (1 - 1 / 20) - 0.5 <= time.monotonic() - sent < 3 + 2
        status, headers, _ = wire.answer()
        assert (status, headers["etag"], "preference-applied" in headers) == (304, etag, False)
        assert renewed(server.base, "bytes") == bytes_before + 1


def test_a_change_while_a_renewal_is_held_is_answered_on_its_connection(
        server: FleetServer) -> None:
    """A push wakes a renewal held on the wire: answered 200 with the new manifest at once,
    and the connection serves on."""
    with held_once(server, wait=15) as (wire, request, first):
        bytes_before, _ = counts(server.base)
        wire.send(request)
        poll_until("the renewal held", lambda: held_polls(server.base) == 1)
        assert renewed(server.base, "bytes") == bytes_before + 1
        changed = time.monotonic()
        server.set_parameter(DEVICE, "greeting", f"wire {changed}")
        status, headers, body = wire.answer()  # (before its wait ran out: else a 304)
        assert (status, headers["preference-applied"]) == (200, "wait=15"), body
        assert headers["etag"] != first["etag"]
        wire.send(plain_poll(server.token, headers["etag"]))
        assert wire.answer()[0] == 304


def test_a_client_retired_while_its_renewal_is_held_is_refused(tmp_path: Path) -> None:
    """Retiring the client (`margo clients retire`, another process) refuses the renewal
    it holds on the wire, as the stack refuses a request arriving now (before its wait ran
    out: else a 304)."""
    with one_device_server(tmp_path, DEVICE) as running, held_once(running, wait=10) as (
            wire, request, _):
        wire.send(request)
        poll_until("the renewal held", lambda: held_polls(running.base) == 1)
        assert renewed(running.base, "bytes") == 1
        data = running.data_dir
        margo("clients", "retire", running.client_id, "--data", str(data),
              *store_args(data))
        status, headers, _ = wire.answer()
        assert (status, headers["content-type"]) == (403, "application/problem+json")


def test_a_stopping_server_answers_a_renewal_it_holds_at_once(tmp_path: Path) -> None:
    """SIGTERM while a renewal is held unparsed: it is answered 304 right away (its wait
    far from over), with `connection: close`, and the server exits cleanly."""
    with use_store("sqlite"):
        token = add_client(tmp_path / "data", "edge")
    with margo_server(tmp_path / "data") as process:
        etag = poll_until("a manifest", lambda: _etag(process.url, token))
        request = waiting_poll(token, etag, wait=6)
        with Wire(process.url) as wire:
            wire.send(request)
            held_304(wire, wait=6)
            wire.send(request)
            poll_until("the renewal held", lambda: held_polls(process.url) == 1)
            assert renewed(process.url, "bytes") == 1
            stopped = time.monotonic()
            process.process.send_signal(signal.SIGTERM)
            status, headers, _ = wire.answer()
            assert time.monotonic() - stopped < 5
            assert (status, headers["connection"]) == (304, "close")
            assert wire.closed_by_server()
        assert process.process.wait(timeout=30) in (0, -signal.SIGTERM)
    log = process.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log


def _etag(base: str, token: str) -> str | None:
    with Wire(base) as wire:
        wire.send((f"GET {RC3} HTTP/1.1\r\nHost: margo\r\nAuthorization: Bearer {token}\r\n"
                   f"Accept: {MANIFEST}\r\n\r\n").encode())
        status, headers, _ = wire.answer()
    return headers["etag"] if status == 200 else None


def test_a_renewal_answered_on_the_wire_is_in_the_access_log(tmp_path: Path) -> None:
    """At `--log-level info` a renewal answered on the wire is logged as uvicorn logs the
    answers of its request cycles (the wire builds the line only when it is kept)."""
    with one_device_server(tmp_path, DEVICE, extra_args=("--log-level", "info")) as server:
        before = counts(server.base)
        with held_once(server) as (wire, request, _):
            wire.send(request)
            held_304(wire)
        assert counts(server.base)[0] == before[0] + 1  # the renewal was answered on the wire
        log = server.data_dir.parent / f"server-{server.base.rsplit(':', 1)[1]}.log"
        answered = f'"GET {RC3} HTTP/1.1" 304'
        poll_until("both 304s in the access log",
                   lambda: log.read_text(errors="replace").count(answered) >= 2, timeout=10)
