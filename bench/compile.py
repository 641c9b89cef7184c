"""Benchmark: compiling a synthetic fleet into device branches.

    .venv/bin/python bench/compile.py [--devices 10000] [--apps 20] [--intents 30] [--runs 1]
        [--server]

Generates a fleet source (applications with Helm and Compose profiles, constraints and
configuration schemas; intents with label/property selectors, literal and expression
parameters) and a capability snapshot, then prints:

* full compile seconds and devices per second (first compile: every branch is created);
* no-op recompile seconds (nothing changed);
* incremental seconds after one intent's parameter change that affects about 10% of the
  devices, and the ratio to the full compile;
* the same trees and commits written by `git fast-import` from a prepared stream (Git's
  fastest writer: the practical lower bound for writing the objects), and the ratio of the
  full compile to it;
* each compile's peak resident memory (VmHWM of this process, reset before each compile),
  and the largest of its forked workers' and Git's.

The fleet is generated and the fast-import stream prepared one device at a time, so
``--devices 1000000`` fits this machine.

With ``--runs N`` everything is measured N times from scratch and the ranges are printed:
on a small virtual machine identical runs differ by 15% and more, so single figures
mislead. The compiler keeps its branches in ``packed-refs`` (one file); fast-import writes
one loose file per branch, which on a disk can cost it seconds the compiler does not pay.
Before each timed step the file system is synced (untimed), so no step pays for what an
earlier one wrote.
Set TMPDIR to measure on another file system (e.g. ``TMPDIR=/dev/shm`` leaves the disk out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.benchkit import memory_kib
from bench.server_snapshot import measure_server_snapshot
from compiler.compilation import CompileReport, compile_fleet
from compiler.gcpause import release_frozen
from compiler.gitstore import DeviceStore, device_ref
from compiler.snapshot import load_snapshot
from compiler.source import load_source
from compiler.state import CompilerState
from margo.canonical import canonical_yaml

ZONES = [f"zone-{i}" for i in range(10)]
TIERS = ["bronze", "silver", "gold", "platinum", "lab"]


def application(index: int, rng: random.Random) -> dict[str, Any]:
    app_id = f"com-example-app-{index:02d}"
    components = [f"part-{c}" for c in range(rng.randint(1, 3))]
    parameters = {
        "replicas": {"value": 1, "targets": [{"pointer": "replicaCount",
                                              "components": [components[0]]}]},
        "logLevel": {"value": "info", "targets": [
            {"pointer": "log.level", "components": components},
            {"pointer": "LOG_LEVEL", "components": ["compose-part"]}]},
        "site": {"value": "unknown", "targets": [{"pointer": "global.site",
                                                  "components": components}]},
    }
    return {
        "apiVersion": "margo.org/v1-alpha1", "kind": "ApplicationDescription", "id": app_id,
        "metadata": {"name": f"App {index}", "version": "1.0.0",
                     "catalog": {"organization": [{"name": "Example"}]}},
        "deploymentProfiles": [
            {"type": "helm", "id": f"{app_id}-helm",
             "components": [{"name": c, "properties": {
                 "repository": f"oci://registry.example.com/charts/{app_id}-{c}",
                 "revision": f"1.{index}.0", "wait": True}} for c in components],
             "deviceConstraints": {"capacityRequirements": {
                 "cpu": {"cores": rng.choice([0.5, 1, 2])}, "memory": rng.choice(
                     ["256Mi", "512Mi", "1Gi"])}}},
            {"type": "compose", "id": f"{app_id}-compose",
             "components": [{"name": "compose-part", "properties": {
                 "repository": f"oci://registry.example.com/compose/{app_id}",
                 "revision": f"1.{index}.0"}}]},
        ],
        "parameters": parameters,
        "configuration": {
            "sections": [{"name": "General", "settings": [
                {"parameter": "replicas", "name": "Replicas", "schema": "replicas"},
                {"parameter": "logLevel", "name": "Log level", "schema": "level"},
                {"parameter": "site", "name": "Site", "schema": "text"}]}],
            "schema": [
                {"name": "replicas", "dataType": "integer", "minValue": 1, "maxValue": 5},
                {"name": "level", "dataType": "string", "options": ["debug", "info", "warn"]},
                {"name": "text", "dataType": "string", "maxLength": 64}],
        },
    }


def intent(index: int, apps: int, rng: random.Random) -> dict[str, Any]:
    # Intent 0 targets one zone of ten (about 10% of the fleet); the others two zones,
    # some narrowed by tier, so a device gets about six deployments.
    zones = [ZONES[0]] if index == 0 else rng.sample(ZONES, 2)
    selector: dict[str, Any] = {"labelSelector": {"matchExpressions": [
        {"key": "example.com/zone", "operator": "In", "values": zones}]}}
    if index % 3 == 2:
        selector["labelSelector"]["matchExpressions"].append(
            {"key": "example.com/tier", "operator": "NotIn", "values": ["lab"]})
    spec: dict[str, Any] = {
        "application": {"id": f"com-example-app-{index % apps:02d}"},
        "namespace": f"ns-{index}",
        "targets": {"selectors": [selector]},
        "parameters": {"logLevel": "info" if index % 2 else "warn"},
    }
    if index % 4 == 0:
        spec["parameters"]["site"] = "{{ device.labels['example.com/zone'] }}"
    if index % 5 == 0:
        spec["parameters"]["replicas"] = (
            "{{ [device.labels['example.com/nodes'] | default(1), 3] | min }}")
    return {"apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
            "metadata": {"name": f"intent-{index:02d}"}, "spec": spec}


def capabilities(index: int, rng: random.Random) -> dict[str, Any]:
    # Sized so that nearly every placement fits (a fleet planned with capacity): capacity
    # accounting runs for every device, and about 1% of placements wait for capacity.
    kubernetes = rng.random() < 0.7
    labels: dict[str, Any] = {"example.com/zone": rng.choice(ZONES),
                              "example.com/tier": rng.choice(TIERS)}
    if kubernetes:
        labels["example.com/nodes"] = rng.choice([1, 1, 1, 3, 5])
    return {"properties": {
        "id": f"device-{index:05d}", "vendor": "Example", "modelNumber": "E1",
        "serialNumber": f"SN{index:07d}",
        "cpus": [{"cores": rng.choice([16, 32, 64]), "architecture": rng.choice(
            ["amd64", "arm64"])}],
        "memory": f"{rng.choice([16, 32, 64, 128])}Gi", "storage": "64Gi", "peripherals": [],
        "interfaces": [{"type": "ethernet"}], "otelCollector": True,
        "supportedRuntimes": ["oci"],
        "supportedDeploymentTypes": ["helm"] if kubernetes else ["compose"]},
        "labels": labels}


def generate(root: Path, devices: int, apps: int, intents: int) -> tuple[Path, Path]:
    rng = random.Random(2026)
    source = root / "source"
    for index in range(apps):
        doc = application(index, rng)
        (source / "apps" / doc["id"]).mkdir(parents=True)
        (source / "apps" / doc["id"] / "margo.yaml").write_bytes(canonical_yaml(doc))
    (source / "deployments").mkdir(parents=True)
    for index in range(intents):
        doc = intent(index, apps, rng)
        (source / "deployments" / f"{doc['metadata']['name']}.yaml").write_bytes(
            canonical_yaml(doc))
    caps = root / "capabilities.json"
    with caps.open("w") as out:  # one device at a time: a million do not fit in memory whole
        out.write("{")
        for i in range(devices):
            out.write(f'{", " if i else ""}"device-{i:05d}": '
                      f"{json.dumps(capabilities(i, rng))}")
        out.write("}")
    return source, caps


def settle() -> None:
    """Flush what earlier steps wrote before timing the next one (`sync`, untimed).

    Why: the kernel writes data back (and, on a file system mounted with `discard`, trims
    freed blocks) seconds after a step ends; without this, a step that follows a large write
    (the incremental compile after the full one) pays for the previous step's 10,000 refs.
    """
    os.sync()


def run_compile(source: Path, caps: Path, repos: Path, now: float) -> tuple[CompileReport,
                                                                            float]:
    settle()
    reset_peak_memory()
    start = time.perf_counter()
    state = CompilerState(repos / "compiler-state.sqlite")
    store = DeviceStore(repos)
    try:
        state.bind(store.identity)
        snapshot = load_snapshot(caps, trusted=state.trusted_digests())
        report = compile_fleet(load_source(source), snapshot, store, state, now=now)
    finally:
        state.close()
    elapsed = time.perf_counter() - start
    # Untimed, as the fleet server and `margo compile --watch` do after every compile: the
    # next run would otherwise fork workers from a process grown by every compile before.
    release_frozen()
    return report, elapsed


def fast_import_stream(store: DeviceStore) -> Iterator[bytes]:
    """Every device's first commit (same tree, same message) as a `git fast-import` stream,
    one device at a time: built whole, the stream of 100,000 devices had been most of this
    benchmark's own peak memory."""
    for device_id in store.device_ids():
        first = store.history(device_id, limit=1000)[-1]
        files = store.read_files(device_id, first.id) or {}
        message = first.message.encode()
        chunks = [f"commit {device_ref(device_id)}\n".encode(),
                  f"committer bench <bench@example.invalid> {first.timestamp} +0000\n".encode(),
                  b"data %d\n%s\n" % (len(message), message)]
        chunks += [b"M 100644 inline %s\ndata %d\n%s\n" % (name.encode(), len(files[name]),
                                                            files[name])
                   for name in sorted(files)]
        yield b"".join(chunks) + b"\n"
    yield b"done\n"


