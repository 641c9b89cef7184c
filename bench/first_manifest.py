"""Benchmark: how soon after a full compile's branches move a fleet server serves the new
state, at fleet scale.

    .venv/bin/python -m bench.first_manifest [--devices 100000]

Stores the devices of `bench/compile.py`'s synthetic fleet in a server's SQLite store (each
device its own client, as reported; untimed), starts a real `margo serve` on it with the
fleet's source (`--source`): it compiles every device at start. Meanwhile one device polls
its manifest (rc.3 REST, its own bearer token) every 20 ms, and the benchmark watches the
repository's `packed-refs`, which the compile rewrites once, by one rename, when every
branch moves. Prints the compile's duration as the server logs it and the seconds from the
branches moving (the file's modification time) to the first manifest naming the device's
deployments (issue 35: ≤ 2 s at 100,000 devices).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx

from bench.compile import generate
from bench.server_snapshot import store_reports
from tools.margoserver import margo_server
from wfm.identity.clients import ClientRegistry
from wfm.store.opening import open_database

ROOT = Path(__file__).resolve().parents[1]
POLLED = "device-00042"


def store_fleet(data: Path, caps: Path) -> str:
    """Every device reported by a client of its own id; the polled device's token."""
    db = open_database(data / "wfm.sqlite")
    try:
        store_reports(db, caps, lambda device_id: device_id)
        _, token = ClientRegistry(db).add(POLLED)
        return token
    finally:
        db.close()


def first_manifest(url: str, token: str, refs: Path, timeout: float) -> tuple[float, float]:
    """(when packed-refs was written, when the manifest first named a deployment), epoch s."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                      timeout=30) as client:
        while time.monotonic() < deadline:
            answer = client.get("/api/v1/deployments")
            served = time.time()
            if answer.status_code == 200 and answer.json().get("deployments"):
                return os.stat(refs).st_mtime_ns / 1e9, served
            time.sleep(0.02)
    raise SystemExit(f"no manifest with deployments within {timeout:.0f} s")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds to wait for the first manifest")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="margo-bench-first-") as tmp:
        root = Path(tmp)
        source, caps = generate(root, args.devices, 20, 30)
        data = root / "data"
        data.mkdir()
        token = store_fleet(data, caps)
        started = time.time()
        with margo_server(data, "--source", str(source), log_dir=root, log_level="info",
                          cwd=ROOT) as server:
            moved, served = first_manifest(server.url, token,
                                           data / "repos" / "fleet-state.git" / "packed-refs",
                                           args.timeout)
            logged = [line.split("compiled:")[1].strip()
                      for line in server.log.read_text().splitlines() if "compiled:" in line]
        print(f"{args.devices:,} devices: the server's first compile moved the branches "
              f"{moved - started:.1f} s after it started ({logged[0] if logged else 'not logged'}"
              f"); first manifest {served - moved:.2f} s after the branches moved", flush=True)


if __name__ == "__main__":
    main()
