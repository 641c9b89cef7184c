"""The fleet dashboard served by `margo serve`: server-rendered pages for people.

Why server-rendered Jinja2 and no JavaScript framework: the pages show what the read API
already gathers (`FleetApi` is the one place that reads devices, statuses, eligibility and
history), there is no build step to break, and autoescaping makes every device-supplied
string (ids, labels, error messages, commit messages) inert text. A few lines of inline
script, allowed by a per-response CSP nonce, refresh the main content every few seconds.

With operator credentials configured, the pages require the viewer role like the read API
does: a bearer header, or `?token=` once, which signs in (`wfm.http.sessions`: an HttpOnly,
SameSite=Strict cookie the API does not take, proved again on every request). Each page
shows who is signed in and offers only what their role may do: an operator (or an admin,
or anyone on an open server) gets Pause, Resume and Abort on each rollout where the action
applies, as forms that post to `/rollouts/{intent}/{action}` with a synchronizer token; the
action is the read API's (`FleetApi.act_on_rollout`, recorded in the audit trail with `via`
`dashboard:...`), and the answer a 303 back to the overview, which shows the new state.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from compiler.source import SourceError, load_source
from margo.errors import DocumentError
from margo.kinds import Kind
from margo.models import DeploymentState
from margo.validation import validate_value
from wfm.fleet.audit import REFUSED
from wfm.fleet.compiles import SourceConfig
from wfm.fleet.rollouts import ACTIONS, actions_for
from wfm.fleet.sourcecondition import load_condition
from wfm.http.fleet_api import FleetApi
from wfm.http.sessions import COOKIE_NAME, CSRF_FIELD, SESSION_SECONDS, Session, Sessions
from wfm.identity.operators import REALM, Operator, Role, caller_address
from wfm.problems import ProblemError
from wfm.store import records

__all__ = ["COOKIE_NAME", "REFRESH_SECONDS", "STATES", "AppInfo", "Catalogue", "cpu_summary",
           "dashboard_routes", "device_kind", "device_view", "failing_clauses", "gpu_count",
           "load_catalogue", "node_count", "render_page"]

TEMPLATES = Path(__file__).resolve().parent / "templates" / "dashboard"  # package data
REFRESH_SECONDS = 5
#: Deployment states, most severe first: counts and badges are listed in this order.
STATES: tuple[str, ...] = tuple(s.value for s in DeploymentState)
EXTENSIONS = "x-margo-gitops-extensions"
LABEL_PREFIX = "k8s.margo-gitops.dev/"


# --- formatting helpers (Jinja filters) ----------------------------------------------------

def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "never"
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _iso(timestamp: float | None) -> str:
    """A valid HTML `datetime` attribute value."""
    if timestamp is None:
        return ""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ago(timestamp: float | None, now: float | None = None) -> str:
    """A rough age ("42 s ago"): what a person scanning for stale devices needs."""
    if timestamp is None:
        return "never"
    seconds = max(0, int((now if now is not None else time.time()) - timestamp))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


def _value(value: Any) -> str:
    """Required/actual values and labels as a person reads them; absent is said, not blank."""
    if value is None:
        return "(absent)"
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return ", ".join(_value(v) for v in value) if value else "(none)"
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return "-" if value is None else str(value)


def _by_severity(states: Mapping[str, int]) -> list[tuple[str, int]]:
    """Non-zero counts, most severe state first (failures lead); unknown states last."""
    rank = {state: i for i, state in enumerate(STATES)}
    return sorted(((s, n) for s, n in states.items() if n),
                  key=lambda item: (rank.get(item[0], len(STATES)), item[0]))


def _brief(message: Any, width: int = 160) -> str:
    """An error message short enough for a table cell: itself when it is one short line,
    else its first line and its last (a failing command's own last words, e.g. after
    Compose's progress lines), each cut to `width` characters. The page keeps the whole
    message beside it, folded."""
    lines = [line.strip() for line in str(message or "").splitlines() if line.strip()]
    if not lines:
        return ""
    cut = [line if len(line) <= width else line[:width - 1].rstrip() + "\u2026"
           for line in (lines[0], lines[-1])]
    return cut[0] if len(lines) == 1 else f"{cut[0]} \u2026 {cut[1]}"


_ENV = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True,
                   undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
_ENV.filters.update(when=_when, iso=_iso, ago=_ago, value=_value, number=_number,
                    by_severity=_by_severity, brief=_brief)
_ENV.globals.update(STATES=STATES, REFRESH_SECONDS=REFRESH_SECONDS, CSRF_FIELD=CSRF_FIELD)


# --- what a capability document says, for people ---------------------------------------

def progress_points(view: Mapping[str, Any], width: int = 120, height: int = 24) -> str:
    """The `points` of an SVG polyline: installed devices over the rollout's time."""
    history = view.get("history") or []
    total = sum(int(w["devices"]) for w in view.get("waves", []))
    if len(history) < 2 or total <= 0:
        return ""
    start, end = float(history[0][0]), float(history[-1][0])
    span = max(end - start, 1e-9)
    return " ".join(f"{(float(t) - start) / span * width:.1f},"
                    f"{height - min(int(n), total) / total * height:.1f}"
                    for t, n, *_ in history)


def cluster_body(document: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The Kubernetes cluster report under the root extension, when the device sent one."""
    extensions = document.get(EXTENSIONS)
    cluster = extensions.get("cluster") if isinstance(extensions, Mapping) else None
    return cluster if isinstance(cluster, Mapping) else None


def _cluster_nodes(cluster: Mapping[str, Any] | None) -> list[Mapping[str, Any]] | None:
    resources = cluster.get("resources") if cluster else None
    nodes = resources.get("nodes") if isinstance(resources, Mapping) else None
    return [n for n in nodes if isinstance(n, Mapping)] if isinstance(nodes, list) else None


def device_kind(properties: Mapping[str, Any], cluster: Mapping[str, Any] | None) -> str:
    """Kubernetes cluster / Compose box, from the supported deployment types (a cluster
    report makes a device a Kubernetes cluster whatever else it says)."""
    types = {str(t) for t in properties.get("supportedDeploymentTypes") or []}
    kinds = []
    if cluster is not None or "helm" in types:
        kinds.append("Kubernetes cluster")
    if "compose" in types:
        kinds.append("Compose box")
    return " + ".join(kinds) or "unknown"


def _kind_detail(cluster: Mapping[str, Any] | None, labels: Mapping[str, Any]) -> str:
    metadata = cluster.get("metadata") if cluster else None
    metadata = metadata if isinstance(metadata, Mapping) else {}
    platform = metadata.get("platform") or labels.get(f"{LABEL_PREFIX}platform")
    version = metadata.get("kubernetesVersion") or labels.get(f"{LABEL_PREFIX}version")
    return " ".join(str(p) for p in (platform, version) if p)


def node_count(cluster: Mapping[str, Any] | None, labels: Mapping[str, Any]) -> int | None:
    """Nodes from the cluster report, else the `k8s.margo-gitops.dev/nodes` label."""
    nodes = _cluster_nodes(cluster)
    if nodes is not None:
        return len(nodes)
    resources = cluster.get("resources") if cluster else None
    if isinstance(resources, Mapping) and isinstance(resources.get("nodeCount"), int):
        return int(resources["nodeCount"])
    label = labels.get(f"{LABEL_PREFIX}nodes")
    return label if isinstance(label, int) and not isinstance(label, bool) else None


def gpu_count(properties: Mapping[str, Any], cluster: Mapping[str, Any] | None,
              labels: Mapping[str, Any]) -> int:
    """GPUs from the cluster's nodes, else the label, else the GPU peripherals."""
    nodes = _cluster_nodes(cluster)
    if nodes is not None:
        return sum(_gpu_total(node) for node in nodes)
    label = labels.get(f"{LABEL_PREFIX}gpus")
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    peripherals = properties.get("peripherals") or []
    return sum(1 for p in peripherals if isinstance(p, Mapping) and p.get("type") == "gpu")


def _gpu_total(node: Mapping[str, Any]) -> int:
    gpus = node.get("gpus") or []
    return sum(int(g.get("count", 1)) for g in gpus
               if isinstance(g, Mapping) and isinstance(g.get("count", 1), int))


def _gpu_text(gpu: Mapping[str, Any]) -> str:
    name = " ".join(str(gpu[k]) for k in ("manufacturer", "model") if gpu.get(k))
    return f"{gpu.get('count', 1)} x {name or gpu.get('resource', 'GPU')}"


@dataclass(frozen=True)
class NodeView:
    name: str
    roles: str
    ready: bool | None
    schedulable: bool | None
    architecture: str
    cpu: str
    memory: str
    gpus: list[str]
    zone: str


def _node_view(node: Mapping[str, Any]) -> NodeView:
    available: Mapping[str, Any] = node["available"] if isinstance(
        node.get("available"), Mapping) else {}
    allocatable: Mapping[str, Any] = node["allocatable"] if isinstance(
        node.get("allocatable"), Mapping) else {}

    def of(key: str) -> str:
        have, total = available.get(key), allocatable.get(key)
        text = _number(have)
        return f"{text} of {_number(total)}" if total is not None else text

    roles = node.get("roles") or []
    return NodeView(
        name=str(node.get("name", "?")),
        roles=", ".join(str(r) for r in roles) if isinstance(roles, list) and roles else "-",
        ready=node.get("ready") if isinstance(node.get("ready"), bool) else None,
        schedulable=(node.get("schedulable") if isinstance(node.get("schedulable"), bool)
                     else None),
        architecture=str(node.get("architecture") or "-"), cpu=of("cpu"), memory=of("memory"),
        gpus=[_gpu_text(g) for g in node.get("gpus") or [] if isinstance(g, Mapping)],
        zone=str(node.get("zone") or "-"))


def cpu_summary(properties: Mapping[str, Any]) -> str:
    """Like "32 cores: 16 amd64, 8 amd64, 8 amd64" (a cluster reports one entry per node)."""
    cpus = [c for c in properties.get("cpus") or [] if isinstance(c, Mapping)]
    if not cpus:
        return "-"
    cores = [c.get("cores") for c in cpus]
    total = sum(c for c in cores if isinstance(c, int | float) and not isinstance(c, bool))
    parts = ", ".join(f"{_number(c.get('cores'))} {c.get('architecture', '?')}" for c in cpus)
    return f"{_number(total)} cores: {parts}"


def _listing(items: Any, *keys: str) -> str:
    """Peripherals and interfaces as one line ("gpu NVIDIA L4; usb"), "none" when empty."""
    if not isinstance(items, list):
        return "none"
    texts = [" ".join(str(i[k]) for k in keys if i.get(k)) for i in items
             if isinstance(i, Mapping)]
    return "; ".join(t for t in texts if t) or "none"


@dataclass(frozen=True)
class DeviceView:
    """One device as the overview and the device page show it."""

    device_id: str
    client_id: str
    shape: str
    kind: str
    kind_detail: str
    nodes: int | None
    gpus: int
    reported_at: float
    states: dict[str, int]
    deployment_count: int
    properties: Mapping[str, Any]
    labels: Mapping[str, Any]
    roles: tuple[str, ...]
    cluster: Mapping[str, Any] | None
    node_table: list[NodeView] = field(default_factory=list)
    #: current | pending | failed-on-current | stale (wfm.fleet.freshness), and when last heard of.
    freshness: str = "pending"
    last_seen: float | None = None

    @property
    def cpus(self) -> str:
        return cpu_summary(self.properties)

    @property
    def peripherals(self) -> str:
        return _listing(self.properties.get("peripherals"), "type", "manufacturer", "model")

    @property
    def interfaces(self) -> str:
        return _listing(self.properties.get("interfaces"), "type")


def _normalised(row: records.DeviceRow) -> tuple[Mapping[str, Any], Mapping[str, Any],
                                                  tuple[str, ...]]:
    """rc.3 properties whatever shape the device reported (Oct-2024 included)."""
    try:
        caps = validate_value(row.document, expect=Kind.DEVICE_CAPABILITIES)
    except DocumentError:
        properties = row.document.get("properties")
        labels = row.document.get("labels")
        return (properties if isinstance(properties, Mapping) else {},
                labels if isinstance(labels, Mapping) else {}, ())
    return caps.properties, caps.labels, tuple(caps.roles)


def device_view(row: records.DeviceRow, summary: Mapping[str, Any]) -> DeviceView:
    properties, labels, roles = _normalised(row)
    cluster = cluster_body(row.document)
    nodes = _cluster_nodes(cluster) or []
    return DeviceView(
        device_id=row.device_id, client_id=row.client_id, shape=row.shape,
        kind=device_kind(properties, cluster), kind_detail=_kind_detail(cluster, labels),
        nodes=node_count(cluster, labels), gpus=gpu_count(properties, cluster, labels),
        reported_at=row.reported_at, states=dict(summary["states"]),
        deployment_count=int(summary["deployments"]), properties=properties, labels=labels,
        roles=roles, cluster=cluster, node_table=[_node_view(n) for n in nodes],
        freshness=str(summary.get("freshness", {}).get("state", "pending")),
        last_seen=summary.get("freshness", {}).get("lastSeen"))


# --- eligibility and applications ----------------------------------------------------------

@dataclass(frozen=True)
class Clause:
    """One reason an intent does not (or not fully) deploy on a device."""

    where: str
    message: str
    required: Any = None
    actual: Any = None
    has_values: bool = False


def failing_clauses(explanation: Mapping[str, Any]) -> list[Clause]:
    """Every failing clause of one intent's explanation, in the order `margo explain`
    prints them (targeting, then each profile tried, what capacity accounting found short,
    then problems and the note)."""
    out = [Clause("targeting", f["message"], f.get("required"), f.get("actual"), True)
           for f in explanation.get("targeting", [])]
    for attempt in explanation.get("attempts", []):
        out += [Clause(f"profile {attempt['profile']}", f["message"], f.get("required"),
                       f.get("actual"), True) for f in attempt.get("failures", [])]
    out += [Clause("capacity", f["message"], f.get("required"), f.get("actual"), True)
            for f in explanation.get("capacity", [])]
    for problem in explanation.get("problems", []):
        where = problem.get("path") or "problem"
        out.append(Clause(str(where), str(problem.get("message", "")),
                          problem.get("expected"), problem.get("found"),
                          problem.get("expected") is not None
                          or problem.get("found") is not None))
    if explanation.get("note"):
        out.append(Clause("note", str(explanation["note"])))
    return out


def _application_id(explanation: Mapping[str, Any],
                    intent_apps: Mapping[str, str]) -> str | None:
    """The application an intent deploys: the explanation says "id version" for usable
    intents; frozen ones only the fleet source knows."""
    label = explanation.get("application")
    if isinstance(label, str) and label:
        return label.split(" ", 1)[0]
    return intent_apps.get(str(explanation.get("intent")))


@dataclass(frozen=True)
class AppInfo:
    app_id: str
    name: str
    versions: tuple[str, ...]
    description: str | None
    intents: tuple[str, ...]


@dataclass
class Catalogue:
    """The fleet source's applications and which intent deploys which; `error` says why
    the source could not be read (the pages still show what devices run)."""

    applications: dict[str, AppInfo] = field(default_factory=dict)
    intent_apps: dict[str, str] = field(default_factory=dict)
    error: str | None = None


def load_catalogue(source: SourceConfig) -> Catalogue:
    """Blocking (reads the source): call it in a worker thread."""
    if source.path is None:
        return Catalogue(error="no fleet source is configured")
    try:
        fleet = load_source(source.path, ref=source.ref)
    except SourceError as exc:
        return Catalogue(error=str(exc))
    intent_apps = {name: intent.application_id for name, intent in fleet.intents.items()}
    apps = {}
    for app_id in sorted(fleet.applications):
        newest = fleet.application(app_id, None)
        description = newest.description if newest is not None else None
        apps[app_id] = AppInfo(
            app_id=app_id, name=description.name if description else app_id,
            versions=tuple(sorted(fleet.applications[app_id])),
            description=description.description if description else None,
            intents=tuple(sorted(n for n, a in intent_apps.items() if a == app_id)))
    return Catalogue(apps, intent_apps)


# --- the pages ----------------------------------------------------------------------------

def render_page(template: str, *, nonce: str, path: str, **context: Any) -> str:
    """One page as HTML; every value is autoescaped, whatever a device put in it."""
    context.setdefault("refresh", True)
    context.setdefault("session", None)  # who is looking (`wfm.http.sessions.Session`)
    context.setdefault("back_to", None)
    return _ENV.get_template(template).render(nonce=nonce, now=time.time(), path=path,
                                              **context)


class Dashboard:
    """The routes of the dashboard, reading through the read API's `FleetApi`."""

    def __init__(self, fleet: FleetApi):
        self.fleet = fleet
        self.sessions = Sessions(fleet.auth, lambda: fleet.api.db)

    def _render(self, request: Request, template: str, status: int = 200,
                headers: Mapping[str, str] | None = None, **context: Any) -> HTMLResponse:
        """`context["session"]`: who is looking (the header, and the forms' token)."""
        nonce = secrets.token_urlsafe(16)
        context.setdefault("refresh", status == 200)
        body = render_page(template, nonce=nonce, path=request.url.path, **context)
        response = HTMLResponse(body, status_code=status, headers={
            # Defence in depth behind autoescaping: only our nonce'd script runs, and forms
            # post to this server only.
            "Content-Security-Policy": (f"default-src 'none'; script-src 'nonce-{nonce}'; "
                                        "style-src 'self'; img-src 'self'; connect-src 'self'; "
                                        "form-action 'self'; frame-ancestors 'none'; "
                                        "base-uri 'none'"),
            "Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
            "X-Content-Type-Options": "nosniff", **(headers or {})})
        session = context.get("session")
        if isinstance(session, Session) and session.new_cookie is not None:
            self._set_cookie(request, response, session.new_cookie)
        return response

    @staticmethod
    def _set_cookie(request: Request, response: Response, value: str) -> None:
        response.set_cookie(COOKIE_NAME, value, max_age=SESSION_SECONDS, httponly=True,
                            samesite="strict", secure=request.url.scheme == "https", path="/")

    async def _access(self, request: Request) -> Session | Response:
        """Who may see the pages (the viewer role); else the page that says how to get in.
        `?token=` signs in (not on an open server, which has no tokens)."""
        offered = request.query_params.get("token")
        if offered is not None and not await self.sessions.is_open():
            return await self._sign_in(request, offered)
        session = await self.sessions.session(request)
        if session is None:
            return self._unauthorized(request, "This dashboard needs an operator token.")
        if not session.operator.may(Role.VIEWER):
            return self._refused(request, None, _no_role(session.operator))
        return session

    def _unauthorized(self, request: Request, message: str) -> Response:
        return self._render(request, "message.html", status=401, title="Operator token needed",
                            message=message, continue_to=None, login_hint=True,
                            headers={"WWW-Authenticate": REALM})

    def _refused(self, request: Request, session: Session | None, message: str,
                 status: int = 403, title: str = "Refused") -> Response:
        return self._render(request, "message.html", status=status, title=title,
                            message=message, continue_to=None, login_hint=False,
                            session=session, back_to="/")

    async def _sign_in(self, request: Request, token: str) -> Response:
        """Set the cookie and continue to the same page without the token in its address.
        A page (not a 303) continues, so the SameSite=Strict cookie is sent even when the
        link was opened from another site."""
        signed = await self.sessions.sign_in(token)
        if signed is None:
            return self._unauthorized(request, "That operator token is not valid.")
        operator, cookie = signed
        if not operator.may(Role.VIEWER):
            return self._refused(request, None, _no_role(operator))
        rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
        # url.path is the path as requested (still percent-encoded): it stays one path.
        target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
        response = self._render(
            request, "message.html", title="Signed in",
            message=f"Signed in to the dashboard as {operator.name} ({operator.role.label}).",
            continue_to=target, login_hint=False, refresh=False)
        self._set_cookie(request, response, cookie)
        return response

    async def sign_out(self, request: Request) -> Response:
        """Forget the cookie (a form with the session's token: no other site signs you out)."""
        session = await self.sessions.session(request)
        if session is None or not session.signed_in:
            return RedirectResponse("/", status_code=303)
        refusal = await self.sessions.form_refusal(request, session)
        if refusal is not None:
            return self._refused(request, session, refusal)
        response = self._render(request, "message.html", title="Signed out",
                                message="Signed out of the dashboard.", continue_to=None,
                                login_hint=True, refresh=False)
        response.delete_cookie(COOKIE_NAME, path="/", httponly=True, samesite="strict",
                               secure=request.url.scheme == "https")
        return response

    async def rollout_action(self, request: Request) -> Response:
        """Pause, resume or abort a rollout from the overview's form: the operator role, a
        form from this session's own page; then back to the overview (303), which shows
        the rollout's new state and counts. Refusals of a signed-in caller are recorded in
        the audit trail, as the read API records them."""
        access = await self._access(request)
        if isinstance(access, Response):
            return access
        name, action = request.path_params["intent"], request.path_params["action"]
        if action not in ACTIONS:
            return self._not_found(request, f"rollout action {action!r}", access)
        refusal = await self.sessions.form_refusal(request, access)
        if refusal is None and not access.may_act:
            refusal = (f"{access.operator.name} is a {access.operator.role.label}; "
                       f"{action} needs the operator role")
        if refusal is not None:
            await self.fleet.audit.record(access.operator, f"rollout.{action}", name,
                                          outcome=REFUSED, detail=refusal,
                                          address=caller_address(request))
            return self._refused(request, access, refusal)
        try:
            await self.fleet.act_on_rollout(request, access.operator, name, action)
        except ProblemError as exc:  # no such rollout (404), not in that state (409)
            return self._refused(request, access, exc.detail, exc.status, "Not done")
        return RedirectResponse(f"/#rollout-{quote(name)}", status_code=303)

    def _not_found(self, request: Request, what: str, session: Session) -> Response:
        return self._render(request, "message.html", status=404, title="Not found",
                            message=f"There is no {what} in this fleet.", continue_to=None,
                            login_hint=False, session=session)

    # Reads of the database and the device branches stay on the event loop, as in the
    # read API (the branch store's pygit2 repository is not shared across threads); only
    # the fleet source and the compiler's explanations run in worker threads.

    def _fleet_now(self) -> tuple[dict[str, dict[str, Any]], list[records.DeviceRow],
                                  dict[str, list[dict[str, Any]]]]:
        """Statuses, device rows and each device's deployments, read once per page."""
        statuses = self.fleet.statuses()
        rows = self.fleet.device_rows()
        return statuses, rows, {row.device_id: self.fleet.device_deployments(row.device_id,
                                                                             statuses)
                                for row in rows}

    # --- overview ---

    async def overview(self, request: Request) -> Response:
        session = await self._access(request)
        if isinstance(session, Response):
            return session
        await self.fleet.api.catch_up()
        statuses, rows, deployments = self._fleet_now()
        polls = self.fleet.api.client_polls()
        devices = [device_view(row, self.fleet.device_summary(row, statuses, polls))
                   for row in rows]
        runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for device_id, served in deployments.items():
            for deployment in served:
                runs[deployment["applicationId"] or "?"].append({"device": device_id,
                                                                 **deployment})
        counts = self.fleet.deployment_counts(statuses)
        catalogue = await run_in_threadpool(load_catalogue, self.fleet.source)
        applications = [(app_id, catalogue.applications.get(app_id), runs[app_id])
                        for app_id in sorted(set(catalogue.applications) | set(runs))]
        source = self.fleet.api.db.read(load_condition)
        rollouts = [dict(view, plot=progress_points(view), actions=actions_for(view["status"]))
                    for view in await run_in_threadpool(self.fleet.rollout_views)]
        return self._render(request, "overview.html", title="Fleet overview", devices=devices,
                            counts=counts, catalogue=catalogue, applications=applications,
                            source=source, source_kind=self.fleet.source_kind,
                            rollouts=rollouts, session=session)

    # --- one device ---

    async def device(self, request: Request) -> Response:
        session = await self._access(request)
        if isinstance(session, Response):
            return session
        device_id = request.path_params["deviceId"]
        await self.fleet.api.catch_up()
        row = self.fleet.device_row(device_id)
        if row is None:
            return self._not_found(request, f"device {device_id!r}", session)
        statuses = self.fleet.statuses()
        deployments = self.fleet.device_deployments(device_id, statuses)
        history = [_commit_view(c) for c in self.fleet.history(device_id)]
        eligibility = (await run_in_threadpool(self.fleet.eligibility, [device_id]))[device_id]
        explanations = (None if isinstance(eligibility, str) else
                        [(e, failing_clauses(e)) for e in eligibility])
        return self._render(
            request, "device.html", title=f"Device {device_id}",
            device=device_view(row, self.fleet.device_summary(row, statuses)),
            deployments=deployments, explanations=explanations, history=history,
            eligibility_error=eligibility if isinstance(eligibility, str) else None,
            session=session)

    # --- one application ---

    def _explain_fleet(self, device_ids: list[str]) -> tuple[Catalogue, dict[str, Any]]:
        return load_catalogue(self.fleet.source), self.fleet.eligibility(device_ids)

    async def application(self, request: Request) -> Response:
        session = await self._access(request)
        if isinstance(session, Response):
            return session
        app_id = request.path_params["appId"]
        _, rows, deployments = self._fleet_now()
        runs = [{"device": device_id, **d} for device_id, served in deployments.items()
                for d in served if d["applicationId"] == app_id]
        catalogue, eligibility = await run_in_threadpool(
            self._explain_fleet, [row.device_id for row in rows])
        info = catalogue.applications.get(app_id)
        if info is None and not runs:
            return self._not_found(request, f"application {app_id!r}", session)
        blocked, unexplained = [], []
        for device_id, explained in eligibility.items():
            if isinstance(explained, str):
                unexplained.append((device_id, explained))
                continue
            blocked += [(device_id, e, failing_clauses(e)) for e in explained
                        if e["status"] != "eligible"
                        and _application_id(e, catalogue.intent_apps) == app_id]
        return self._render(request, "application.html", title=f"Application {app_id}",
                            app_id=app_id, info=info, runs=runs, blocked=blocked,
                            unexplained=unexplained, source_error=catalogue.error,
                            states=Counter(r["state"] for r in runs), session=session)

    async def stylesheet(self, request: Request) -> Response:
        return FileResponse(TEMPLATES / "style.css", media_type="text/css",
                            headers={"Cache-Control": "no-cache",
                                     "X-Content-Type-Options": "nosniff"})

    def routes(self) -> list[Route]:
        return [
            Route("/", self.overview, methods=["GET"]),
            Route("/devices/{deviceId:path}", self.device, methods=["GET"]),
            Route("/applications/{appId}", self.application, methods=["GET"]),
            Route("/dashboard/style.css", self.stylesheet, methods=["GET"]),
            Route("/rollouts/{intent}/{action}", self.rollout_action, methods=["POST"]),
            Route("/signout", self.sign_out, methods=["POST"]),
        ]


def _no_role(operator: Operator) -> str:
    return f"{operator.name} has no role on this server; the dashboard needs a viewer's."


def _commit_view(commit: Mapping[str, Any]) -> dict[str, Any]:
    """Summary line and body of a desired-state commit; the trailers (digests) are for
    tools and would drown the story, so they are left out."""
    lines = str(commit["message"]).rstrip("\n").split("\n")
    body = "\n".join(lines[1:]).strip("\n")
    paragraphs = body.split("\n\n")
    if paragraphs and all(_is_trailer(line) for line in paragraphs[-1].splitlines() if line):
        paragraphs = paragraphs[:-1]
    return {"commit": commit["commit"], "time": commit["time"], "summary": lines[0],
            "body": "\n\n".join(paragraphs).strip("\n")}


def _is_trailer(line: str) -> bool:
    name, sep, _ = line.partition(": ")
    return bool(sep) and name.replace("-", "").isalnum()


def dashboard_routes(fleet: FleetApi) -> list[Route]:
    """The dashboard's routes, mounted by `wfm.server.app.create_app` next to the read API."""
    return Dashboard(fleet).routes()
