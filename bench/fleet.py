"""Benchmark: a whole fleet takes up one pushed source change, on loopback.

    .venv/bin/python bench/fleet.py [--devices 10000] [--period 15] [--store sqlite|replicas|both]
        [--polling interval|waiting] [--wait 60] [--quiet 60] [--restart]

N simulated devices (default 10,000) speak the rc.3 REST protocol to real `margo serve`
processes: each reports its capabilities once, then polls its manifest every P seconds
(uniform jitter of ±`--jitter`, the first poll spread uniformly over [0, P)) with
`If-None-Match`; on a new `manifestVersion` it fetches the deployment YAMLs that changed (or
the bundle, `--fetch bundle`) and reports `installing` then `installed` for each, with the
new version adopted and its device named (as `margo device run` reports). Once every
device has installed its first deployment, an edit to the intent that every device
carries (`hello-everywhere`'s greeting) is committed and
`git push`ed to the server's hosted source (`--host-source`, the operator's own way in):
that moment is t = 0. Printed per store:

* t50 / t99 / t100: seconds from the push until 50 %, 99 %, 100 % of the devices have
  reported `installed` for a deployment carrying the edit (`--timeout` gives up and says how
  many got there); "first" is when the first new manifest was served (push, compile and
  publication, observed from outside);
* requests per second by kind over that window (capabilities, manifest 200, manifest 304,
  yaml or bundle, status) with their p99 latency, and every error by kind and status code;
* CPU seconds (user + sys, children included) of each server process and of PostgreSQL
  during the window, and each server's peak RSS (VmHWM, from /proc).

Polling (issue 34): `interval` (the default) is the above; `waiting` makes every device send
`Prefer: wait=N` (`--wait`) with its conditional polls, each over a connection of its own,
and pace itself as the real client does (bench/waiting.py). `--quiet S` measures S seconds
of steady state before the push (nothing changes; with waiting polls, once every device's
first held poll has run out): each server's CPU per minute, and PostgreSQL's. `--restart`
(SQLite, waiting devices) restarts the server after the push (SIGTERM, then a new process
on the same port and data) and measures how long until it holds every device's poll
again, with the errors the devices met meanwhile.

Stores: `sqlite` is one server process on its SQLite file; `replicas` is two server
processes on one PostgreSQL database (tools/postgres.py: a private server, fsync=off).
Replica devices are split between the two servers' ports directly, device i on replica
i % 2, as an L4 balancer with sticky connections would do: the Python balancer of the test
kits (tests/kits/balancer.py, one thread per connection, an httpx hop per request) would
cost the shared 2 cores more than a real one and is left out.

The load generator is one asyncio process (uvloop when installed) with the minimal
keep-alive HTTP/1.1 client of bench/serve.py: the devices behind one server share a bounded
pool of keep-alive connections (`--connections`, split between the servers; 0 gives each
device a connection of its own, kept open between polls at the server's default
`--keep-alive`, 75 s; the figures in docs/benchmarks.md were taken when the server closed
connections idle for 5 s, which made every device reconnect at each poll). Clients are
registered directly in the store, as bench/serve.py does. The target
(issue: 10,000 devices, P = 15 s, every device `installed` within 30 s of the push on this
2-core machine) is printed as met or missed, not turned into an exit status: that is
non-zero only when the harness fails or a store could not be measured at all (its devices
never all installed a first deployment: `--setup-timeout`, with what the servers' child
processes were doing then).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gzip
import io
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import waiting
from bench.serve import Connection, capabilities
from tools.margoserver import MargoServer, margo_server
from tools.postgres import running_postgres
from tools.processes import cpu_seconds, stop
from wfm.fleet.compiles import COLLECT_LATEST
from wfm.identity.clients import ClientRegistry
from wfm.store.database import Database
from wfm.store.opening import open_database

ROOT = Path(__file__).resolve().parents[1]

MANIFEST_PATH = "/api/v1/deployments"
MANIFEST_MEDIA_TYPE = "application/vnd.margo.manifest.v1+json"
OPERATOR_TOKEN = "fleet-bench-operator-token"
INTENT_FILE = "deployments/hello-everywhere.yaml"
GREETING = 'greeting: "Hello from '
EDITED_GREETING = 'greeting: "Hello again from '
#: What every deployment document carries after the push, and none before it.
MARKER = b"Hello again from"
#: What a server logs while nothing was pushed to its hosted source yet.
EXPECTED_WARNING = "fleet source not readable yet"
KINDS = ("capabilities", "manifest-200", "manifest-304", "yaml", "bundle", "status")
TRANSPORT_ERRORS = (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    OSError)
# The components of a deployment document (the canonical emitter's fixed indentation).
COMPONENT = re.compile(rb"^      - name: (\S+)$", re.MULTILINE)


class NotMeasured(RuntimeError):
    """The fleet never reached the steady state the push is measured from."""


# --- measuring ---------------------------------------------------------------------------

@dataclass
class Stats:
    """Requests by kind (count, latencies) and errors, for the current window."""

    counts: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)

    def record(self, kind: str, status: int, seconds: float) -> None:
        self.counts[kind] += 1
        self.latencies.setdefault(kind, []).append(seconds)
        if status >= 400:
            self.errors[f"{kind} {status}"] += 1

    def reset(self) -> None:
        self.counts, self.latencies, self.errors = Counter(), {}, Counter()
        self.started = time.monotonic()


def child_pids(parent: int) -> list[int]:
    """The live child processes of a process (PostgreSQL's backends, compile workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                if int(fields[1]) == parent:
                    found.append(int(entry.name))
    return found


def process_state(pid: int) -> str:
    """`S (sleeping) in futex_do_wait, 0.0 s CPU`, for messages."""
    with contextlib.suppress(OSError):
        state = next(line.split(":", 1)[1].strip()
                     for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("State:"))
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
        return f"{state} in {wchan}, {sum(cpu_seconds(pid)):.1f} s CPU"
    return "gone"


def tree_cpu(root: int) -> float:
    """User + sys CPU seconds of a process and its live children (PostgreSQL's backends),
    plus what its exited children used."""
    total = sum(cpu_seconds(root))
    for child in child_pids(root):
        with contextlib.suppress(OSError, IndexError):
            total += sum(cpu_seconds(child, children=False))
    return total


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(len(ordered) * fraction + 0.5) - 1))]


