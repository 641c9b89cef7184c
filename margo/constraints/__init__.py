"""Margo placement: does a device satisfy a profile's `deviceConstraints` — and if not, why?

The WFM asks this for every (profile, device) pair, and a device client asks it before every
deployment, so constraints are compiled once (JSON Pointers split, quantities parsed, value
lists turned into typed sets, every clause validated) and then evaluated against many devices
with no parsing or regex work at evaluate time.

Two things shape the design:

* A "no" must be actionable. Evaluation never stops at the first failing clause: every failing
  capacity requirement and every failing expression of every rule is reported as a `Failure`
  with the required and the actual value and a sentence ("needs 4Gi memory, has 3.5Gi").
* A mistake in a constraint must never silently widen matching. Unknown fields, unknown
  operators, malformed pointers, mixed-type value lists and unparsable quantities are
  compile errors (`DocumentError`, one located `Problem` per bad clause), and at evaluate time
  every doubtful comparison — a missing key, a string where a number was asked for, a list
  where a scalar was asked for — evaluates to "does not match".

Semantics follow the spec's deviceConstraints section (capacity, then OR across rules, AND
within a rule and within a selector) plus the older `requiredResources` block; `cpus` entries
are placement units and are never summed.

Two extensions live inside `deviceConstraints["x-margo-gitops-extensions"]`, where the spec
requires them to be copied verbatim to devices (docs/intents.md, "Requirements on Kubernetes
clusters"):

* `cluster`: node-aware requirements on a Kubernetes cluster ("2 nodes with >= 2 cores and 4Gi
  available", a Kubernetes version range, API groups, CRDs, a default storage class), read
  from the cluster body a device reports under its root `x-margo-gitops-extensions.cluster`.
  A device that reported no cluster fails every such requirement: absence never passes.
* `deviceCharacteristics`: the schema-agnostic matching DRAFT (key, optional property
  pointer, operators including `GtEq`/`LtEq`), evaluated by the same expressions and
  explained in the same words.

Every evaluation reads a device's *matching view* (`matching_view`): its `properties` with its
root `x-...-extensions` and its cluster sections (`metadata`, `apiSurface`, `resources`,
`capabilities`) merged in, so a propertySelector pointer reaches whatever the device reported.
Callers build the view once per device, not once per evaluation.

Layout: one module per dialect, each holding its compile step next to its checks, on a small
shared core; private names never leave their module (tests/margo/test_constraints_layout.py).

    core        vocabulary (shared words, MISSING), results (Failure, MatchResult, wording),
                problems (ProblemCollector), pointers (JSON Pointers, the matching view),
                compiled (Check, CompiledConstraints)
    dialects    capacity (capacityRequirements: cpu, memory, storage)
                required_resources (the older requiredResources: + peripherals, interfaces)
                expressions (matchExpressions: selectors and operators)
                rules (eligibilityRules)      characteristics (the draft deviceCharacteristics)
                cluster (the cluster clause) -> cluster_nodes, cluster_version,
                cluster_features, on cluster_report (reading a reported cluster)
    top         compiler (compile_constraints: hands each clause to its dialect), demand

A new clause goes into its dialect's module (or a new module beside them) and is wired in
by one line of `compiler` or `cluster`; a new operator goes into `expressions`.
"""

from __future__ import annotations

from margo.constraints.cluster_version import parse_version_range
from margo.constraints.compiled import CompiledConstraints
from margo.constraints.compiler import compile_constraints, match
from margo.constraints.demand import Demand, GpuClaim, Usage, demand_of
from margo.constraints.pointers import cluster_of, matching_view, parse_pointer
from margo.constraints.results import Failure, MatchResult
from margo.constraints.vocabulary import (
    ARCHITECTURE_ALIASES,
    CLUSTER_SECTIONS,
    DEVICE_CHARACTERISTIC,
    DRAFT_OPERATORS,
    EXTENSION,
    OPERATORS,
)

__all__ = [
    "ARCHITECTURE_ALIASES",
    "CLUSTER_SECTIONS",
    "DEVICE_CHARACTERISTIC",
    "DRAFT_OPERATORS",
    "EXTENSION",
    "OPERATORS",
    "CompiledConstraints",
    "Demand",
    "Failure",
    "GpuClaim",
    "MatchResult",
    "Usage",
    "cluster_of",
    "compile_constraints",
    "demand_of",
    "match",
    "matching_view",
    "parse_pointer",
    "parse_version_range",
]
