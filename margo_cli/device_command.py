"""`margo device run|once --config FILE` (the device client), `margo device doctor`
(a cluster or host checked against the Margo requirements, see doctor_command),
`margo device plan` (the next cycle, without doing it: plan_command), `margo device
capabilities` (what would be reported) and `margo device rotate-key` (a new encryption key
for sealed values; the previous one is kept for values still sealed to it).

`once` runs one cycle and exits 0 when the device converged (or the schedule says not to
contact the server now), 1 when anything failed (a step, a fetch, a capability report), 2 when
the configuration is unusable. `run` cycles on the configured
schedule until SIGTERM or SIGINT, finishing the step in progress first.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Any

from margo.errors import DocumentError
from margo.heap import release_freed_memory
from margo_cli import doctor_command, plan_command
from margo_cli.device_config import device_config
from margo_cli.go_runtime import restart_with_engine_settings
from margo_cli.usage import UsageError
from reconciler.runner import CycleResult

__all__ = ["describe", "register", "run", "run_capabilities", "run_rotate_key"]


def register(commands: Any) -> None:
    parser = commands.add_parser("device", help="the device client: converge on desired state")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb, text in (("run", "cycle on the configured schedule until stopped"),
                       ("once", "run one cycle; exit 0 when converged, 1 otherwise")):
        sub = verbs.add_parser(verb, help=text)
        sub.add_argument("--config", required=True, metavar="FILE",
                         help="device client configuration (YAML)")
        sub.add_argument("--json", action="store_true", help="print each cycle as JSON")
        sub.add_argument("--log-level", default="info",
                         choices=["debug", "info", "warning", "error"])
        sub.set_defaults(run=run, once=verb == "once")
    doctor_command.register(verbs)
    plan_command.register(verbs)
    show = verbs.add_parser("capabilities", help="print the capabilities this device would "
                            "report (its configured provider, no debouncing)")
    show.add_argument("--config", required=True, metavar="FILE")
    show.add_argument("--format", choices=["margo", "cluster"], default="margo",
                      help="margo: the rc.3 DeviceCapabilitiesManifest (default); cluster: "
                      "the proposal's ClusterCapabilitiesManifest (Kubernetes clusters only)")
    show.set_defaults(run=run_capabilities)
    rotate = verbs.add_parser(
        "rotate-key", help="make a new encryption key for sealed values, keeping the previous "
        "one until the server has sealed them again",
        description="Write a new age X25519 identity as the device's encryption key and keep "
                    "the current one as the previous key (the one before is dropped): values "
                    "still sealed to it keep opening until the server, told the new key by "
                    "the next capability report, seals them again. A running client picks "
                    "the new key up at its next cycle. Rotate again only after that.")
    rotate.add_argument("--config", required=True, metavar="FILE")
    rotate.set_defaults(run=run_rotate_key)


def run_rotate_key(args: argparse.Namespace) -> int:
    """Rotate the configured encryption key; print the old and the new recipient."""
    from reconciler.encryption_key import EncryptionKeyError, previous_path, rotate_key

    config = device_config(args.config)
    try:
        old, new = rotate_key(config.encryption_key)
    except (EncryptionKeyError, OSError) as exc:
        print(f"margo device rotate-key: {exc}", file=sys.stderr)
        return 1
    print(f"new encryption key: {new} ({config.encryption_key})")
    if old is not None:
        print(f"previous key, kept until the server re-seals: {old} "
              f"({previous_path(config.encryption_key)})")
    return 0


def run_capabilities(args: argparse.Namespace) -> int:
    """What would be reported now, as JSON: for checking a provider's mapping by eye, or
    for sending the cluster proposal's manifest to a server that takes it."""
    from margo.cluster import cluster_manifest_from_capabilities
    from reconciler.assembly import capability_provider
    from reconciler.capabilities import with_encryption_key
    from reconciler.encryption_key import DeviceKey
    from reconciler.kubernetes.provider import KubernetesProvider

    config = device_config(args.config)
    provider = capability_provider(config)
    if provider is None:
        raise UsageError(f"{args.config}: no capabilities provider is configured")
    try:
        doc = (provider.observe() if isinstance(provider, KubernetesProvider)
               else provider.gather())
        key = DeviceKey.existing(config.encryption_key)  # the client creates it, not this
        if key is not None:
            doc = with_encryption_key(doc, key.recipient())
        if args.format == "cluster":
            doc = cluster_manifest_from_capabilities(doc)
    except (DocumentError, OSError, ValueError) as exc:
        print(f"margo device capabilities: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2, sort_keys=True))
    return 0


def describe(result: CycleResult) -> str:
    """One short paragraph per cycle, for people watching a terminal or a journal."""
    if not result.contacted:
        return "outside the polling window or in downtime: nothing contacted"
    lines = [f"desired state: {result.fetched}" + (f" ({result.version})"
                                                   if result.version else "")]
    lines += [f"  {action:<11} {deployment[:8]} {component}: {outcome}"
              for action, deployment, component, outcome in result.steps]
    lines += [f"  ! {failure}" for failure in result.failures]
    lines.append(("converged" if result.converged else "not converged")
                 + f"; reports delivered {result.delivered}, queued {result.pending_reports}")
    return "\n".join(lines)


def _as_json(result: CycleResult) -> str:
    return json.dumps({
        "contacted": result.contacted, "fetched": result.fetched, "version": result.version,
        "steps": [{"action": a, "deploymentId": d, "component": c, "outcome": o}
                  for a, d, c, o in result.steps],
        "failures": result.failures, "converged": result.converged,
        "delivered": result.delivered, "pendingReports": result.pending_reports})


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    config = device_config(args.config)
    restart_with_engine_settings(config.driver)  # GOGC for the Helm engine: go_runtime
    from reconciler.assembly import open_reconciler
    from reconciler.datadir import BusyError
    from reconciler.encryption_key import EncryptionKeyError
    from reconciler.identity_errors import IdentityError, OnboardingError, SigningError
    from reconciler.state import StateError

    def show(result: CycleResult) -> None:
        print(_as_json(result) if args.json else describe(result), flush=True)
        release_freed_memory()  # what the cycle freed, handed back while the client waits

    try:
        with open_reconciler(config) as reconciler:
            if args.once:
                result = reconciler.cycle()
                show(result)
                # A cycle skipped by the schedule failed at nothing: exit 0.
                return 0 if result.converged or not result.contacted else 1

            def stop(signum: int, _frame: Any) -> None:
                logging.getLogger("margo.device").info(
                    "signal %d: stopping after the current step", signum)
                reconciler.stopping.set()

            signal.signal(signal.SIGTERM, stop)
            signal.signal(signal.SIGINT, stop)
            reconciler.run(on_cycle=show)
            return 0
    except BusyError as exc:
        raise UsageError(str(exc)) from None
    except StateError as exc:  # damaged, foreign or newer state: the message says what to do
        raise UsageError(str(exc)) from None
    except (IdentityError, SigningError, OnboardingError) as exc:
        raise UsageError(f"{args.config}: identity: {exc}") from None
    except EncryptionKeyError as exc:
        raise UsageError(f"{args.config}: encryption key: {exc}") from None
