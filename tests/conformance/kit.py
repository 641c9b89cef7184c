"""A Python runner for the official Margo conformance kit's declarative WFM scenarios.

It executes the step format of `../shared/conformance/README.md` section 2.3 (the data
files are copied verbatim under `tests/fixtures/conformance/`): request, expected or
accepted statuses, validations, context extraction, polling. Steps that need what this
server does not have yet are reported as skipped with the reason: mutual TLS (the runner
authenticates with the client's bearer token instead; the identity work adds mTLS), rotated
SVIDs, transport-error checks, and `oras` registry steps.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["StepResult", "run_scenario"]


@dataclass
class StepResult:
    step: str
    status: str  # passed | failed | skipped
    detail: str = ""


@dataclass
class _Response:
    status: int
    headers: httpx.Headers
    body: bytes
    json: Any = field(default=None)


def _substitute(value: Any, context: dict[str, Any]) -> Any:
    if isinstance(value, str):
        return re.sub(r"\{(\w+)\}", lambda m: str(context.get(m.group(1), m.group(0))), value)
    if isinstance(value, dict):
        return {k: _substitute(v, context) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, context) for v in value]
    return value


def _field(response: _Response, path: str) -> Any:
    if path.startswith("_headers."):
        return response.headers.get(path.split(".", 1)[1])
    if path == "_body":
        return response.body.decode("utf-8", "replace")
    current = response.json
    for part in path.split("."):
        if isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        elif isinstance(current, dict) and part in current:
            current = current[part]
        else:
            return None
    return current


def _check(response: _Response, validation: dict[str, Any]) -> str | None:
    """None when the validation holds, else why not."""
    op, value = validation["operation"], validation.get("value")
    actual = _field(response, validation["field"]) if "field" in validation else None
    digest = "sha256:" + hashlib.sha256(response.body).hexdigest()
    checks = {
        "exists": lambda: actual is not None,
        "is_string": lambda: isinstance(actual, str),
        "is_number": lambda: isinstance(actual, (int, float)) and not isinstance(actual, bool),
        "is_array": lambda: isinstance(actual, list),
        "not_empty": lambda: bool(actual),
        "equals": lambda: actual == value,
        "contains": lambda: isinstance(actual, str) and str(value) in actual,
        "not_contains": lambda: actual is None or str(value) not in str(actual),
        "one_of": lambda: actual in (value or []),
        "matches_regex": lambda: isinstance(actual, str) and re.search(value, actual) is not None,
        "greater_than": lambda: isinstance(actual, (int, float)) and actual > value,
        "array_length_gte": lambda: isinstance(actual, list) and len(actual) >= value,
        "array_length_equals": lambda: isinstance(actual, list) and len(actual) == value,
        "etag_is_body_digest": lambda: response.headers.get("etag") == f'"{digest}"',
        "body_sha256_equals": lambda: digest == value,
        "bundle_null_when_no_deployments": lambda: bool(response.json["deployments"])
        or response.json["bundle"] is None,
        "bundle_media_type": lambda: response.json.get("bundle") is None
        or response.json["bundle"]["mediaType"] == "application/vnd.margo.bundle.v1+tar+gzip",
    }
    if op not in checks:
        return f"unknown operation {op}"
    try:
        ok = checks[op]()
    except (KeyError, TypeError, AttributeError) as exc:
        ok, actual = False, f"{actual!r} ({exc})"
    return None if ok else f"{validation.get('field', '')} {op} {value!r}: found {actual!r}"


def _send(http: httpx.Client, step: dict[str, Any], context: dict[str, Any]) -> _Response:
    body = step.get("request_body")
    response = http.request(step["method"], _substitute(step["endpoint"], context),
                            headers=_substitute(step.get("headers") or {}, context),
                            content=None if body is None else json.dumps(
                                _substitute(body, context)).encode())
    try:
        parsed = response.json()
    except ValueError:
        parsed = None
    return _Response(response.status_code, response.headers, response.content, parsed)


def _skip_reason(step: dict[str, Any]) -> str | None:
    if step.get("oras"):
        return "OCI registry (oras) step"
    if step.get("expect_transport_error"):
        return "needs mutual TLS (a TLS handshake without a client certificate must fail)"
    if step.get("svid_source"):
        return "needs mutual TLS (rotated SVID)"
    return None


def run_scenario(http: httpx.Client, scenario: dict[str, Any],
                 poll_interval: float = 0.5) -> list[StepResult]:
    context: dict[str, Any] = {}
    results = []
    for step in scenario["steps"]:
        reason = _skip_reason(step)
        if reason:
            results.append(StepResult(step["id"], "skipped", reason))
            continue
        poll = step.get("poll")
        deadline = time.monotonic() + (poll or {}).get("timeout_seconds", 0)
        while True:
            response = _send(http, step, context)
            if not poll or all(_check(response, v) is None for v in poll["until"]) or (
                    time.monotonic() > deadline):
                break
            time.sleep(poll_interval)
        allowed = {step["expected_status"], *step.get("accepted_statuses", [])}
        problems = [] if response.status in allowed else [
            f"status {response.status}, expected {sorted(allowed)}: {response.body[:300]!r}"]
        if response.status == step["expected_status"]:
            problems += [p for v in step.get("validations", [])
                         if (p := _check(response, _substitute(v, context)))]
        for name, path in (step.get("extract_context") or {}).items():
            context[name] = _field(response, path)
        results.append(StepResult(step["id"], "failed" if problems else "passed",
                                  "; ".join(problems)))
    return results