# --- the devices' side -------------------------------------------------------------------

class Pool:
    """Up to `size` keep-alive connections to one server, shared by the devices behind it.
    A connection the server closed (its keep-alive timeout) is replaced, and the request
    sent again once: every request the devices make is idempotent."""

    def __init__(self, port: int, size: int, stats: Stats) -> None:
        self.port, self.stats = port, stats
        self.slots = asyncio.Semaphore(size)
        self.idle: deque[Connection] = deque()

    async def request(self, method: str, path: str, headers: dict[str, str],
                      body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        async with self.slots:
            for attempt in (1, 2):
                connection = self.idle.popleft() if self.idle else None
                if connection is None or connection.reader.at_eof():
                    if connection is not None:
                        connection.close()
                    connection = await Connection.open(self.port)
                try:
                    status, reply, payload, _ = await connection.request(method, path,
                                                                         headers, body)
                except TRANSPORT_ERRORS:
                    connection.close()
                    if attempt == 2:
                        raise
                    self.stats.errors["reconnects (server closed an idle connection)"] += 1
                    continue
                if reply.get("connection", "").lower() == "close":
                    connection.close()
                else:
                    self.idle.append(connection)
                return status, reply, payload
        raise AssertionError("unreachable")


@dataclass(slots=True)
class Device:
    index: int
    device_id: str
    pool: Pool
    auth: str
    etag: str | None = None
    version: int = 0  # the manifestVersion installed last
    digests: dict[str, str] = field(default_factory=dict)  # deploymentId -> digest installed
    updated_at: float | None = None  # when it reported the edit installed
    # Waiting polls (bench/waiting.py): how the last poll ended (held, changed, plain, cut),
    # whether the server held one before, failures in a row.
    outcome: str | None = None
    holding: bool = False
    failures: int = 0


class Fleet:
    """The simulated devices, what they have installed, and the push they wait for."""

    def __init__(self, pools: list[Pool], tokens: list[str], args: argparse.Namespace,
                 stats: Stats) -> None:
        self.args, self.stats = args, stats
        self.devices = [Device(i, device_name(i), pools[i % len(pools)], f"Bearer {token}")
                        for i, token in enumerate(tokens)]
        self.ready = 0  # devices that installed a first deployment
        self.pushed_at: float | None = None
        self.first_manifest: float | None = None  # the first new manifest served, after t=0
        self.updated: list[float] = []  # seconds from the push, one per updated device
        self.all_updated = asyncio.Event()
        self.crashes: list[BaseException] = []  # harness bugs, raised after the run

    async def call(self, device: Device, kind: str, method: str, path: str,
                   headers: dict[str, str] | None = None,
                   body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        sent = {"Authorization": device.auth, **(headers or {})}
        start = time.monotonic()
        try:
            status, reply, payload = await device.pool.request(method, path, sent, body)
        except TRANSPORT_ERRORS as exc:
            self.stats.errors[f"{kind} transport ({type(exc).__name__})"] += 1
            raise
        if kind == "manifest":
            kind = f"manifest-{status}" if status in (200, 304) else "manifest"
        self.stats.record(kind, status, time.monotonic() - start)
        return status, reply, payload

    async def live(self, device: Device) -> None:
        """One device: capabilities once, then polls for as long as the run lasts."""
        try:
            await self.cycle(device)
        except Exception as exc:
            self.crashes.append(exc)
            raise

    async def cycle(self, device: Device) -> None:
        while not await self.report_capabilities(device):
            await asyncio.sleep(1)
        await asyncio.sleep(random.uniform(0, self.args.period))
        while True:
            retry = await self.poll(device)
            await asyncio.sleep(waiting.pause(self.args, device, retry))

    async def report_capabilities(self, device: Device) -> bool:
        body = json.dumps(capabilities(device.index)).encode()
        try:
            status, _, _ = await self.call(device, "capabilities", "PUT",
                                           f"/api/v1/capabilities/{device.device_id}",
                                           {"Content-Type": "application/json"}, body)
        except TRANSPORT_ERRORS:
            return False
        if status in (200, 201):
            return True
        if retry_after(status, {}) is None:  # refused for good: the harness is wrong
            raise RuntimeError(f"capabilities of {device.device_id}: {status}")
        return False

    async def poll(self, device: Device) -> float | None:
        """One manifest poll and what follows it; a delay other than the period when the
        server asked for one (Retry-After)."""
        headers = {"Accept": MANIFEST_MEDIA_TYPE, **waiting.prefer(self.args, device.etag)}
        if device.etag:
            headers["If-None-Match"] = device.etag
        try:
            status, reply, payload = await self.call(device, "manifest", "GET", MANIFEST_PATH,
                                                     headers)
            held = "preference-applied" in reply
            device.holding = device.holding or held
            device.outcome = "held" if held else "cut" if status >= 500 else "plain"
            if status == 200:
                device.outcome = "changed"
                return await self.install(device, json.loads(payload), reply.get("etag"))
        except TRANSPORT_ERRORS:
            device.outcome = "cut"
            return None
        return retry_after(status, reply)

    async def install(self, device: Device, manifest: dict[str, Any],
                      etag: str | None) -> float | None:
        version = int(manifest["manifestVersion"])
        if self.pushed_at is not None and self.first_manifest is None and \
                version > device.version:
            self.first_manifest = time.monotonic() - self.pushed_at
        wanted = {d["deploymentId"]: d for d in manifest["deployments"]}
        new = [d for i, d in wanted.items() if device.digests.get(i) != d["digest"]]
        documents, retry = await self.fetch(device, manifest, new)
        if documents is None:
            return retry
        for deployment in new:
            document = documents[deployment["deploymentId"]]
            for state in ("installing", "installed"):
                stored, retry = await self.report_status(device, deployment["deploymentId"],
                                                         version, state, document)
                if not stored:
                    return retry  # the manifest is taken up again at the next poll
        first = not device.digests and bool(wanted)
        device.digests = {i: d["digest"] for i, d in wanted.items()}
        device.version, device.etag = version, etag
        self.ready += first
        if any(MARKER in documents[d["deploymentId"]] for d in new):
            self.note_updated(device)
        return None

    async def fetch(self, device: Device, manifest: dict[str, Any],
                    new: list[dict[str, Any]]) -> tuple[dict[str, bytes] | None, float | None]:
        """The documents of the new deployments, from their YAMLs or from the bundle."""
        if not new:
            return {}, None
        if self.args.fetch == "bundle":
            status, reply, payload = await self.call(device, "bundle", "GET",
                                                     manifest["bundle"]["url"])
            if status != 200:
                return None, retry_after(status, reply)
            return bundle_documents(payload), None
        documents = {}
        for deployment in new:
            status, reply, payload = await self.call(device, "yaml", "GET", deployment["url"])
            if status != 200:
                return None, retry_after(status, reply)
            documents[deployment["deploymentId"]] = payload
        return documents, None

    async def report_status(self, device: Device, deployment_id: str, version: int,
                            state: str, document: bytes) -> tuple[bool, float | None]:
        """Whether the report was stored; else when to poll again (None: the period)."""
        components = [name.decode() for name in COMPONENT.findall(document)]
        body = json.dumps({"deploymentId": deployment_id, "deviceId": device.device_id,
                           "adoptedManifestVersion": version, "status": {"state": state},
                           "components": [{"name": n, "state": state}
                                          for n in components]}).encode()
        status, reply, _ = await self.call(device, "status", "POST",
                                           f"/api/v1/deployments/{deployment_id}/status",
                                           {"Content-Type": "application/json"}, body)
        return status in (200, 201), retry_after(status, reply)

    def note_updated(self, device: Device) -> None:
        if self.pushed_at is None or device.updated_at is not None:
            return
        device.updated_at = time.monotonic()
        self.updated.append(device.updated_at - self.pushed_at)
        if len(self.updated) == len(self.devices):
            self.all_updated.set()


def device_name(index: int) -> str:
    return f"device-{index:04d}"  # as `capabilities(index)` of bench/serve.py names it


def retry_after(status: int, headers: dict[str, str]) -> float | None:
    """How long the server asked the device to wait (429, 503), else the period."""
    if status not in (429, 503):
        return None
    try:
        return max(0.1, float(headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


def bundle_documents(payload: bytes) -> dict[str, bytes]:
    """A bundle's `<deploymentId>.yaml` files, by deployment id."""
    documents = {}
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(payload))) as archive:
        for member in archive.getmembers():
            extracted = archive.extractfile(member)
            if extracted is not None and member.name.endswith(".yaml"):
                documents[member.name.removesuffix(".yaml")] = extracted.read()
    return documents


# --- the servers' side -------------------------------------------------------------------

def server_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.compile_workers:
        env["MARGO_COMPILE_WORKERS"] = str(args.compile_workers)
    return env


def server_args(args: argparse.Namespace) -> list[str]:
    """Options every server gets: a `--max-wait` past the default when devices ask for it."""
    return ["--max-wait", f"{args.wait:g}"] if args.polling == "waiting" and args.wait > 60 \
        else []


@contextlib.contextmanager
def running_servers(data_dirs: list[Path], extra: list[str], logs: Path,
                    args: argparse.Namespace) -> Iterator[list[MargoServer]]:
    """One `margo serve` per data directory (hosting the fleet source), stopped at the end."""
    env, extra = server_env(args), [*extra, *server_args(args)]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_server(data, extra, logs, env))
               for data in data_dirs]


