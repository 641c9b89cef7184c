"""Prometheus metric families of the fleet server (docs/observability.md); served at
`GET /metrics` by `wfm.http.metrics_endpoint`.

Two kinds of figures, kept apart because replicas must add up and agree:

* **This process** (counters and histograms: requests, compiles, webhooks and pushes, the
  database writer's batches, Git work, lead times observed here): each replica counts what
  it did, so `sum()` over replicas is the fleet's total.
* **The fleet** (gauges: devices by freshness and spec generation, deployments by state,
  rollouts and waves, the source's condition): computed from the shared database when
  scraped, so every replica says the same (`wfm.fleet.fleetmetrics`).

Everything here uses `prometheus_client` directly: it happens a few times a second at
most. Requests are counted apart (`wfm.http.metrics_endpoint`), where it must cost next to
nothing.
"""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

__all__ = ["COLLECTION_SECONDS", "COMPILES", "COMPILE_DEVICES", "COMPILE_SECONDS",
           "DB_BATCH_SECONDS", "DB_BATCH_WRITES", "DB_PERIODIC_READS", "DB_REQUEST_READS",
           "GIT_SECONDS",
           "HELD_POLLS", "HELD_POLL_ENDS", "HELD_POLL_RENEWALS", "LAST_COLLECTION",
           "LAST_COMPILE", "LEAD_TIME", "LEAD_TIME_DROPPED", "PROCESS", "PUSHES", "TEXT_FORMAT",
           "WEBHOOKS"]

disable_created_metrics()  # type: ignore[no-untyped-call]  # no `*_created` series: twice the series for nothing we use
#: The text exposition format every Prometheus reads (2.x and 3.x; our names need nothing
#: of 1.0.0's UTF-8 names).
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
#: Figures of this process, shared by everything in it (one server per process).
PROCESS = CollectorRegistry(auto_describe=True)
for _standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*
    PROCESS.register(_standard)

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
            300.0)
COMPILE_SECONDS = Histogram(
    "margo_compile_duration_seconds", "Compiles that completed, by kind: full (the "
    "compiler's state was empty: every device evaluated) or incremental.", ["kind"],
    buckets=_SECONDS, registry=PROCESS)
COMPILES = Counter("margo_compiles_total", "Compiles run by this process, by outcome "
                   "(succeeded, failed).", ["outcome"], registry=PROCESS)
COMPILE_DEVICES = Counter(
    "margo_compile_devices_total", "Devices compiled, by result (committed: the branch got "
    "a commit; unchanged; error).", ["result"], registry=PROCESS)
LAST_COMPILE = Gauge("margo_compile_last_success_timestamp_seconds",
                     "When this process last compiled successfully (Unix time).",
                     registry=PROCESS)
COLLECTION_SECONDS = Histogram(
    "margo_compile_collection_duration_seconds", "The full garbage collection after a "
    "compile (wfm.fleet.compiles): how long it held the interpreter, so how long every "
    "request in flight waited.", buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                          10.0), registry=PROCESS)
LAST_COLLECTION = Gauge(
    "margo_compile_collection_last_timestamp_seconds", "When the collection after a compile "
    "last ended (Unix time): at or after margo_compile_last_success_timestamp_seconds once "
    "the last compile's was done.", registry=PROCESS)
WEBHOOKS = Counter(
    "margo_webhook_requests_total", "POST /hooks/git by outcome: fetched (the source was "
    "fetched and a compile asked for), ignored (another branch, or not a push), refused "
    "(bad signature or malformed), fetch_failed, not_configured.", ["outcome"],
    registry=PROCESS)
PUSHES = Counter(
    "margo_source_pushes_total", "Pushes to the hosted fleet source, by outcome: accepted, "
    "refused (the pre-receive check declined it), failed (Git answered an error).",
    ["outcome"], registry=PROCESS)
