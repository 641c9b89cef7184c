"""Test kit: a server's figures, one sample of `GET /metrics` at a time, by the name it is
exposed under (labels included: `margo_waiting_polls_total{outcome="failed"}`)."""

from __future__ import annotations

import httpx

__all__ = ["figure", "held_polls", "renewals"]


def figure(source: str | httpx.Client, name: str, *, default: float | None = None) -> float:
    """The sample `name` of `GET /metrics` at `source`: a base URL, or a client (its base
    URL, TLS and credentials); `default` when the server exposes none, else the test
    fails. Behind the replicas' balancer each call reads the next replica."""
    if isinstance(source, str):
        text = httpx.get(f"{source}/metrics", timeout=10).text
    else:
        text = source.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    if default is None:
        raise AssertionError(f"no {name} in /metrics")
    return default


def held_polls(source: str | httpx.Client) -> int:
    """How many waiting polls the server at `source` holds now."""
    return int(figure(source, "margo_waiting_polls_held"))


def renewals(source: str | httpx.Client, matched: str | None = None) -> float:
    """Waiting polls renewed by the server at `source` (`wfm.admission.parking`): those
    matched by their bytes (`wfm.server.wire`), by their parsed request, or (None) both."""
    if matched is not None:
        return figure(source, f'margo_waiting_polls_renewed_total{{matched="{matched}"}}')
    return renewals(source, "bytes") + renewals(source, "request")