def running_server(data: Path, extra: list[str], logs: Path, env: dict[str, str],
                   port: int | None = None) -> contextlib.AbstractContextManager[MargoServer]:
    token_file = logs / "operator-token"
    token_file.write_text(OPERATOR_TOKEN)
    return margo_server(data, "--host-source", "--admin-token-file", str(token_file), *extra,
                        log_dir=logs, cwd=ROOT, env=env, stopping=stop_server, port=port)


def register_clients(db: Database, count: int) -> list[str]:
    """One client per device, directly in the store; their tokens."""
    registry = ClientRegistry(db)
    with ThreadPoolExecutor(32) as pool:  # concurrent adds share the writer's commits
        return [token for _, token in pool.map(registry.add, map(device_name, range(count)))]


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com",
                    *args], cwd=cwd, check=True, capture_output=True,
                   env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd),
                        "GIT_TERMINAL_PROMPT": "0"})


def source_url(server: MargoServer) -> str:
    return f"http://operator:{OPERATOR_TOKEN}@127.0.0.1:{server.port}/git/source.git"


def prepare_source(work: Path) -> None:
    shutil.copytree(ROOT / "examples" / "fleet", work)
    if GREETING not in (work / INTENT_FILE).read_text():
        raise SystemExit(f"{INTENT_FILE} no longer has {GREETING!r}: update bench/fleet.py")
    git("init", "-q", "-b", "main", cwd=work)
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", "fleet", cwd=work)


