"""What the device's next cycle would do, without doing it (`margo device plan`).

The adopted desired state (nothing is fetched: the plan is about what this device already
holds) is planned against what the engine says is installed, exactly as a cycle plans it,
telemetry digests included (`reconciler.telemetry.with_injection`). For every desired
component the preview also shows, container by container, which Margo telemetry variables
the device injects and which the workload sets itself: the chart is rendered with its
values and run through the same post-render step the Helm driver applies; the Compose
package is pulled and read as the Compose driver reads it.

Reading only: the state file is opened beside a running client (SQLite WAL), never created;
charts and packages land in the client's caches as a cycle would put them there.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from reconciler.config import DeviceConfig
from reconciler.desired import DesiredComponent, DesiredDeployment, parse_deployment
from reconciler.errors import ApplyError
from reconciler.planner import Action, Step, plan
from reconciler.telemetry import with_injection

__all__ = ["ComponentPreview", "Preview", "preview"]


@dataclass(frozen=True)
class ComponentPreview:
    step: Step
    #: (where, added variables, the workload's own): one row per container or service.
    injection: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)
    problem: str = ""  # why the injection could not be shown


@dataclass(frozen=True)
class Preview:
    version: str | None
    variables: dict[str, str]
    components: list[ComponentPreview]

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "telemetry": self.variables, "steps": [{
            "action": str(c.step.action), "deploymentId": c.step.deployment_id,
            "component": c.step.component, "release": c.step.release_name,
            "reason": c.step.reason, **({"problem": c.problem} if c.problem else {}),
            "injection": [{"where": w, "added": list(a), "kept": list(k)}
                          for w, a, k in c.injection]} for c in self.components]}


def _injection_rows(config: DeviceConfig, stack: ExitStack, deployment: DesiredDeployment,
                    component: DesiredComponent, step: Step, cache: dict[str, Any]
                    ) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    injection = config.telemetry.inject if config.telemetry else None
    if injection is None:
        return []
    if deployment.profile_type == "compose":
        from reconciler.compose_package import validate_package
        from reconciler.oci import OciClient
        from reconciler.registry_credentials import as_pairs
        from reconciler.telemetry.inject import compose_injection

        if "oci" not in cache:
            cache["oci"] = stack.enter_context(OciClient(
                credentials=as_pairs(config.registry_credentials)))
        package = validate_package(cache["oci"].pull(component.repository,
                                                     component.revision).data)
        return [(f"service {s.service}", tuple(s.added), s.kept)
                for s in compose_injection(package.compose, package.files, injection)]
    from reconciler.charts import ChartCache
    from reconciler.telemetry.inject import inject_files

    if "charts" not in cache:
        cache["charts"] = stack.enter_context(ChartCache(
            config.data_dir / "charts", credentials=config.registry_credentials))
    charts = cache["charts"]
    chart = charts.load(charts.fetch(component.repository, component.revision))
    rendered = chart.render(dict(component.values), name=step.release_name,
                            namespace=deployment.namespace)
    _, rows = inject_files(rendered, injection)
    return [(f"{r.object} {r.container}", r.added, r.kept) for r in rows]


def preview(config: DeviceConfig) -> Preview:
    """The plan of the next cycle over the adopted state (see the module docstring).
    `StateError` for a damaged state file; `ApplyError` when the engine cannot be read."""
    from reconciler.assembly import open_driver
    from reconciler.state import DeviceState

    injection = config.telemetry.inject if config.telemetry else None
    variables = injection.variables() if injection else {}
    path = config.data_dir / "device-state.sqlite"
    if not path.exists():
        return Preview(None, variables, [])
    with ExitStack() as stack:
        state = stack.enter_context(DeviceState(path))
        _, version, _ = state.adopted_marker()
        desired = with_injection([parse_deployment(data, file="adopted")
                                  for data in state.desired_documents()], injection)
        driver = open_driver(config, stack)
        the_plan = plan(desired, driver.installed(), component_order=state.component_orders())
        cache: dict[str, Any] = {}
        out = []
        for dplan in the_plan.deployments:
            for step in dplan.steps:
                if dplan.deployment is None or step.desired is None \
                        or step.action is Action.REMOVE:
                    out.append(ComponentPreview(step))
                    continue
                try:
                    rows = _injection_rows(config, stack, dplan.deployment, step.desired,
                                           step, cache)
                except (ApplyError, OSError, ValueError) as exc:
                    out.append(ComponentPreview(step, problem=str(exc)))
                    continue
                out.append(ComponentPreview(step, rows))
        return Preview(version, variables, out)
