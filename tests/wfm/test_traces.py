"""The server's spans of one change, sent with `margo serve --otlp-endpoint` to a real
OpenTelemetry Collector (tools/otel, the colleague's kit) and read back from its file
exporter: receive push -> compile -> the device's adoption (its manifest served) -> its
installed report, one trace, each span the child of the one before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kits.otelkit import attributes, running_collector
from kits.serverkit import _one_server, add_client
from test_metrics import ADMIN_TOKEN, DEVICE, Device, fleet_repository, git


def spans(output: Path) -> list[dict[str, Any]]:
    """Every span the collector wrote: name, ids, times, attributes and resource."""
    found = []
    try:
        lines = output.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            document = json.loads(line)
        except ValueError:
            continue  # a line still being written
        for resource_spans in document.get("resourceSpans", []):
            resource = attributes((resource_spans.get("resource") or {}).get("attributes"))
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    found.append({"name": span["name"], "trace": span["traceId"],
                                  "id": span["spanId"], "parent": span.get("parentSpanId", ""),
                                  "start": int(span["startTimeUnixNano"]),
                                  "end": int(span["endTimeUnixNano"]),
                                  "attributes": attributes(span.get("attributes")),
                                  "resource": resource})
    return found


def test_a_change_is_one_trace_from_push_to_installed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    token = add_client(data, "edge")
    (tmp_path / "admin").write_text(ADMIN_TOKEN)
    work = fleet_repository(tmp_path / "work")
    with running_collector(tmp_path / "otel") as collector, \
            _one_server(data, "--host-source", "--admin-token-file", str(tmp_path / "admin"),
                        "--otlp-endpoint", collector.http) as base:
        device = Device(base, token)
        try:
            device.register()
            pushing = base.replace("http://", f"http://operator:{ADMIN_TOKEN}@")
            git("push", "-q", f"{pushing}/git/source.git", "main", cwd=work)
            manifest = device.wait_for("the compile", lambda m: bool(m["deployments"]))
            device.install(manifest)
        finally:
            device.http.close()

        def installed() -> list[dict[str, Any]]:
            return [s for s in spans(collector.output) if s["name"] == "margo.device.install"]

        [install] = collector.wait_for("the install span", installed)
    by_id = {s["id"]: s for s in spans(collector.output)}
    adopt = by_id[install["parent"]]
    compile_ = by_id[adopt["parent"]]
    push = by_id[compile_["parent"]]
    assert [push["name"], compile_["name"], adopt["name"]] == [
        "margo.source.push", "margo.compile", "margo.device.adopt"]
    assert push["parent"] == ""  # the trace starts where the server heard of the change
    assert {s["trace"] for s in (push, compile_, adopt, install)} == {push["trace"]}
    assert push["start"] <= compile_["start"] <= adopt["start"] <= install["start"]
    assert adopt["end"] == install["start"]  # the manifest served: the device has it
    assert install["attributes"]["margo.device.id"] == DEVICE
    assert install["attributes"]["margo.deployment.id"] == manifest["deployments"][0][
        "deploymentId"]
    assert adopt["attributes"]["margo.handout"] == "manifest"
    assert install["attributes"]["margo.trigger"] == "push"
    lead = install["attributes"]["margo.lead_time_seconds"]
    assert abs(lead - (install["end"] - push["start"]) / 1e9) < 0.01
    assert compile_["attributes"]["margo.compile.commits"] >= 1
    assert install["resource"]["service.name"] == "margo-wfm"