def commit_edit(work: Path) -> None:
    """Commit the greeting edit every device's deployment carries."""
    path = work / INTENT_FILE
    path.write_text(path.read_text().replace(GREETING, EDITED_GREETING, 1))
    git("commit", "-q", "-am", "greet again", cwd=work)


def push(work: Path, server: MargoServer) -> float:
    """`git push` to the server's hosted source; how long it took."""
    start = time.monotonic()
    git("push", "-q", source_url(server), "main", cwd=work)
    return time.monotonic() - start


# --- one run -----------------------------------------------------------------------------

@dataclass
class Result:
    store: str
    devices: int
    note: str
    updated: list[float]
    first_manifest: float | None
    push_seconds: float
    window: float
    stats: Stats
    server_cpu: list[tuple[float, float]]
    server_rss: list[float]
    postgres_cpu: float | None
    generator_cpu: float
    log_problems: list[str]
    setup_seconds: float
    quiet: waiting.QuietFigures | None = None
    restart: waiting.RestartFigures | None = None


def run_store(store: str, args: argparse.Namespace) -> Result:
    with tempfile.TemporaryDirectory(prefix="margo-bench-fleet-") as tmp:
        root = Path(tmp)
        work = root / "fleet"
        prepare_source(work)
        try:
            if store == "sqlite":
                return run_sqlite(root, work, args)
            return run_replicas(root, work, args)
        finally:
            if args.keep:
                kept = Path(tempfile.mkdtemp(prefix=f"margo-bench-fleet-{store}-"))
                shutil.copytree(root, kept, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
                    "*.sqlite*", "repos", "compile", "*.git"))
                print(f"logs kept in {kept}")


