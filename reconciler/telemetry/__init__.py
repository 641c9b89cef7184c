"""The Margo observability requirements on the device: what is injected into the workloads
the device deploys, and where the device client's own telemetry goes.

Margo requires every hosting device to run an OpenTelemetry collector that receives OTLP,
and to inject into every container it deploys `HTTP_OTEL_EXPORTER_OTLP_ENDPOINT` (and,
where configured, `GRPC_OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_CERTIFICATE`,
`OTEL_EXPORTER_OTLP_PROTOCOL`). It must not pre-configure exporters nor instrument workloads
it does not own: so exactly these variables are set, never the SDKs' own
`OTEL_EXPORTER_OTLP_ENDPOINT`, and never where the workload set the variable itself.

The settings come from the device configuration's `telemetry:` section
(`reconciler.config`). The pieces:

- `inject`: the Compose override entries and the Helm post-renderer over rendered
  manifests (pure functions);
- `helmplugin`: the Helm post-renderer plugin the Helm driver names on every install and
  upgrade;
- `export`: the client's own metrics and logs through the OpenTelemetry SDK (imported only
  when telemetry is configured);
- `probe`: is the collector there (the doctor and the capability report).

A change of what is injected must reach running workloads, so `with_injection` folds the
injected variables into each component's `values_digest`: the planner then reconfigures
every component once, exactly as for a change of its parameters. A device without a
`telemetry:` section keeps its digests unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kept light: Helm's post-renderer process imports this package
    from reconciler.desired import DesiredDeployment

__all__ = ["CERTIFICATE", "GRPC_ENDPOINT", "HTTP_ENDPOINT", "PROTOCOL", "PROTOCOLS",
           "VARIABLES", "Injection", "TelemetryConfig", "with_injection"]

HTTP_ENDPOINT = "HTTP_OTEL_EXPORTER_OTLP_ENDPOINT"
GRPC_ENDPOINT = "GRPC_OTEL_EXPORTER_OTLP_ENDPOINT"
CERTIFICATE = "OTEL_EXPORTER_OTLP_CERTIFICATE"
PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
#: Every variable the device may inject, in the order they are added to a container.
VARIABLES = (HTTP_ENDPOINT, GRPC_ENDPOINT, CERTIFICATE, PROTOCOL)
PROTOCOLS = ("http/protobuf", "grpc")


@dataclass(frozen=True)
class Injection:
    """What every container the device deploys gets (unless it sets the variable itself).

    `certificate` is the PEM's path inside the container; `certificate_file`, when given, is
    the host file the Compose driver bind-mounts there read-only (Kubernetes pods must get
    the file from their chart or image: a host path means nothing on another node)."""

    http_endpoint: str
    grpc_endpoint: str | None = None
    certificate: str | None = None
    certificate_file: Path | None = None
    protocol: str = "http/protobuf"

    def variables(self) -> dict[str, str]:
        """The variables, in `VARIABLES` order; the optional ones only when configured (the
        protocol always: `http/protobuf` unless told otherwise)."""
        found = {HTTP_ENDPOINT: self.http_endpoint, GRPC_ENDPOINT: self.grpc_endpoint,
                 CERTIFICATE: self.certificate, PROTOCOL: self.protocol}
        return {name: value for name, value in found.items() if value}


@dataclass(frozen=True)
class TelemetryConfig:
    """The `telemetry:` section. `collector` is the collector's OTLP/HTTP base URL as the
    device client reaches it: its own telemetry goes there (when `export`), and the doctor
    and the capability report probe it. `inject` is what workloads get (their view of the
    same collector, which may differ: a container reaches the host by another address)."""

    collector: str
    inject: Injection | None
    export: bool = True
    interval: float = 30.0
    timeout: float = 5.0
    ca_file: Path | None = None


def with_injection(deployments: Iterable[DesiredDeployment],
                   injection: Injection | None) -> list[DesiredDeployment]:
    """The deployments as the planner must see them on a device that injects: each
    component's `values_digest` also covers the injected variables, so a change of them is
    a `reconfigure` (installed releases carry the digest they were applied with)."""
    if injection is None:
        return list(deployments)
    from margo.digests import data_digest

    variables = injection.variables()
    out = []
    for deployment in deployments:
        components = tuple(dataclasses.replace(c, values_digest=data_digest(
            {"values": c.values_digest, "telemetry": variables})) for c in deployment.components)
        out.append(dataclasses.replace(deployment, components=components))
    return out
