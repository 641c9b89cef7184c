"""`margo device doctor [--config FILE | --kubeconfig FILE [--context C]] [--json]`: does
this Kubernetes cluster meet the Margo cluster requirements?

The checks live in `reconciler.kubernetes.doctor`; this module finds the cluster, prints and
picks the exit status with the conventions of `margo validate` and `margo lint-chart`, so
scripts treat them alike: 0 pass or warnings only, 1 any failed check, 2 unusable input (no
cluster reachable, an unreadable kubeconfig or configuration).

Which cluster: with `--config`, the one the device client's configuration uses (its
`capabilities.kubernetes` settings, else the Helm driver's kubeconfig), and then this host's
data directory also tells whether that client runs; a configuration of a device that is no
cluster (the Compose or render driver) is checked on this host: its client, and whether its
OpenTelemetry collector answers OTLP at `telemetry.collector`; with `--kubeconfig`, that file; with
neither, what kubectl would use ($KUBECONFIG, ~/.kube/config) or, in a pod, its service
account.

The Kubernetes client and checks are imported when a check runs: `margo device run`
imports this module (the `doctor` verb is its sibling), and a Compose device never needs
them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from margo_cli.device_config import device_config
from margo_cli.usage import EXIT_FAILED, EXIT_OK, UsageError
from reconciler.config import DeviceConfig
from reconciler.datadir import LocalClient, probe_data_dir

if TYPE_CHECKING:
    from reconciler.kubernetes.client import KubeClient
    from reconciler.kubernetes.doctor import Check, DoctorReport

__all__ = ["Target", "UsageError", "format_table", "register", "resolve_target", "run"]



@dataclass(frozen=True)
class Target:
    """The cluster to check: a kubeconfig (None: the pod's service account) and context,
    plus what this host knows about the device client (None: nothing)."""

    kubeconfig: Path | None
    context: str | None = None
    local_client: LocalClient | None = None
    #: A device that is no cluster (Compose, render): its configuration, checked on this host.
    host: DeviceConfig | None = None
    #: The configured device's encryption key file (None: no configuration given).
    key: Path | None = None


def register(verbs: Any) -> None:
    """Add `doctor` to the `margo device` verbs."""
    sub = verbs.add_parser(
        "doctor", help="check a Kubernetes cluster against the Margo cluster requirements",
        description="Check the cluster's control plane, nodes, OpenTelemetry collector, "
                    "Helm engine and device client against the Margo cluster requirements. "
                    "Exit 0 on pass or warnings, 1 when a check failed, 2 when no cluster "
                    "can be read.")
    source = sub.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE",
                        help="device client configuration: check the cluster it uses")
    source.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig of the cluster")
    sub.add_argument("--context", metavar="C", help="kubeconfig context (default: current)")
    sub.add_argument("--json", action="store_true",
                     help='print {"verdict": ..., "checks": [{"id", "scope", "status", '
                          '"message"}]}')
    sub.set_defaults(run=run)


def _implicit(context: str | None, environ: Mapping[str, str]) -> Target:
    from reconciler.kubernetes.client import default_kubeconfig

    found = default_kubeconfig(environ)
    if found is not None:
        return Target(found, context)
    if environ.get("KUBERNETES_SERVICE_HOST"):
        if context:
            raise UsageError("--context needs a kubeconfig; none was found")
        return Target(None)
    raise UsageError("no cluster given: use --kubeconfig FILE or --config FILE (no "
                     "$KUBECONFIG, no ~/.kube/config, not running in a pod)")


def _from_config(path: str, environ: Mapping[str, str]) -> Target:
    config = device_config(path)
    local, key = probe_data_dir(config.data_dir), config.encryption_key
    if config.kubernetes is not None:
        return Target(config.kubernetes["kubeconfig"], config.kubernetes["context"], local,
                      key=key)
    if config.kubeconfig is not None:
        return Target(config.kubeconfig, config.kube_context, local, key=key)
    if config.driver == "helm":  # Helm reads the default kubeconfig, so do we
        implicit = _implicit(config.kube_context, environ)
        return Target(implicit.kubeconfig, implicit.context, local, key=key)
    return Target(None, None, local, host=config, key=key)  # Compose or render: this host


def resolve_target(args: argparse.Namespace,
                   environ: Mapping[str, str] | None = None) -> Target:
    """The cluster the command line names (`UsageError` when none can be found)."""
    env = os.environ if environ is None else environ
    if args.config:
        if args.context:
            raise UsageError("--context goes with --kubeconfig; the configuration names "
                             "its own context")
        return _from_config(args.config, env)
    if args.kubeconfig:
        return Target(Path(args.kubeconfig), args.context)
    return _implicit(args.context, env)


def _open(target: Target) -> KubeClient:
    from reconciler.kubernetes.client import KubeClient

    if target.kubeconfig is None:
        return KubeClient.in_cluster()
    return KubeClient.from_kubeconfig(target.kubeconfig, target.context)


def format_table(report: DoctorReport) -> str:
    """A table for people: one row per check, then the verdict."""
    kind = f", {report.platform}" if report.platform else ""
    title = (f"cluster {report.server}: Kubernetes {report.kubernetes_version}{kind}"
             if report.kubernetes_version else report.server)
    lines = [title,
             f"{'SCOPE':<8} {'CHECK':<19} {'STATUS':<8} MESSAGE"]
    lines += [f"{c.scope:<8} {c.id:<19} {c.status:<8} {c.message}" for c in report.checks]
    counts = {s: sum(c.status == s for c in report.checks)
              for s in ("pass", "warn", "fail", "unknown")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    failed = f"; failed: {', '.join(report.failures)}" if report.failures else ""
    lines.append(f"verdict: {report.verdict} ({summary}{failed})")
    return "\n".join(lines)


def _host_report(config: DeviceConfig, local: LocalClient | None) -> DoctorReport:
    """A device that is no cluster: the device client on this host, and its collector
    (`reconciler.telemetry.probe`: the configured endpoint answers OTLP)."""
    from reconciler.kubernetes.doctor import Check, DoctorReport
    from reconciler.telemetry.probe import probe_collector

    if local is not None and local.running:
        client = Check("wfm-client", "leader", "pass", local.detail)
    else:
        client = Check("wfm-client", "leader", "fail" if local is not None else "unknown",
                       local.detail if local is not None else "not checked")
    if config.telemetry is None:
        collector = Check("otel-collector", "leader", "fail", "no collector is configured: "
                          "set telemetry.collector to the OTLP/HTTP URL of this device's "
                          "OpenTelemetry collector (Margo requires one on hosting devices)")
    else:
        probe = probe_collector(config.telemetry)
        collector = Check("otel-collector", "leader", "pass" if probe.found else "fail",
                          probe.detail)
    return DoctorReport(checks=(client, collector), server=f"{config.driver} device "
                        f"{config.device_id} on {platform.node()}")


def key_check(path: Path) -> Check:
    """`encryption-key`: the device's own key for sealed values (docs/secrets.md) can be
    read; none yet is a warning (the client makes it at its first start)."""
    from reconciler.encryption_key import DeviceKey, EncryptionKeyError
    from reconciler.kubernetes.doctor import Check

    try:
        key = DeviceKey.existing(path)
    except (EncryptionKeyError, OSError) as exc:
        return Check("encryption-key", "leader", "fail", str(exc))
    if key is None:
        return Check("encryption-key", "leader", "warn", f"{path} does not exist yet: the "
                     "client makes it at its first start; until then the device can receive "
                     "no sensitive values")
    previous = key.previous_recipient()
    return Check("encryption-key", "leader", "pass", f"{path}: recipient {key.recipient()}"
                 + (f" (previous {previous} kept after a rotation)" if previous else ""))


def _with_key(report: DoctorReport, target: Target) -> DoctorReport:
    if target.key is None:
        return report
    return dataclasses.replace(report, checks=(*report.checks, key_check(target.key)))


def run(args: argparse.Namespace) -> int:
    from reconciler.kubernetes.client import KubeConfigError, KubeError
    from reconciler.kubernetes.doctor import doctor

    target = resolve_target(args)
    if target.host is not None:
        report = _with_key(_host_report(target.host, target.local_client), target)
        print(json.dumps(report.to_json(), indent=2) if args.json else format_table(report))
        return EXIT_FAILED if report.verdict == "fail" else EXIT_OK
    try:
        client = _open(target)
    except (KubeConfigError, OSError) as exc:
        raise UsageError(f"cannot use the cluster's credentials: {exc}") from None
    with client:
        try:
            report = _with_key(doctor(client, local_client=target.local_client), target)
        except KubeError as exc:
            what = "no cluster reachable" if exc.unreachable else "cannot read the cluster"
            raise UsageError(f"{what} at {client.access.server}: {exc}") from None
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(format_table(report))
    return EXIT_FAILED if report.verdict == "fail" else EXIT_OK