def run_sqlite(root: Path, work: Path, args: argparse.Namespace) -> Result:
    data = root / "data"
    db = open_database(data / "wfm.sqlite")
    tokens = register_clients(db, args.devices)
    db.close()
    with running_servers([data], [], root, args) as servers, contextlib.ExitStack() as again:
        def restart(port: int) -> MargoServer:
            """A new server process on the old one's data and port."""
            return again.enter_context(running_server(data, server_args(args), root,
                                                      server_env(args), port=port))

        return measure("sqlite", servers, None, tokens, work, args,
                       f"one server process, {connections_note(args, 1)}", restart)


def run_replicas(root: Path, work: Path, args: argparse.Namespace) -> Result:
    with running_postgres() as postgres:
        url = postgres.create_database("fleet_bench")
        db = open_database(url)
        tokens = register_clients(db, args.devices)
        db.close()
        dirs = [root / f"replica-{i}" for i in range(args.replicas)]
        assert postgres.process is not None
        with running_servers(dirs, ["--database", url], root, args) as servers:
            return measure("replicas", servers, postgres.process.pid, tokens, work, args,
                           f"{args.replicas} replicas on PostgreSQL (fsync=off), device i on "
                           f"replica i % {args.replicas} directly, "
                           f"{connections_note(args, args.replicas)}")


def connections_note(args: argparse.Namespace, servers: int) -> str:
    workers = (f", MARGO_COMPILE_WORKERS={args.compile_workers}" if args.compile_workers
               else "")
    if args.polling == "waiting":
        return f"waiting polls (wait={args.wait:g}), a connection per device" + workers
    if args.connections == 0:
        return "a connection per device" + workers
    return f"{max(1, args.connections // servers)} keep-alive connections per server{workers}"


def measure(store: str, servers: list[MargoServer], postgres_pid: int | None, tokens: list[str],
            work: Path, args: argparse.Namespace, note: str,
            restart: Callable[[int], MargoServer] | None = None) -> Result:
    push(work, servers[0])  # the fleet's first source
    result = run_loop(measure_async(store, servers, postgres_pid, tokens, work, args, note,
                                    restart))
    result.server_rss = [peak_rss_mib(s.process.pid) for s in servers]
    stop_all(servers)
    result.log_problems = [f"{s.log.name}: {line}" for s in servers
                           for line in s.log.read_text(errors="replace").splitlines()
                           if re.search(r"ERROR|Traceback|WARNING|CRITICAL", line)]
    return result