DB_BATCH_SECONDS = Histogram(
    "margo_db_write_batch_duration_seconds", "Write transactions of the database writer "
    "(one per batch of queued writes), by outcome (committed, unavailable, failed).",
    ["outcome"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                          1.0, 2.5, 5.0, 30.0), registry=PROCESS)
DB_BATCH_WRITES = Histogram(
    "margo_db_write_batch_size", "Writes grouped into one write transaction.",
    buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000), registry=PROCESS)
DB_REQUEST_READS = Counter(
    "margo_db_request_reads_total", "Reads of the database made while answering requests "
    "(from the event loop; on PostgreSQL each is a round trip, from a worker thread), "
    "other than the checks counted in margo_db_periodic_reads_total.",
    registry=PROCESS)
DB_PERIODIC_READS = Counter(
    "margo_db_periodic_reads_total", "Reads of the database made on a request's way at most "
    "once a second per process, however many requests come (the credentials epoch; whether "
    "a staged rollout moves).", registry=PROCESS)
GIT_SECONDS = Histogram(
    "margo_git_operation_duration_seconds", "Git work outside requests, by operation: "
    "source_fetch (a mirrored source), publish and sync (replicas).", ["operation"],
    buckets=_SECONDS, registry=PROCESS)
#: Minutes to a day: a change waits for devices' polls, a staged rollout's waves and soaks.
LEAD_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
                7200.0, 21600.0, 86400.0)
LEAD_TIME = Histogram(
    "margo_lead_time_seconds", "From when the server received a change (a push, a webhook, "
    "or the trigger of the compile that made it) to the status report that says a "
    "device installed the deployment's current bytes; by trigger (push, webhook, rollout, "
    "other). Observed by the replica that received the report, once per change and "
    "deployment.", ["trigger"], buckets=LEAD_BUCKETS, registry=PROCESS)
LEAD_TIME_DROPPED = Counter(
    "margo_lead_time_dropped_total", "Installed reports not checked for a lead time "
    "because the queue was full (no figure is wrong, some are missing).", registry=PROCESS)
HELD_POLLS = Gauge("margo_waiting_polls_held", "Waiting polls (Prefer: wait) this process "
                   "holds now (wfm.fleet.waiters).", registry=PROCESS)
HELD_POLL_ENDS = Counter(
    "margo_waiting_polls_total", "Waiting polls by how they ended: changed (answered with "
    "the new state), timeout (304 after the wait), closed (304 as the server stopped), "
    "shed (answered at once: too many held), gone (the client disconnected), failed (its "
    "check raised: the caller's credentials withdrawn, or the store failing; answered as "
    "that error).", ["outcome"],
    registry=PROCESS)
HELD_POLL_RENEWALS = Counter(
    "margo_waiting_polls_renewed", "Waiting polls held again as the renewal of the "
    "same request on the same connection, after a 304 at the end of its wait, without "
    "going through the request stack (wfm.admission.parking), by how they were matched: "
    "`bytes` (the same bytes, not parsed: wfm.server.wire) or `request` (parsed first).",
    labelnames=["matched"], registry=PROCESS)

# Every known label value from the start: a series that appears only when its first event
# happens defeats rate() and absent() in alerts.
for _outcome in ("succeeded", "failed"):
    COMPILES.labels(_outcome)
for _kind in ("full", "incremental"):
    COMPILE_SECONDS.labels(_kind)
for _result in ("committed", "unchanged", "error"):
    COMPILE_DEVICES.labels(_result)
for _outcome in ("fetched", "ignored", "refused", "fetch_failed", "not_configured"):
    WEBHOOKS.labels(_outcome)
for _outcome in ("accepted", "refused", "failed"):
    PUSHES.labels(_outcome)
for _outcome in ("committed", "unavailable", "failed"):
    DB_BATCH_SECONDS.labels(_outcome)
for _operation in ("source_fetch", "publish", "sync"):
    GIT_SECONDS.labels(_operation)
for _trigger in ("push", "webhook", "rollout", "other"):
    LEAD_TIME.labels(_trigger)