def fast_import_lower_bound(store: DeviceStore, target: Path) -> float:
    """Write every device's first commit with git fast-import; its seconds. The stream is
    prepared in a file first (untimed), so the timed run is Git's alone."""
    subprocess.run(["git", "init", "-q", "--bare", str(target)], check=True)
    stream = target / "bench-stream"
    with stream.open("wb") as out:
        out.writelines(fast_import_stream(store))
    settle()
    start = time.perf_counter()
    with stream.open("rb") as feed:
        subprocess.run(["git", "--git-dir", str(target), "fast-import", "--quiet", "--done"],
                       stdin=feed, check=True)
    return time.perf_counter() - start


def reset_peak_memory() -> None:
    """Start this process's peak resident memory (VmHWM) afresh: Linux resets it when "5"
    is written to /proc/self/clear_refs, so each compile's own peak can be read after it."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb() -> float:
    """This process's peak resident memory since `reset_peak_memory`, in MB (10^6 bytes)."""
    return memory_kib("VmHWM") * 1024 / 1e6


def workers_peak_mb() -> float:
    """The largest peak resident memory of any finished child (the compile's forked
    workers and Git), in MB: what the compile needs besides its own process."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e6


def measure(devices: int, apps: int, intents: int, *, server: bool = False) -> dict[str, float]:
    """One measurement of every figure, in a fresh directory; prints as it goes."""
    with tempfile.TemporaryDirectory(prefix="margo-bench-") as tmp:
        root = Path(tmp)
        source, caps = generate(root, devices, apps, intents)
        repos = root / "repos"
        repos.mkdir()
        report, full = run_compile(source, caps, repos, now=1_800_000_000)
        assert not report.errors, report.errors[:3]
        state = CompilerState(repos / "compiler-state.sqlite")
        waiting = sum(len(names) for names in state.waiting().values())
        state.close()
        full_peak = peak_memory_mb()
        print(f"full compile: {full:.1f} s, {devices / full:,.0f} devices/s "
              f"({report.devices} devices, {report.deployments} deployments, "
              f"{waiting} waiting for capacity, {report.commits} commits); "
              f"peak resident memory {full_peak:,.0f} MB (largest worker or Git "
              f"{workers_peak_mb():,.0f} MB)")
        report, noop = run_compile(source, caps, repos, now=1_800_000_100)
        print(f"no-op recompile: {noop:.2f} s ({report.commits} commits, "
              f"{report.unchanged} unchanged); peak {peak_memory_mb():,.0f} MB")
        intent_file = source / "deployments" / "intent-00.yaml"
        intent_file.write_text(intent_file.read_text().replace("logLevel: warn",
                                                               "logLevel: debug"))
        report, incremental = run_compile(source, caps, repos, now=1_800_000_200)
        print(f"incremental (one intent's parameter, {report.commits} devices = "
              f"{report.commits / devices:.0%}): {incremental:.2f} s, "
              f"{incremental / full:.3f} of full; peak {peak_memory_mb():,.0f} MB")
        figures = measure_server_snapshot(caps) if server else {}
        lower = fast_import_lower_bound(DeviceStore(repos), root / "fast-import.git")
        print(f"git fast-import of the same trees and commits: {lower:.1f} s; "
              f"full compile / fast-import = {full / lower:.2f}", flush=True)
    return {"full compile s": full, "no-op s": noop, "incremental s": incremental,
            "incremental / full": incremental / full, "fast-import s": lower,
            "full / fast-import": full / lower, "full compile peak MB": full_peak, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--apps", type=int, default=20)
    parser.add_argument("--intents", type=int, default=30)
    parser.add_argument("--server", action="store_true",
                        help="also time the fleet server's compile input from its store "
                             "(bench/server_snapshot.py)")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat every measurement (fresh directories) and print ranges")
    args = parser.parse_args()
    runs = []
    for run in range(args.runs):
        if args.runs > 1:
            print(f"-- run {run + 1} of {args.runs}")
        runs.append(measure(args.devices, args.apps, args.intents, server=args.server))
    if args.runs > 1:
        print(f"-- ranges over {args.runs} runs (min - median - max)")
        for figure in runs[0]:
            values = sorted(r[figure] for r in runs)
            print(f"{figure}: {values[0]:.3f} - {statistics.median(values):.3f} - "
                  f"{values[-1]:.3f}")


if __name__ == "__main__":
    main()