def stop_all(servers: list[MargoServer]) -> None:
    for server in servers:
        stop_server(server)


def stop_server(server: MargoServer) -> None:
    """SIGTERM (SIGKILL after 20 s), and SIGKILL for its compile workers still alive then:
    a worker stuck in a compile outlives its server otherwise (see the report's notes)."""
    if server.process.poll() is not None:
        return
    workers = child_pids(server.process.pid)
    stop(server.process)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_loop(coroutine: Any) -> Result:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)  # type: ignore[no-any-return]
    return uvloop.run(coroutine)  # type: ignore[no-any-return]


async def measure_async(store: str, servers: list[MargoServer], postgres_pid: int | None,
                        tokens: list[str], work: Path, args: argparse.Namespace,
                        note: str, restart: Callable[[int], MargoServer] | None) -> Result:
    stats = Stats()
    size = args.connections // len(servers) if args.connections else 1
    shared = [Pool(s.port, max(1, size), stats) for s in servers]
    fleet = Fleet(shared, tokens, args, stats)
    if args.connections == 0 or args.polling == "waiting":  # a pool of one for each device
        for device in fleet.devices:
            device.pool = Pool(servers[device.index % len(servers)].port, 1, stats)
    setup = time.monotonic()
    tasks = [asyncio.create_task(fleet.live(d)) for d in fleet.devices]
    try:
        await wait_for_steady_state(fleet, tasks, servers, args.setup_timeout)
        steady = time.monotonic()
        setup_seconds = steady - setup
        await asyncio.sleep(args.settle)
        quiet = None
        if args.quiet:
            seconds = waiting.quiet_seconds(args)
            collections = await waiting.collected(servers, OPERATOR_TOKEN,
                                                  COLLECT_LATEST + 15)
            await waiting.first_holds_over(args, steady)
            first = ", the first held polls over" if args.polling == "waiting" else ""
            print(f"  steady state after {setup_seconds:.0f} s, the compile's collection "
                  f"done{first}: {seconds:g} s with nothing changing", flush=True)
            quiet = await waiting.quiet_window(servers, postgres_pid, seconds, stats, tree_cpu)
            quiet.collections = collections
        print(f"  steady state after {setup_seconds:.0f} s: pushing the edit", flush=True)
        result = await push_and_wait(store, fleet, servers, postgres_pid, work, args, note,
                                     setup_seconds)
        result.quiet = quiet
        if args.restart and restart is not None and args.polling == "waiting":
            result.restart = await restart_server(servers, restart, fleet, args)
        return result
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def restart_server(servers: list[MargoServer], restart: Callable[[int], MargoServer],
                         fleet: Fleet, args: argparse.Namespace) -> waiting.RestartFigures:
    """SIGTERM the (only) server, start it again on its port, and wait until it holds every
    device's poll again (bench/waiting.py)."""
    await asyncio.sleep(args.settle + args.wait / 4)  # the devices back to waiting
    old = servers[0]
    print("  restarting the server", flush=True)
    errors_before = Counter(fleet.stats.errors)
    started = time.monotonic()
    await asyncio.to_thread(stop_server, old)
    stopped = time.monotonic() - started
    servers[0] = await asyncio.to_thread(restart, old.port)
    listening = time.monotonic() - started
    back = await waiting.reconnected(old.port, OPERATOR_TOKEN, len(fleet.devices), started,
                                     args.timeout)
    return waiting.RestartFigures(stopped, listening, back,
                                  waiting.held_polls(old.port, OPERATOR_TOKEN) or 0,
                                  len(fleet.devices),
                                  dict(Counter(fleet.stats.errors) - errors_before))


