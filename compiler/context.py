"""What one compile knows and shares across its devices: the usable intents, what changed
since the last compile, and the caches every device's compile reads (`CompileContext`).

Built once by `compiler.planning`, then read by every device's compile
(`compiler.device_compile`), in this process or in forked workers that inherit it. What is
true of one device only (its tree, its placements, its capacity) is never kept here: that is
`compiler.decisions.DeviceRound`, made afresh for each device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compiler.intents import Intent
from compiler.placement import ProfileConstraints
from compiler.render import RenderCache, file_name, plain_value_problem
from compiler.rollout import RolloutPlan
from compiler.secrets import is_secret
from compiler.source import AppVersion, FleetSource
from compiler.state import IntentRecord
from compiler.storedfiles import StoredFiles
from compiler.targeting import TargetIndex
from margo.errors import Problem
from margo.models import DeploymentProfile
from margo.parameters import validate_value

__all__ = ["COMPILER_VERSION", "CompileContext", "ResolvedIntents", "resolve_intents",
           "source_problems"]

#: Bumped when the compiler's output for the same inputs changes, forcing re-rendering.
#: 2: placements see root extensions and cluster sections. 3: a string ending in a newline
#: is quoted in the YAML (written plain, it lost the newline). 4: capacity accounting.
COMPILER_VERSION = "4"


@dataclass
class ResolvedIntents:
    usable: dict[str, tuple[Intent, AppVersion]]
    frozen: set[str]
    problems: list[Problem]

    def record(self, name: str) -> IntentRecord:
        intent, app = self.usable[name]
        return IntentRecord(name, intent.digest, app.description.id, app.description.version,
                            app.digest, intent.placement_digest)


def resolve_intents(source: FleetSource) -> ResolvedIntents:
    """Pair each intent with its application version; freeze those that cannot be used."""
    usable: dict[str, tuple[Intent, AppVersion]] = {}
    frozen = set(source.broken_intents)
    problems: list[Problem] = []
    for name, intent in sorted(source.intents.items()):
        app = source.application(intent.application_id, intent.application_version)
        found = _unusable(source, intent, app)
        if found:
            frozen.add(name)
            problems.extend(intent.locate(problem) for problem in found)
            continue
        assert app is not None
        usable[name] = (intent, app)
    return ResolvedIntents(usable, frozen, problems)


def _unusable(source: FleetSource, intent: Intent, app: AppVersion | None) -> list[Problem]:
    """Why `intent` cannot be compiled with `app` (its application version), if it cannot."""
    if intent.application_id in source.broken_apps:
        return [Problem(("spec", "application"), f"application {intent.application_id} has "
                        "errors; devices keep this intent's previous deployments")]
    if app is None:
        wanted = intent.application_id + (f" version {intent.application_version}"
                                          if intent.application_version else "")
        known = ", ".join(sorted(source.applications.get(intent.application_id, {})))
        return [Problem(("spec", "application"), f"no application {wanted} in the fleet "
                        "source" + (f" (versions: {known})" if known else ""))]
    unknown = sorted(set(intent.parameters) - set(app.description.parameters))
    known_parameters = "one of " + ", ".join(sorted(app.description.parameters))
    return [Problem(("spec", "parameters", p), f"application {app.description.id} "
                    f"{app.description.version} has no parameter {p!r}",
                    expected=known_parameters) for p in unknown] + _value_problems(intent, app)


def _value_problems(intent: Intent, app: AppVersion) -> list[Problem]:
    """What is wrong with the intent's parameter values on every device alike, so needs no
    capabilities to find: a sensitive parameter not given as a secret, a clear value that
    looks sealed, a literal value (not an expression, not a secret) that breaks its
    configuration rule. Expressions and secrets are checked per device when rendering."""
    description = app.description
    sensitive = description.sensitive_parameters()
    settings = description.settings()
    problems: list[Problem] = []
    for name, compiled in intent.parameters.items():
        if name not in description.parameters or (compiled.is_literal
                                                   and is_secret(compiled.source)):
            continue
        found = plain_value_problem(name, compiled, sensitive)
        if found is not None:
            problems.append(found)
        elif compiled.is_literal and name in settings and (
                rule := description.schemas.get(settings[name].schema)) is not None:
            problems += validate_value(compiled.source, rule, path=("spec", "parameters", name))
    return problems


def source_problems(source: FleetSource) -> list[Problem]:
    """Every problem of the source found without any device: its broken files, and intents
    the compiler cannot use (no such application or version, unknown parameters, values no
    device could take). `margo validate DIR`, `margo compile` and the hosted source's push
    check all report these."""
    return [*source.problems, *resolve_intents(source).problems]


@dataclass
class CompileContext:
    """Everything one compile shares across devices (read-only once the devices compile,
    but for the caches, which give the same answers whoever fills them first)."""

    source: FleetSource
    intents: ResolvedIntents
    previous_intents: dict[str, IntentRecord]
    changed: set[str]
    constraints: ProfileConstraints
    now: float
    targets: TargetIndex
    renders: RenderCache = field(default_factory=RenderCache)
    stored: StoredFiles = field(init=False)  # what files on devices take
    #: Every intent a device's tree may hold a file of, sorted (worked out once, not per
    #: device); a tree's other files are of deleted intents.
    names: list[str] = field(init=False)
    known: frozenset[str] = field(init=False)
    #: Name -> file name of every usable intent that did not change: what a device whose
    #: capabilities did not change either may keep exactly as last time (`keep_steady`).
    steady: dict[str, str] = field(init=False)
    steady_files: dict[str, str] = field(init=False)  # file name -> name
    #: Changed intents that place every device as last time (the same application and the
    #: same `Intent.placement_digest`, e.g. only parameters were edited): a device whose
    #: capabilities did not change either keeps its recorded placement (`place_as_before`).
    placed_as_before: frozenset[str] = field(init=False)
    #: Intent name -> the devices it targets (`TargetIndex.targeted`), looked up inline: the
    #: innermost loop asks it for every (device, intent) pair.
    targeted: dict[str, frozenset[str]] = field(default_factory=dict)
    _immutable: dict[str, bool] = field(default_factory=dict)
    _profiles: dict[tuple[str, str | None], DeploymentProfile | None] = field(
        default_factory=dict)
    classified: dict[tuple[bytes, bytes], str] = field(default_factory=dict)  # `classify`
    #: Intent name -> its rollout plan and each targeted device's wave (`compiler.rollout`),
    #: for intents whose rollout is not complete.
    rollouts: dict[str, tuple[RolloutPlan, dict[str, int]]] = field(default_factory=dict)
    #: Intent name -> its line of the inputs digest (the same for every device it placed).
    digest_lines: dict[str, bytes] = field(default_factory=dict)
    #: Each commit's objects are made and deflated where its device compiles
    #: (`DeviceWork.packed`): set for a compile that writes (a dry run shows the files).
    pack_commits: bool = False

    def __post_init__(self) -> None:
        self.stored = StoredFiles(self.source.applications, self.renders)
        self.known = frozenset(self.intents.usable) | self.intents.frozen
        self.names = sorted(self.known)
        self.steady = {name: file_name(name) for name in self.names
                       if name in self.intents.usable and name not in self.changed}
        self.steady_files = {fname: name for name, fname in self.steady.items()}
        self.placed_as_before = frozenset(
            name for name in self.changed if name in self.intents.usable
            and (before := self.previous_intents.get(name)) is not None
            and (now := self.intents.record(name)).app_digest == before.app_digest
            and now.placement_digest == before.placement_digest)

    def targeted_by(self, name: str) -> frozenset[str]:
        """The devices intent `name` (a usable one) targets."""
        found = self.targeted.get(name)
        if found is None:
            found = self.targeted[name] = self.targets.targeted(self.intents.usable[name][0])
        return found

    def profile(self, app: AppVersion, profile_id: str | None) -> DeploymentProfile | None:
        """The profile of `app` with this id, or None unless exactly one has it."""
        key = (app.digest, profile_id)
        if key not in self._profiles:
            found = [p for p in app.description.profiles
                     if profile_id is not None and p.id == profile_id]
            self._profiles[key] = found[0] if len(found) == 1 else None
        return self._profiles[key]

    def needs_previous(self, intent: Intent, app: AppVersion) -> bool:
        """Whether rendering `intent` with `app` reads the device's current document: to
        check `immutable` settings, or to keep the envelopes of unchanged secrets."""
        found = self._immutable.get(app.digest)
        if found is None:
            found = self._immutable[app.digest] = any(
                s.immutable for s in app.description.settings().values())
        return found or bool(self.renders.value_plan(intent, app).secrets)
