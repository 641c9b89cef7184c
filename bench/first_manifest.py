"""Benchmark: how soon after a full compile's branches move a fleet server serves the new
state, at fleet scale.

    .venv/bin/python -m bench.first_manifest [--devices 100000] [--store sqlite|replicas]
        [--fleet DIR] [--root DIR] [--timeout 1800]

Stores the devices of `bench/compile.py`'s synthetic fleet in a server's SQLite store (each
device its own client, as reported; untimed), starts a real `margo serve` on it with the
fleet's source (`--source`): it compiles every device at start. Meanwhile one device polls
its manifest (rc.3 REST, its own bearer token) every 20 ms, and the benchmark watches the
repository's `packed-refs`, which the compile rewrites once, by one rename, when every
branch moves. Prints the compile's duration as the server logs it and the seconds from the
branches moving (the file's modification time) to the first manifest naming the device's
deployments (issue 35: ≤ 2 s at 100,000 devices).

`--store replicas`: the same fleet in a PostgreSQL database of its own (`tools.postgres`,
untimed) and two `margo serve` replicas on it; the device polls both. The branches move
in the compiling replica's work repository (`compile/`); printed are the seconds from then
to the first manifest on the replica that compiled and on the other one (which learns of
the new generation from the database and syncs).

`--fleet DIR`: a fleet this benchmark generated before (`DIR/source`,
`DIR/capabilities.json`, e.g. kept by `bench/compile.py`'s generator with the same seed),
used as it is (read, never written) instead of generating one: at 1,000,000 devices
generating takes minutes and 450 MB. `--devices` is then only the printed count.
`--root DIR`: work there (a new, empty directory, kept afterwards with the server's log,
`server-<port>.log`) instead of in a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.compile import generate
from bench.server_snapshot import store_reports
from tools.margoserver import margo_server
from tools.postgres import running_postgres
from tools.replicas import Replica
from wfm.identity.clients import ClientRegistry
from wfm.store.opening import open_database

ROOT = Path(__file__).resolve().parents[1]
POLLED = "device-00042"


def store_fleet(database: Path | str, caps: Path) -> str:
    """Every device reported by a client of its own id; the polled device's token."""
    db = open_database(database)
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


def first_on_replicas(replicas: list[Replica], token: str,
                      timeout: float) -> tuple[float, dict[int, float]]:
    """(when the compiling replica moved its branches, when each replica first served a
    manifest naming a deployment), epoch s."""
    deadline = time.monotonic() + timeout
    served: dict[int, float] = {}
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(httpx.Client(
            base_url=r.base, headers={"Authorization": f"Bearer {token}"}, timeout=30))
            for r in replicas]
        while len(served) < len(replicas) and time.monotonic() < deadline:
            for index, client in enumerate(clients):
                if index not in served:
                    answer = client.get("/api/v1/deployments")
                    if answer.status_code == 200 and answer.json().get("deployments"):
                        served[index] = time.time()
            time.sleep(0.02)
    moved = [os.stat(refs).st_mtime_ns / 1e9 for refs in
             (r.data / "compile" / "fleet-state.git" / "packed-refs" for r in replicas)
             if refs.exists()]
    if len(served) < len(replicas) or not moved:
        raise SystemExit(f"not every replica served a manifest within {timeout:.0f} s")
    return min(moved), served


@contextlib.contextmanager
def running_replicas(root: Path, source: Path, caps: Path) -> Iterator[tuple[list[Replica],
                                                                           str]]:
    """Two replicas on a PostgreSQL of their own holding the fleet; the polled token."""
    with running_postgres() as postgres:
        url = postgres.create_database("bench")
        token = store_fleet(url, caps)
        replicas = [Replica(root / "data" / f"replica-{i}",
                            ("--database", url, "--source", str(source)), log_level="info")
                    for i in range(2)]
        try:  # started together: each waits to be ready, which may take the first compile
            with ThreadPoolExecutor(len(replicas)) as pool:
                list(pool.map(Replica.start, replicas))
            yield replicas, token
        finally:
            for replica in replicas:
                replica.stop()


def measure_replicas(root: Path, source: Path, caps: Path, timeout: float) -> str:
    with running_replicas(root, source, caps) as (replicas, token):
        moved, served = first_on_replicas(replicas, token, timeout)
        compiled = [i for i, r in enumerate(replicas) if "compiled:" in r.log.read_text()]
    first = compiled[0] if compiled else min(served, key=served.__getitem__)
    other = 1 - first
    return (f"first manifest {served[first] - moved:.2f} s after the branches moved on the "
            f"compiling replica, {served[other] - moved:.2f} s on the other")


def measure_sqlite(root: Path, source: Path, caps: Path, timeout: float) -> str:
    data = root / "data"
    data.mkdir()
    setup = time.time()
    token = store_fleet(data / "wfm.sqlite", caps)
    started = time.time()
    with margo_server(data, "--source", str(source), log_dir=root, log_level="info",
                      cwd=ROOT) as server:
        moved, served = first_manifest(server.url, token,
                                       data / "repos" / "fleet-state.git" / "packed-refs",
                                       timeout)
        logged = [line.split("compiled:")[1].strip()
                  for line in server.log.read_text().splitlines() if "compiled:" in line]
    return (f"reports stored in {started - setup:.1f} s (untimed); "
            f"the server's first compile moved the branches {moved - started:.1f} s after it "
            f"started ({logged[0] if logged else 'not logged'}); first manifest "
            f"{served - moved:.2f} s after the branches moved")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=100_000)
    parser.add_argument("--store", choices=("sqlite", "replicas"), default="sqlite")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds to wait for the first manifest")
    parser.add_argument("--fleet", type=Path, default=None,
                        help="a generated fleet to use (DIR/source, DIR/capabilities.json)")
    parser.add_argument("--root", type=Path, default=None,
                        help="work in this new directory and keep it (the server's log)")
    return parser.parse_args()


@contextlib.contextmanager
def work_directory(root: Path | None) -> Iterator[Path]:
    """`root` (created, must not exist yet, kept), else a temporary directory (removed)."""
    if root is not None:
        root.mkdir(parents=True)
        yield root.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="margo-bench-first-") as tmp:
        yield Path(tmp)


def main() -> None:
    args = parse_args()
    with work_directory(args.root) as root:
        if args.fleet is not None:
            source, caps = args.fleet / "source", args.fleet / "capabilities.json"
            if not source.is_dir() or not caps.is_file():
                raise SystemExit(f"{args.fleet}: no source/ and capabilities.json")
        else:
            source, caps = generate(root, args.devices, 20, 30)
        measure = measure_replicas if args.store == "replicas" else measure_sqlite
        print(f"{args.devices:,} devices, {args.store}: "
              f"{measure(root, source, caps, args.timeout)}", flush=True)


if __name__ == "__main__":
    main()
