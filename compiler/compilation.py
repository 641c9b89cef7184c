"""Compile a fleet: source x capability snapshot → one commit per changed device branch.

For every device in the snapshot this decides which deployment files its tree must hold
(`placement` + `render`), compares with the branch tip, and commits only real changes,
with a message that says why. It is incremental: a device whose capabilities did not
change and that no changed intent targets (now or before) is skipped without rendering,
so a no-op recompile of 10,000 devices only hashes their capability documents.

Failure containment, so that nothing already committed is lost:
* a broken intent file, or an intent whose application is broken or missing, is *frozen*:
  every device keeps that intent's current file as it is;
* a device whose rendering fails (bad parameter value, failing expression, immutable
  change) keeps its whole previous tree, and its problems are reported;
* a broken capability document leaves its device untouched; devices absent from the
  snapshot are left untouched too (absence is not evidence of anything).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from compiler.gitstore import DeviceCommit, DeviceStore, blob_id
from compiler.intents import Intent
from compiler.messages import Change, commit_message
from compiler.placement import Placement, ProfileConstraints, place
from compiler.render import RenderCache, RenderError, file_name, render
from compiler.snapshot import Device, Snapshot
from compiler.source import AppVersion, FleetSource
from compiler.state import CompilerState, DeviceRecord, IntentRecord, PlacementRecord
from compiler.targeting import TargetIndex
from margo.errors import Problem

__all__ = ["CompileReport", "DeviceResult", "compile_fleet", "resolve_intents"]

#: Reports progress over an iterable of known length (a progress bar, or nothing).
Progress = Callable[[Iterable[Any], int], Iterable[Any]]

#: Bumped when the compiler's output for the same inputs changes, forcing re-rendering.
COMPILER_VERSION = "2"  # 2: placements see root extensions and cluster sections
_SUFFIX = ".yaml"
_FAST_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass
class DeviceResult:
    device_id: str
    status: str  # committed | unchanged | error
    changes: list[Change] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    commit: str | None = None
    notes: list[str] = field(default_factory=list)  # e.g. deployments kept for a grace period
    grace_until: float | None = None  # when the first grace period kept here runs out


@dataclass
class CompileReport:
    revision: str
    devices: int = 0
    deployments: int = 0
    commits: int = 0
    unchanged: int = 0
    errors: list[tuple[str | None, Problem]] = field(default_factory=list)  # (device, problem)
    results: list[DeviceResult] = field(default_factory=list)

    @property
    def next_grace_expiry(self) -> float | None:
        """The earliest moment (epoch seconds) a kept deployment's grace period runs out: a
        compile is due then even if no input changes, or the deployment would stay forever."""
        times = [r.grace_until for r in self.results if r.grace_until is not None]
        return min(times) if times else None

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": self.devices, "deployments": self.deployments, "commits": self.commits,
            "unchanged": self.unchanged,
            "errors": [{"device": device, **problem.to_json()} for device, problem in self.errors],
        }


@dataclass
class ResolvedIntents:
    usable: dict[str, tuple[Intent, AppVersion]]
    frozen: set[str]
    problems: list[Problem]

    def record(self, name: str) -> IntentRecord:
        intent, app = self.usable[name]
        return IntentRecord(name, intent.digest, app.description.id, app.description.version,
                            app.digest)


def resolve_intents(source: FleetSource) -> ResolvedIntents:
    """Pair each intent with its application version; freeze those that cannot be used."""
    usable: dict[str, tuple[Intent, AppVersion]] = {}
    frozen = set(source.broken_intents)
    problems: list[Problem] = []
    for name, intent in sorted(source.intents.items()):
        app = source.application(intent.application_id, intent.application_version)
        if intent.application_id in source.broken_apps:
            frozen.add(name)
            problems.append(intent.locate(Problem(
                ("spec", "application"), f"application {intent.application_id} has errors; "
                "devices keep this intent's previous deployments")))
            continue
        if app is None:
            frozen.add(name)
            wanted = intent.application_id + (f" version {intent.application_version}"
                                               if intent.application_version else "")
            known = ", ".join(sorted(source.applications.get(intent.application_id, {})))
            problems.append(intent.locate(Problem(
                ("spec", "application"), f"no application {wanted} in the fleet source"
                + (f" (versions: {known})" if known else ""))))
            continue
        unknown = sorted(set(intent.parameters) - set(app.description.parameters))
        if unknown:
            frozen.add(name)
            known_parameters = "one of " + ", ".join(sorted(app.description.parameters))
            problems.extend(intent.locate(Problem(
                ("spec", "parameters", p), f"application {app.description.id} "
                f"{app.description.version} has no parameter {p!r}",
                expected=known_parameters)) for p in unknown)
            continue
        usable[name] = (intent, app)
    return ResolvedIntents(usable, frozen, problems)


def _parse_previous(data: bytes) -> dict[str, Any] | None:
    """A file this compiler wrote earlier, as data. Our canonical YAML reads the same in
    YAML 1.1 and 1.2 (a tested property), so libyaml's fast loader is safe here."""
    try:
        document = yaml.load(data, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        return None
    return document if isinstance(document, dict) else None


def _spec_sections(data: bytes) -> dict[bytes, bytes]:
    """The text of each `spec` member of a canonical deployment document.

    Canonical YAML puts every key on its own line at a fixed indentation, so the members of
    `spec` are the lines indented by exactly two spaces inside the `spec:` block; comparing
    their text is comparing their data, without parsing.
    """
    lines = data.split(b"\n")
    sections: dict[bytes, bytes] = {}
    name: bytes | None = None
    start, end, inside = 0, len(lines), False
    for index, line in enumerate(lines):
        if not line.startswith(b" "):
            if inside:
                end = index
                break
            inside = line == b"spec:"
        elif inside and line[2:3] != b" ":
            if name is not None:
                sections[name] = b"\n".join(lines[start:index])
            name, start = line[2:].split(b":", 1)[0], index
    if name is not None:
        sections[name] = b"\n".join(lines[start:end])
    return sections


def _classify(old: bytes, new: bytes) -> str:
    """`reconfigure` when only parameter values changed, `update` otherwise."""
    before, after = _spec_sections(old), _spec_sections(new)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    return "reconfigure" if before and after and changed == {b"parameters"} else "update"


@dataclass
class _Context:
    """Everything one compile shares across devices."""

    source: FleetSource
    intents: ResolvedIntents
    previous_intents: dict[str, IntentRecord]
    changed: set[str]
    constraints: ProfileConstraints
    now: float
    targets: TargetIndex
    renders: RenderCache = field(default_factory=RenderCache)


def _change_reasons(ctx: _Context, name: str, caps_changed: bool) -> tuple[str, ...]:
    previous = ctx.previous_intents.get(name)
    current = ctx.intents.record(name)
    reasons = []
    if previous is not None and previous.digest != current.digest:
        reasons.append("intent edited")
    if previous is not None and previous.app_version != current.app_version:
        reasons.append(f"application version {previous.app_version} -> {current.app_version}")
    elif previous is not None and previous.app_digest != current.app_digest:
        reasons.append("application description changed")
    if caps_changed:
        reasons.append("capabilities changed")
    return tuple(reasons) or ("re-rendered",)


def _add_reason(ctx: _Context, name: str, previous: PlacementRecord | None) -> str:
    if previous is not None and not previous.eligible:
        return "device became eligible"
    if name not in ctx.previous_intents:
        return "intent added"
    return "device now targeted"


@dataclass
class _DeviceOutcome:
    files: dict[str, bytes]
    placements: list[PlacementRecord]
    changes: list[Change]
    problems: list[Problem]
    notes: list[str]
    grace_until: float | None = None


def _unchanged_placement(ctx: _Context, name: str, previous: dict[str, PlacementRecord],
                         current: dict[str, bytes], out: _DeviceOutcome) -> bool:
    """With unchanged capabilities, an unchanged intent decides exactly as last time: keep
    its file (or its absence) and its record instead of evaluating and rendering again.
    Placements in a grace period are always re-evaluated, since time is an input."""
    if name in ctx.changed or name in ctx.intents.frozen:
        return False
    record = previous.get(name)
    fname = file_name(name)
    if record is None:
        return fname not in current  # not targeted before, so not now
    if record.ineligible_since is not None:
        return False
    if fname in current:
        out.files[fname] = current[fname]
    out.placements.append(record)
    return True


def _compile_device(ctx: _Context, device: Device, current: dict[str, bytes],
                    previous: dict[str, PlacementRecord], caps_changed: bool, *,
                    reuse: bool = False) -> _DeviceOutcome:
    """The device's new tree. With `reuse` (its capabilities and last compile are known to
    be unchanged), only the intents that changed are evaluated again."""
    out = _DeviceOutcome({}, [], [], [], [])
    names = set(ctx.intents.usable) | ctx.intents.frozen | {
        f[: -len(_SUFFIX)] for f in current if f.endswith(_SUFFIX)}
    for name in sorted(names):
        if reuse and name in ctx.intents.usable and _unchanged_placement(
                ctx, name, previous, current, out):
            continue
        fname = file_name(name)
        had = fname in current
        if name in ctx.intents.frozen:
            if had:
                out.files[fname] = current[fname]
            if name in previous:
                out.placements.append(previous[name])
            continue
        if name not in ctx.intents.usable:
            if had:
                out.changes.append(Change(fname, name, "remove", ("intent deleted",)))
            continue
        intent, app = ctx.intents.usable[name]
        placement = place(intent, app, device, ctx.constraints,
                          targeted=ctx.targets.targets(intent, device.id))
        if not placement.targeted:
            if had:
                out.changes.append(Change(fname, name, "remove",
                                          ("device no longer targeted by the intent",)))
            continue
        if placement.eligible:
            _place_eligible(ctx, out, intent, app, placement, device, current, previous,
                            caps_changed)
        else:
            _place_ineligible(ctx, out, intent, app, device, current, previous.get(name))
    return out


def _place_eligible(ctx: _Context, out: _DeviceOutcome, intent: Intent, app: AppVersion,
                    placement: Placement, device: Device, current: dict[str, bytes],
                    previous: dict[str, PlacementRecord], caps_changed: bool) -> None:
    fname = file_name(intent.name)
    old = None
    if fname in current and any(s.immutable for s in app.description.settings().values()):
        old = _parse_previous(current[fname])
    assert placement.profile is not None
    try:
        rendered = render(intent, app, placement.profile, device, previous=old,
                          cache=ctx.renders)
    except RenderError as exc:
        out.problems.extend(exc.problems)
        return
    out.files[fname] = rendered.data
    out.placements.append(PlacementRecord(device.id, intent.name, True, True, None))
    if fname not in current:
        out.changes.append(Change(fname, intent.name, "add",
                                  (_add_reason(ctx, intent.name, previous.get(intent.name)),)))
    elif current[fname] != rendered.data:
        out.changes.append(Change(fname, intent.name, _classify(current[fname], rendered.data),
                                  _change_reasons(ctx, intent.name, caps_changed)))


def _place_ineligible(ctx: _Context, out: _DeviceOutcome, intent: Intent, app: AppVersion,
                      device: Device, current: dict[str, bytes],
                      previous: PlacementRecord | None) -> None:
    fname = file_name(intent.name)
    since = previous.ineligible_since if previous and previous.ineligible_since else ctx.now
    explained = place(intent, app, device, ctx.constraints, explain=True)
    why = "; ".join(explained.failure_messages()[:3]) or "no profile fits"
    if fname in current and intent.grace_seconds and ctx.now - since < intent.grace_seconds:
        left = int(intent.grace_seconds - (ctx.now - since))
        out.files[fname] = current[fname]
        out.placements.append(PlacementRecord(device.id, intent.name, False, True, since))
        out.notes.append(f"{intent.name}: not eligible ({why}); kept for the grace period, "
                         f"{left}s left")
        until = since + intent.grace_seconds
        out.grace_until = until if out.grace_until is None else min(out.grace_until, until)
        return
    out.placements.append(PlacementRecord(device.id, intent.name, False, False, None))
    if fname in current:
        reason = f"device no longer eligible: {why}"
        if intent.grace_seconds:
            reason += f" (grace period of {intent.grace_seconds}s expired)"
        out.changes.append(Change(fname, intent.name, "remove", (reason,)))


def _inputs_digest(ctx: _Context, device: Device, placements: Iterable[PlacementRecord]) -> str:
    h = hashlib.sha256(f"compiler {COMPILER_VERSION}\ncaps {device.digest}\n".encode())
    for record in sorted(placements, key=lambda p: p.intent):
        if record.intent in ctx.intents.usable:
            intent_record = ctx.intents.record(record.intent)
            h.update(f"{record.intent} {intent_record.digest} {intent_record.app_digest}\n"
                     .encode())
    return "sha256:" + h.hexdigest()


def _needs_compile(ctx: _Context, device: Device, record: DeviceRecord | None,
                   in_grace: set[str], placed_by_changed: set[str]) -> bool:
    """Whether anything that decides this device's tree may have changed."""
    if record is None or record.caps_digest != device.digest:
        return True
    if device.id in in_grace or device.id in placed_by_changed:
        return True  # a grace period may have run out / a changed intent placed it before
    return any(
        (usable := ctx.intents.usable.get(name)) is not None
        and ctx.targets.targets(usable[0], device.id)
        for name in ctx.changed)


@dataclass(frozen=True, slots=True)
class _Job:
    """Everything a device's compile needs from Git and the state, read up front."""

    device: Device
    record: DeviceRecord | None
    previous: dict[str, PlacementRecord]
    tree: dict[str, str] | None
    current: dict[str, bytes]
    reuse: bool


@dataclass(frozen=True, slots=True)
class _Work:
    outcome: _DeviceOutcome
    message: str | None  # None: the tree did not change


def _work(ctx: _Context, job: _Job) -> _Work:
    """Compile one device: pure, so it can run in a worker process."""
    device, record = job.device, job.record
    caps_changed = record is not None and record.caps_digest != device.digest
    outcome = _compile_device(ctx, device, job.current, job.previous, caps_changed,
                              reuse=job.reuse)
    if outcome.problems or (job.tree is not None and job.tree == {
            f: blob_id(d) for f, d in outcome.files.items()}):
        return _Work(outcome, None)
    trailers = {"Fleet-Source": ctx.source.revision, "Capabilities-Digest": device.digest,
                "Inputs-Digest": _inputs_digest(ctx, device, outcome.placements)}
    return _Work(outcome, commit_message(device.id, outcome.changes, trailers))


#: Compiles that evaluate at least this many (device, intent) pairs are spread over worker
#: processes (below it, starting workers costs more than it saves).
PARALLEL_THRESHOLD = 10_000
_FORKED: tuple[_Context, list[_Job]] | None = None  # what forked workers inherit


def _work_range(bounds: tuple[int, int]) -> list[_Work]:
    assert _FORKED is not None
    ctx, jobs = _FORKED
    return [_work(ctx, jobs[i]) for i in range(*bounds)]


def _worker_count(evaluations: int) -> int:
    configured = os.environ.get("MARGO_COMPILE_WORKERS")
    if configured:
        return max(1, int(configured))
    if evaluations < PARALLEL_THRESHOLD or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return min(os.cpu_count() or 1, 4)


def _run_jobs(ctx: _Context, jobs: list[_Job], progress: Progress | None) -> list[_Work]:
    """Compile the devices, in forked worker processes when there are many (rendering is
    pure Python, and the fleet server's machines have more than one core)."""
    global _FORKED
    evaluated = sum(len(ctx.changed) if job.reuse else len(ctx.intents.usable) for job in jobs)
    workers = _worker_count(evaluated)
    if workers <= 1:
        return [_work(ctx, job) for job in (progress(jobs, len(jobs)) if progress else jobs)]
    for name, (intent, _) in ctx.intents.usable.items():
        if name in ctx.changed or not all(job.reuse for job in jobs):
            ctx.targets.targeted(intent)  # computed once here, inherited by every worker
    step = max(1, len(jobs) // (workers * 8))
    ranges = [(start, min(start + step, len(jobs))) for start in range(0, len(jobs), step)]
    _FORKED = (ctx, jobs)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            parts = pool.imap(_work_range, ranges)
            return [work for part in (progress(parts, len(ranges)) if progress else parts)
                    for work in part]
    finally:
        _FORKED = None


def compile_fleet(source: FleetSource, snapshot: Snapshot, store: DeviceStore,
                  state: CompilerState, *, now: float | None = None, dry_run: bool = False,
                  progress: Progress | None = None) -> CompileReport:
    """Compile every device of the snapshot; commit (unless `dry_run`) and report."""
    now = time.time() if now is None else now
    intents = resolve_intents(source)
    previous_intents = state.intents()
    current_records = {name: intents.record(name) for name in intents.usable}
    changed = {n for n, r in current_records.items() if previous_intents.get(n) != r}
    changed |= {n for n in previous_intents if n not in current_records
                and n not in intents.frozen}
    ctx = _Context(source, intents, previous_intents, changed, ProfileConstraints(), now,
                   TargetIndex(snapshot.devices))
    report = CompileReport(source.revision, devices=len(snapshot.devices))
    report.errors.extend((None, p) for p in [*source.problems, *intents.problems,
                                            *snapshot.problems])
    state.bind(store.identity, compiler_version=COMPILER_VERSION)
    previous_devices = state.devices()
    in_grace, placed_by_changed = state.devices_in_grace(), state.devices_placed_by(changed)
    jobs: list[_Job] = []
    for device_id in sorted(snapshot.devices):
        device = snapshot.devices[device_id]
        record = previous_devices.get(device_id)
        if not _needs_compile(ctx, device, record, in_grace, placed_by_changed):
            report.unchanged += 1
            report.deployments += record.deployments if record else 0
            continue
        tree = store.tree_ids(device_id)
        reuse = (record is not None and tree is not None and record.caps_digest == device.digest
                 and record.tree == store.tree_id(device_id))
        jobs.append(_Job(device, record, state.placements_for(device_id), tree,
                         (store.read_files(device_id) or {}) if tree is not None else {}, reuse))
    commits: list[DeviceCommit] = []
    device_records: dict[str, DeviceRecord] = {}
    placement_records: list[PlacementRecord] = []
    forget: list[str] = []
    for job, work in zip(jobs, _run_jobs(ctx, jobs, progress), strict=True):
        device_id, outcome = job.device.id, work.outcome
        result = DeviceResult(device_id, "unchanged", outcome.changes, outcome.problems,
                              notes=outcome.notes, grace_until=outcome.grace_until)
        report.results.append(result)
        if outcome.problems:
            result.status, result.changes = "error", []
            report.errors.extend((device_id, p) for p in outcome.problems)
            report.deployments += len(job.current)
            forget.append(device_id)
            continue
        report.deployments += len(outcome.files)
        device_records[device_id] = DeviceRecord(device_id, job.device.digest, now,
                                                 store.tree_id(device_id) or "",
                                                 len(outcome.files))
        placement_records.extend(outcome.placements)
        if work.message is None:
            report.unchanged += 1
            continue
        commits.append(DeviceCommit(device_id, outcome.files, work.message, int(now)))
        result.status = "committed"
        report.commits += 1
    if dry_run:
        return report
    if commits:
        with store.lock():
            tips = store.write(commits)
        for result in report.results:
            result.commit = tips.get(result.device_id, result.commit)
        for device_id in tips:
            record = device_records[device_id]
            device_records[device_id] = DeviceRecord(
                device_id, record.caps_digest, record.compiled_at,
                store.tree_id(device_id) or "", record.deployments)
    state.save(intents=current_records.values(),
               forget_intents=[n for n in previous_intents if n not in current_records
                               and n not in intents.frozen],
               devices=device_records.values(), placements=placement_records,
               forget_devices=forget)
    return report