async def wait_for_steady_state(fleet: Fleet, tasks: list[asyncio.Task[None]],
                                servers: list[MargoServer], timeout: float) -> None:
    """Until every device installed its first deployment (the steady state before the push)."""
    deadline = time.monotonic() + timeout
    while fleet.ready < len(fleet.devices):
        crashed = next((t for t in tasks if t.done()), None)
        if crashed is not None:
            crashed.result()  # a device died of a harness bug: raise it
            raise RuntimeError("a simulated device stopped")
        if time.monotonic() > deadline:
            waiting = Counter(f"port {d.pool.port} manifestVersion {d.version}"
                              for d in fleet.devices if not d.digests)
            children = {f"server {s.port} child {pid}": process_state(pid)
                        for s in servers for pid in child_pids(s.process.pid)}
            raise NotMeasured(f"setup: only {fleet.ready:,} of {len(fleet.devices):,} devices "
                             f"installed a first deployment within {timeout:.0f} s; "
                             f"errors {dict(fleet.stats.errors)}; requests "
                             f"{dict(fleet.stats.counts)}; waiting {dict(waiting)}; server "
                             f"processes' children (a compile's workers) {children or 'none'}")
        await asyncio.sleep(0.2)


async def push_and_wait(store: str, fleet: Fleet, servers: list[MargoServer],
                        postgres_pid: int | None, work: Path, args: argparse.Namespace,
                        note: str, setup_seconds: float) -> Result:
    cpu_before = [cpu_seconds(s.process.pid) for s in servers]
    postgres_before = tree_cpu(postgres_pid) if postgres_pid else None
    generator_before = time.process_time()
    await asyncio.to_thread(commit_edit, work)
    fleet.stats.reset()
    fleet.pushed_at = time.monotonic()
    push_seconds = await asyncio.to_thread(push, work, servers[0])
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(fleet.all_updated.wait(),
                               args.timeout - (time.monotonic() - fleet.pushed_at))
    window = time.monotonic() - fleet.pushed_at
    if fleet.crashes:
        raise RuntimeError(f"{len(fleet.crashes)} simulated devices failed") from fleet.crashes[0]
    cpu_after = [cpu_seconds(s.process.pid) for s in servers]
    return Result(
        store=store, devices=len(fleet.devices), note=note, updated=sorted(fleet.updated),
        first_manifest=fleet.first_manifest, push_seconds=push_seconds, window=window,
        stats=copy.deepcopy(fleet.stats),
        server_cpu=[(a[0] - b[0], a[1] - b[1]) for a, b in zip(cpu_after, cpu_before,
                                                                strict=True)],
        server_rss=[], postgres_cpu=(tree_cpu(postgres_pid) - postgres_before
                                     if postgres_pid and postgres_before is not None
                                     else None),
        generator_cpu=time.process_time() - generator_before, log_problems=[],
        setup_seconds=setup_seconds)


# --- printing ----------------------------------------------------------------------------

def fraction_time(result: Result, fraction: float) -> str:
    needed = max(1, int(result.devices * fraction + 0.999999))
    if len(result.updated) < needed:
        return "-"
    return f"{result.updated[needed - 1]:.1f}"


