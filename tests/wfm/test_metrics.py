"""`GET /metrics` of a real `margo serve`, scraped with httpx and parsed with
prometheus_client's exposition-format parser, while the fleet moves: a push to the hosted
source, its compile, a device installing, a second push that stages a rollout and its
install. On one SQLite server, and on two replicas on PostgreSQL, where each replica's
own figures add up and the fleet's agree. The dashboard's and the alert rules' queries
(deploy/monitoring) are checked against the names the server really exposed."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from kits.pgkit import database_for
from kits.serverkit import ROOT, _one_server, add_client, margo, use_store
from prometheus_client.parser import text_string_to_metric_families

from tools.polling import poll_until

CAPS = ROOT / "examples" / "capabilities"
MONITORING = ROOT / "deploy" / "monitoring"
DEVICE = "compose-box-amd64"
METRICS_TOKEN = "scrape-token"
ADMIN_TOKEN = "operator-token"
#: Sample names seen by the scrapes of this module (the dashboard's queries must use these).
SEEN: set[str] = set()

#: Series Prometheus itself adds to every target's (not the server's to expose).
SYNTHETIC = {"up"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(base: str, token: str = METRICS_TOKEN) -> Samples:
    answer = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"},
                       timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
            SEEN.add(sample.name)
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "Platform", "PATH": "/usr/bin:/bin",
                               "GIT_AUTHOR_EMAIL": "p@example.com", "HOME": str(cwd),
                               "GIT_COMMITTER_NAME": "Platform",
                               "GIT_COMMITTER_EMAIL": "p@example.com"}).stdout.strip()


def fleet_repository(work: Path) -> Path:
    """The example fleet, its hello-everywhere intent staged in two waves, as a Git
    repository with one commit on `main`."""
    shutil.copytree(ROOT / "examples" / "fleet", work)
    intent = work / "deployments" / "hello-everywhere.yaml"
    doc = yaml.safe_load(intent.read_text())
    doc["spec"]["rollout"] = {"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}],
                              "soak": "1s", "waveDeadline": "1h"}
    intent.write_text(yaml.safe_dump(doc))
    git("init", "-q", "-b", "main", cwd=work)
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", "fleet", cwd=work)
    return work


class Device:
    """One rc.3 device on a server: reports capabilities, polls, reports `installed`."""

    def __init__(self, base: str, token: str) -> None:
        self.http = httpx.Client(base_url=base, timeout=10,
                                 headers={"Authorization": f"Bearer {token}"})

    def register(self) -> None:
        doc = json.loads((CAPS / f"{DEVICE}.json").read_text())
        assert self.http.put(f"/api/v1/capabilities/{DEVICE}", json=doc).status_code in (200,
                                                                                          201)

    def manifest(self) -> dict[str, Any]:
        answer = self.http.get("/api/v1/deployments")
        assert answer.status_code == 200, answer.text
        manifest: dict[str, Any] = answer.json()
        return manifest

    def wait_for(self, what: str, holds: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        return poll_until(what, lambda: (lambda m: m if holds(m) else None)(self.manifest()),
                          timeout=30, interval=0.2)

    def install(self, manifest: dict[str, Any]) -> None:
        for ref in manifest["deployments"]:
            report = {"deploymentId": ref["deploymentId"],
                      "adoptedManifestVersion": manifest["manifestVersion"],
                      "status": {"state": "installed"},
                      "components": [{"name": "hello-world-compose", "state": "installed"}]}
            answer = self.http.post(f"/api/v1/deployments/{ref['deploymentId']}/status",
                                    json=report)
            assert answer.status_code == 200, answer.text


def eventually(bases: list[str], what: str, holds: Callable[[list[Samples]], bool]
               ) -> list[Samples]:
    """Every server's samples once `holds` is true of them (fleet gauges are computed at
    most every `--metrics-cache-seconds`)."""
    last: list[list[Samples]] = [[]]

    def scraped() -> list[Samples] | None:
        last[0] = [scrape(b) for b in bases]
        return last[0] if holds(last[0]) else None

    return poll_until(what, scraped, timeout=30, interval=0.5, describe=lambda: str(
        [{f"{n}{dict(ls)}": v for (n, ls), v in s.items() if n.startswith(FLEET)}
         for s in last[0]]))


FLEET = ("margo_devices", "margo_deployments", "margo_rollout", "margo_lead_time_seconds_count",
         "margo_lead_time_pending", "margo_replica")


def total(samples: list[Samples], name: str, **labels: str) -> float:
    return sum(value(s, name, **labels) for s in samples)


def same_everywhere(samples: list[Samples], name: str, **labels: str) -> float:
    """A fleet gauge: the one value every replica says (None-like -1 when they differ)."""
    values = {value(s, name, **labels) for s in samples}
    return values.pop() if len(values) == 1 else -1.0


def fleet_moves(bases: list[str], work: Path, token: str) -> None:
    """The scenario, its requests spread over `bases` (one server, or each replica)."""
    pushing = bases[-1].replace("http://", f"http://operator:{ADMIN_TOKEN}@")
    unauthorized = httpx.get(f"{bases[0]}/metrics", timeout=10)
    assert unauthorized.status_code == 401
    assert unauthorized.headers["content-type"].startswith("application/problem+json")
    scrape(bases[0], ADMIN_TOKEN)  # the operator token may read it too
    device = Device(bases[0], token)
    try:
        _fleet_moves(bases, work, device, pushing)
    finally:
        device.http.close()


def _fleet_moves(bases: list[str], work: Path, device: Device, pushing: str) -> None:
    device.register()

    git("push", "-q", f"{pushing}/git/source.git", "main", cwd=work)
    first = device.wait_for("the first compile", lambda m: bool(m["deployments"]))
    held = len(first["deployments"])
    samples = eventually(bases, "the device pending on its new deployments", lambda s: (
        same_everywhere(s, "margo_devices", freshness="pending", spec="rc.3") == 1
        and same_everywhere(s, "margo_deployments", state="pending") == held
        and same_everywhere(s, "margo_lead_time_pending_deployments") == held))
    assert total(samples, "margo_source_pushes_total", outcome="accepted") == 1
    assert total(samples, "margo_compiles_total", outcome="succeeded") >= 1
    assert total(samples, "margo_compile_devices_total", result="committed") >= 1
    assert total(samples, "margo_compile_duration_seconds_count") >= 1
    assert total(samples, "margo_replica_compile_lease") == 1  # one compiler, whoever
    assert same_everywhere(samples, "margo_source_condition", state="ready") == 1

    device.install(first)
    samples = eventually(bases, "the device current", lambda s: (
        same_everywhere(s, "margo_devices", freshness="current", spec="rc.3") == 1
        and same_everywhere(s, "margo_deployments", state="installed") == held
        and same_everywhere(s, "margo_lead_time_pending_deployments") == 0
        and total(s, "margo_lead_time_seconds_count") == held))
    assert total(samples, "margo_lead_time_seconds_count", trigger="push") == held
    assert total(samples, "margo_lead_time_seconds_bucket", trigger="push", le="+Inf") == held
    assert 0 < total(samples, "margo_lead_time_seconds_sum") < 120 * held
    status_route = "/api/v1/deployments/{deploymentId}/status"
    assert total(samples, "margo_http_requests_total", route=status_route, method="POST",
                 code="200") == held
    assert total(samples, "margo_http_request_duration_seconds_count", route=status_route,
                 method="POST") == held
    assert total(samples, "margo_http_requests_total", route="/api/v1/capabilities/{deviceId:"
                 "path}", method="PUT", code="201") == 1
    assert total(samples, "margo_db_write_batch_size_count") >= 1
    labels = {v for s in samples for (_, ls) in s for _, v in ls}
    assert not any(DEVICE in v or ("/api/v1/deployments/" in v and "{" not in v)
                   for v in labels), "no device id or raw path may be a label value"

    intent = work / "deployments" / "hello-everywhere.yaml"
    intent.write_text(intent.read_text().replace("Hello from", "Greetings from"))
    git("commit", "-q", "-am", "a new greeting, staged", cwd=work)
    git("push", "-q", f"{pushing}/git/source.git", "main", cwd=work)
    second = device.wait_for("the canary wave", lambda m: m["manifestVersion"] >
                             first["manifestVersion"])
    eventually(bases, "a rollout in progress", lambda s: (
        same_everywhere(s, "margo_rollouts", state="progressing") == 1
        and same_everywhere(s, "margo_rollout_waves", state="open") == 1
        and same_everywhere(s, "margo_devices", freshness="pending", spec="rc.3") == 1))
    device.install(second)
    samples = eventually(bases, "the rollout complete", lambda s: (
        same_everywhere(s, "margo_rollouts", state="complete") == 1
        and same_everywhere(s, "margo_rollout_waves", state="settled") == 1
        and same_everywhere(s, "margo_devices", freshness="current", spec="rc.3") == 1
        and total(s, "margo_lead_time_seconds_count") == held + 1))
    assert total(samples, "margo_source_pushes_total", outcome="accepted") == 2


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    return fleet_repository(tmp_path / "work")


def _tokens(folder: Path) -> list[str]:
    (folder / "admin").write_text(ADMIN_TOKEN)
    (folder / "scrape").write_text(METRICS_TOKEN)
    # (The fleet's gauges are computed at most every half second here, not every 5 s:
    # the fleet's moves are seen sooner, and the tests wait that much less.)
    return ["--host-source", "--admin-token-file", str(folder / "admin"),
            "--metrics-token-file", str(folder / "scrape"), "--metrics-cache-seconds", "0.5"]


def test_metrics_move_with_the_fleet_on_one_server(tmp_path: Path, repository: Path) -> None:
    data = tmp_path / "data"
    token = add_client(data, "edge")
    with _one_server(data, *_tokens(tmp_path)) as base:
        fleet_moves([base], repository, token)
        names = set(SEEN)
    check_queries(names)  # deploy/monitoring asks only for what a real server exposed


@contextlib.contextmanager
def _replicas(folder: Path) -> Iterator[tuple[list[str], str]]:
    data = folder / "data"
    with use_store("replicas"):
        token = add_client(data, "edge")
    args = [*_tokens(folder), "--database", database_for(data)]
    with _one_server(data / "replica-0", *args, log_dir=folder) as first, \
            _one_server(data / "replica-1", *args, log_dir=folder) as second:
        yield [first, second], token


def test_metrics_on_two_replicas_add_up_and_agree(tmp_path: Path, repository: Path) -> None:
    """The device talks to replica 0, the pushes go to replica 1: each replica counts its
    own requests, compiles and lead times (their sums are the fleet's), and every fleet
    gauge reads the same on both."""
    with _replicas(tmp_path) as (bases, token):
        fleet_moves(bases, repository, token)


def _metric_names(expression: str) -> set[str]:
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        elif isinstance(node, promql_parser.VectorSelector):
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.add(matcher.value)

    promql_parser.walk(promql_parser.parse(expression), pre_visit=visit)
    return names


def _queries() -> Iterator[tuple[str, str]]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":  # label_values(SELECTOR, label): Grafana's
            query = variable["query"]
            expr = query["query"] if isinstance(query, dict) else query
            yield f"variable {variable['name']!r}", expr.removeprefix(
                "label_values(").rpartition(",")[0]
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            yield f"alert {rule['alert']!r}", rule["expr"]


def check_queries(exposed: set[str]) -> None:
    """Every query of the dashboard and the alert rules parses as PromQL and names only
    metrics in `exposed` (histograms by their `_bucket`/`_sum`/`_count` series)."""
    queries = list(_queries())
    assert len(queries) >= 15
    for where, expression in queries:
        try:
            names = _metric_names(expression.replace("$__rate_interval", "5m")
                                  .replace("$instance", ".*"))
        except ValueError as exc:
            raise AssertionError(f"{where}: not PromQL: {exc}: {expression}") from None
        assert names, f"{where} names no metric: {expression}"
        unknown = names - exposed - SYNTHETIC
        assert not unknown, f"{where} names metrics the server does not expose: {unknown}"


def test_a_query_naming_an_unknown_metric_is_caught() -> None:
    """The check above finds the names in queries of every shape the files use."""
    assert _metric_names('histogram_quantile(0.99, sum by (le) (rate('
                         'margo_lead_time_seconds_bucket{trigger=~"push|webhook"}[5m])))') \
        == {"margo_lead_time_seconds_bucket"}
    assert _metric_names('sum(margo_devices{freshness="stale"}) / ignoring(freshness) '
                         'clamp_min(sum(margo_devices), 1) > 0.1 unless on() '
                         'absent({__name__="margo_replica_compile_lease"})') == {
        "margo_devices", "margo_replica_compile_lease"}
    with pytest.raises(AssertionError, match="does not expose"):
        check_queries(set())


@pytest.mark.parametrize("seconds", ["-1", "nan", "3601"])
def test_a_metrics_cache_time_out_of_range_is_refused_before_starting(
        tmp_path: Path, seconds: str) -> None:
    result = margo("serve", "--data", str(tmp_path / "data"), "--port", "1",
                   "--metrics-cache-seconds", seconds, check=False)
    assert result.returncode != 0
    assert "--metrics-cache-seconds must be 0 to 3600 seconds" in result.stderr