def print_results(results: list[Result], args: argparse.Namespace) -> None:
    print(f"\nfleet benchmark: {args.devices:,} devices, P = {args.period:g} s "
          f"(±{args.jitter:.0%} jitter), {args.fetch} fetches; times in seconds from the "
          f"git push (t = 0)")
    for r in results:
        print(f"  {r.store}: {r.note}; setup (capabilities to all installed) "
              f"{r.setup_seconds:.0f} s")
    print(f"\n{'store':<9} {'devices':>7} {'push':>5} {'first':>6} {'t50':>6} {'t99':>6} "
          f"{'t100':>6} {'updated':>15}  target: all within {args.target:g} s")
    for r in results:
        first = f"{r.first_manifest:.1f}" if r.first_manifest is not None else "-"
        met = len(r.updated) == r.devices and r.updated[-1] <= args.target
        print(f"{r.store:<9} {r.devices:>7,} {r.push_seconds:>5.1f} {first:>6} "
              f"{fraction_time(r, 0.5):>6} {fraction_time(r, 0.99):>6} "
              f"{fraction_time(r, 1.0):>6} {len(r.updated):>7,}/{r.devices:<7,}  "
              f"{'met' if met else 'MISSED'}")
    print("\nrequests per second over the window (push to last installed) [p99 latency ms]")
    print(f"{'store':<9} {'window':>6} " + " ".join(f"{k:>18}" for k in KINDS))
    for r in results:
        cells = []
        for kind in KINDS:
            latencies = r.stats.latencies.get(kind, [])
            p99 = percentile(latencies, 0.99) * 1000 if latencies else 0.0
            cells.append(f"{len(latencies) / r.window:>8.0f} [{p99:>6.0f}]"
                         if latencies else "-")
        print(f"{r.store:<9} {r.window:>6.1f} " + " ".join(f"{c:>18}" for c in cells))
    print("\nerrors in the window (kind status: count)")
    for r in results:
        errors = ", ".join(f"{k}: {v:,}" for k, v in sorted(r.stats.errors.items())) or "none"
        print(f"  {r.store}: {errors}")
    print("\nCPU seconds in the window (user+sys) and peak RSS")
    for r in results:
        servers = "; ".join(f"server {i}: {u + s:.1f} s ({u:.1f}+{s:.1f}), {rss:.0f} MiB"
                            for i, ((u, s), rss) in enumerate(zip(r.server_cpu, r.server_rss,
                                                                  strict=True)))
        postgres = f"; PostgreSQL: {r.postgres_cpu:.1f} s" if r.postgres_cpu is not None else ""
        print(f"  {r.store}: {servers}{postgres}; load generator: {r.generator_cpu:.1f} s "
              f"(of {r.window * 2:.0f} core-seconds)")
    waiting.print_figures(results, args)
    for r in results:
        if r.log_problems:
            print(f"\nserver log lines with WARNING/ERROR ({r.store}, {len(r.log_problems)}; "
                  "the first 5):")
            for line in r.log_problems[:5]:
                benign = " (expected until the first push)" if EXPECTED_WARNING in line else ""
                print(f"  {line[:300]}{benign}")


# --- main --------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--period", type=float, default=15.0, help="manifest poll period P (s)")
    parser.add_argument("--jitter", type=float, default=0.15,
                        help="uniform jitter of each poll interval, as a fraction of P")
    parser.add_argument("--store", choices=("sqlite", "replicas", "both"), default="both")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--fetch", choices=("yaml", "bundle"), default="yaml")
    parser.add_argument("--connections", type=int, default=256,
                        help="keep-alive connections in all, split between the servers "
                             "(0: one per device)")
    parser.add_argument("--compile-workers", type=int, default=0,
                        help="MARGO_COMPILE_WORKERS for the servers (default: their own "
                             "choice; 1 compiles without forked workers)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="give up this many seconds after the push")
    parser.add_argument("--target", type=float, default=30.0)
    parser.add_argument("--setup-timeout", type=float, default=300.0,
                        help="give up when the devices have not all installed a first "
                             "deployment by then")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds of steady polling between setup and the push")
    parser.add_argument("--polling", choices=("interval", "waiting"), default="interval",
                        help="interval: poll every --period; waiting: conditional polls "
                             "held by the server (Prefer: wait), bench/waiting.py")
    parser.add_argument("--wait", type=float, default=60.0,
                        help="waiting polls: the wait asked for (seconds)")
    parser.add_argument("--quiet", type=float, default=0.0,
                        help="seconds of steady state (nothing changing) measured before "
                             "the push: the servers' CPU per minute (waiting polls: rounded "
                             "up to whole waits)")
    parser.add_argument("--restart", action="store_true",
                        help="SQLite, waiting polls: restart the server after the push and "
                             "measure until every device's poll is held again")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the server logs")
    return parser.parse_args()


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> int:
    """0 when every store was measured (target met or not), 1 when one could not be."""
    args = parse_args()
    random.seed(args.seed)
    raise_fd_limit()
    stores = ["sqlite", "replicas"] if args.store == "both" else [args.store]
    results, failures = [], []
    for store in stores:
        print(f"{store}: {args.devices:,} devices, P = {args.period:g} s ...", flush=True)
        try:
            results.append(run_store(store, args))
        except NotMeasured as exc:
            failures.append(f"{store}: NOT MEASURED: {exc}")
            print(failures[-1], flush=True)
            continue
        print_results(results[-1:], args)
    if len(results) + len(failures) > 1:
        if results:
            print_results(results, args)
        for failure in failures:
            print(f"\n{failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
