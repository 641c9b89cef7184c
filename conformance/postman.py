"""Postman collections as conformance steps, the way the kit's runner converts them (kit
README section 2.4): the rc.2 core group (B1) is a Portman-generated collection whose bodies
are lorem ipsum and whose only "auth" is a placeholder header, so running it as-is tests
nothing. The kit turns every response example into one step instead:

* the request of its item, `:param` path segments becoming `{param}` context placeholders
  (`:digest` is `{bundleDigest}` after `bundles`, else `{deploymentDigest}`);
* for a 2xx example, real Margo bodies, extractions and validations from a rule table keyed
  by method and path (`ENDPOINT_RULES`), else validations read from the item's Postman test
  script (Content-Type and top-level schema field types);
* for an error example, a request built to provoke exactly that error
  (`derive_error_behavior`): `If-None-Match: *` for 304, `Accept: text/plain` for 406, no
  Content-Digest for a content-digest 400, a tampered signature for 401, a never-onboarded
  key for 403 (401 accepted too), one bad enum value for 422, an unparsable certificate for
  the onboarding 400;
* success steps first (they extract the clientId and digests the error steps use).

A group's `testCases` (item, response-example or event ids) narrow what is converted.
"""

from __future__ import annotations

import copy
import json
import re
import time
import uuid
from typing import Any

__all__ = [
    "DEVICE_CAPABILITIES_BODY",
    "ENDPOINT_RULES",
    "convert_collection",
    "derive_error_behavior",
    "derive_step",
    "is_postman_collection",
    "postman_endpoint",
]

DEVICE_CAPABILITIES_BODY: dict[str, Any] = {
    "apiVersion": "device.margo.org/v1alpha1",
    "kind": "DeviceCapabilitiesManifest",
    "properties": {
        "id": "{deviceId}", "vendor": "Acme Corp", "modelNumber": "ACM-XYZ",
        "serialNumber": "SN-12345", "cpus": [{"cores": 4, "architecture": "arm64"}],
        "memory": "16Gi", "storage": "256Gi", "peripherals": [],
        "interfaces": [{"type": "ethernet"}], "otelCollector": False,
        "supportedRuntimes": ["oci"], "supportedDeploymentTypes": ["helm", "compose"],
    },
}
_CAPABILITIES_RULE = {"body": DEVICE_CAPABILITIES_BODY}
_CLIENT = "/api/v1/clients/{clientId}"

# Keyed by "METHOD /endpoint" with {placeholders}. `body` replaces the Postman body,
# `body_merge` overlays its top level; the rest override what a step would otherwise get.
ENDPOINT_RULES: dict[str, dict[str, Any]] = {
    "GET /api/v1/onboarding/certificate": {
        "skip_signing": True,
        "validations": [{"field": "certificate", "operation": "is_string"}],
    },
    "POST /api/v1/onboarding": {
        "body": {"apiVersion": "onboarding.margo.org/v1alpha1", "kind": "OnboardingRequest",
                 "certificate": "./certs/device-cert.pem"},
        # One device per client in this suite: the device id is the client id.
        "extract_context": {"clientId": "clientId", "deviceId": "clientId"},
        "validations": [{"field": "clientId", "operation": "is_string"}],
    },
    f"POST {_CLIENT}/capabilities/{{deviceId}}": _CAPABILITIES_RULE,
    f"PUT {_CLIENT}/capabilities/{{deviceId}}": _CAPABILITIES_RULE,
    f"POST {_CLIENT}/capabilities": _CAPABILITIES_RULE,
    f"PUT {_CLIENT}/capabilities": _CAPABILITIES_RULE,
    f"GET {_CLIENT}/deployments": {
        "extract_context": {"deploymentId": "deployments.0.deploymentId",
                            "bundleDigest": "bundle.digest",
                            "deploymentDigest": "deployments.0.digest"},
        "validations": [
            {"field": "manifestVersion", "operation": "is_number"},
            {"operation": "bundle_null_when_no_deployments"},
            {"operation": "bundle_media_type"},
            {"field": "_headers.etag", "operation": "matches_regex",
             "value": '^"sha256:[0-9a-f]{64}"$'},
            {"field": "_headers.cache-control", "operation": "not_contains",
             "value": "immutable"},
            {"operation": "etag_is_body_digest"},
        ],
    },
    # 404 is what a client without deployments gets for the digest fallbacks.
    f"GET {_CLIENT}/bundles/{{bundleDigest}}": {"accepted_statuses": [200, 404]},
    f"GET {_CLIENT}/deployments/{{deploymentId}}/{{deploymentDigest}}": {
        "accepted_statuses": [200, 404]},
    f"POST {_CLIENT}/deployments/{{deploymentId}}/status": {
        "body_merge": {"apiVersion": "deployment.margo.org/v1alpha1",
                       "kind": "DeploymentStatusManifest", "deploymentId": "{deploymentId}"},
        "accepted_statuses": [200, 400, 404],
    },
}

_CONTENT_TYPE_TEST = re.compile(r"""headers\.get\(["']Content-Type["']\)[^"']*["']([^"']+)["']\)""")
_SCHEMA_TEST = re.compile(r"const schema = (\{[\s\S]*?\})\s*\n\n")
_SIGNATURE_FAILED = re.compile(r"signature.*fail|signature.*verif", re.IGNORECASE)
_BAD_CERTIFICATE = re.compile(
    r"invalid.*cert.*format|cert.*format.*invalid|cert.*format.*struct", re.IGNORECASE)
_NOT_TRUSTED = re.compile(r"not.*trusted|revoked|rejected", re.IGNORECASE)
_SEMANTIC = re.compile(r"semantic.*error|body.*semantic|request body includes", re.IGNORECASE)
_CONTENT_DIGEST = re.compile(r"content.?digest", re.IGNORECASE)


def is_postman_collection(doc: Any) -> bool:
    """A Postman v2.x export or a Portman/openapi-to-postman collection."""
    if not isinstance(doc, dict) or not isinstance(doc.get("item"), list):
        return False
    info = doc.get("info")
    if isinstance(info, dict) and ("getpostman.com" in str(info.get("schema", ""))
                                   or info.get("name") or info.get("_postman_id")):
        return True
    meta = doc.get("_")
    return isinstance(meta, dict) and bool(meta.get("postman_id"))


def postman_endpoint(path: list[str]) -> str:
    """`["api","v1","clients",":clientId"]` -> `/api/v1/clients/{clientId}`."""
    segments = []
    for index, segment in enumerate(path):
        if not segment.startswith(":"):
            segments.append(segment)
        elif segment == ":digest":
            before = "/".join(path[:index])
            segments.append("{bundleDigest}" if before.endswith("bundles")
                            else "{deploymentDigest}")
        else:
            segments.append("{" + segment[1:] + "}")
    return "/" + "/".join(segments)


def semantic_error_body(endpoint: str) -> dict[str, Any] | None:
    """A valid current-schema body with exactly one bad enum value, so a 422 test reaches
    semantic validation instead of failing earlier as malformed."""
    if "/capabilities" in endpoint:
        body = copy.deepcopy(DEVICE_CAPABILITIES_BODY)
        body["properties"]["supportedDeploymentTypes"] = ["__invalid_deployment_type__"]
        return body
    if endpoint.endswith("/status"):
        return {"apiVersion": "deployment.margo.org/v1alpha1", "kind": "DeploymentStatusManifest",
                "deploymentId": "{deploymentId}", "status": {"state": "__invalid_state__"},
                "components": [{"name": "component-1", "state": "installed"}]}
    return None


def derive_error_behavior(example: dict[str, Any]) -> dict[str, Any]:
    """How to provoke the error a response example documents (the kit's rules, in order)."""
    code = int(example.get("code") or 0)
    name = str(example.get("name") or "")
    if code == 304:
        return {"add_if_none_match": True}
    if code == 406:
        return {"wrong_accept": True}
    if _CONTENT_DIGEST.search(name):
        return {"skip_content_digest": True}
    if _SIGNATURE_FAILED.search(name) or code == 401:
        return {"tamper_signature": True}
    if _BAD_CERTIFICATE.search(name):
        return {"bad_certificate": True, "skip_signing": True}
    if _NOT_TRUSTED.search(name) or code == 403:
        return {"fresh_cert": True, "accepted_statuses": [401, 403]}
    if _SEMANTIC.search(name) or code == 422:
        return {"semantic_error": True}
    return {}


def derive_validations(item: dict[str, Any]) -> list[dict[str, Any]]:
    """Checks read from the item's Postman test script: the Content-Type it expects and the
    string/number types of the top-level fields of its response schema."""
    scripts = "\n".join(line for event in item.get("event") or []
                        if event.get("listen") == "test"
                        for line in (event.get("script") or {}).get("exec") or [])
    validations: list[dict[str, Any]] = []
    content_type = _CONTENT_TYPE_TEST.search(scripts)
    if content_type:
        validations.append({"field": "_headers.content-type", "operation": "contains",
                            "value": content_type.group(1)})
    schema_text = _SCHEMA_TEST.search(scripts)
    if schema_text:
        try:
            schema = json.loads(schema_text.group(1))
        except ValueError:
            schema = {}
        for key, spec in (schema.get("properties") or {}).items():
            kind = spec.get("type") if isinstance(spec, dict) else None
            if kind in ("string", "number"):
                validations.append({"field": key, "operation": f"is_{kind}"})
    return validations


def _raw_body(request: dict[str, Any]) -> Any:
    raw = (request.get("body") or {}).get("raw")
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _rule_body(rules: dict[str, Any], body: Any) -> Any:
    if "body" in rules:
        return copy.deepcopy(rules["body"])
    if "body_merge" in rules and isinstance(body, dict):
        return {**body, **copy.deepcopy(rules["body_merge"])}
    return body


def _request_parts(item: dict[str, Any]) -> tuple[str, str, dict[str, str], dict[str, Any]]:
    request = item.get("request") or {}
    url = request.get("url") or {}
    path = url.get("path") if isinstance(url, dict) else None
    if not path and isinstance(url, str):
        path = [p for p in re.sub(r"^[a-z]+://[^/]+|\{\{baseUrl\}\}", "", url).split("/") if p]
    endpoint = postman_endpoint([str(p) for p in path or []])
    method = str(request.get("method") or "GET").upper()
    headers = {str(h.get("key")): str(h.get("value", "")) for h in request.get("header") or []
               if isinstance(h, dict) and not h.get("disabled")}
    return method, endpoint, headers, ENDPOINT_RULES.get(f"{method} {endpoint}", {})


def _error_body(behavior: dict[str, Any], rules: dict[str, Any], endpoint: str,
                body: Any) -> Any:
    if behavior.get("bad_certificate"):
        # Unique per run: a persistent WFM must not answer "already registered" instead.
        unique = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        return {**copy.deepcopy(rules.get("body") or {}),
                "certificate": f"INVALID_NOT_A_PEM_CERTIFICATE-{unique}"}
    if behavior.get("semantic_error"):
        return semantic_error_body(endpoint) or body
    if behavior.get("wrong_accept") or behavior.get("add_if_none_match"):
        return body
    return _rule_body(rules, body)


def derive_step(item: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
    """One step from one response example of an item."""
    method, endpoint, headers, rules = _request_parts(item)
    expected = int(example.get("code") or 200)
    success = 200 <= expected < 300
    behavior = {} if success else derive_error_behavior(example)
    body = _raw_body(item.get("request") or {})
    if success:
        body = _rule_body(rules, body)
    else:
        body = _error_body(behavior, rules, endpoint, body)
        if behavior.get("wrong_accept"):
            headers["Accept"] = "text/plain"
        elif behavior.get("add_if_none_match"):
            headers["If-None-Match"] = "*"
    step: dict[str, Any] = {
        "id": example.get("id") or item.get("id"),
        "name": f"{item.get('name')} - {example.get('name') or example.get('status')}",
        "crIds": example.get("crIds") or example.get("crids") or item.get("crIds")
        or item.get("crids") or [],
        "method": method, "endpoint": endpoint, "headers": headers,
        "expected_status": expected,
        "validations": (rules.get("validations", derive_validations(item)) if success else []),
        "extract_context": rules.get("extract_context", {}) if success else {},
        "skip_signing": behavior.get("skip_signing", rules.get("skip_signing", False)),
        "skip_content_digest": behavior.get("skip_content_digest", False),
        "fresh_cert": behavior.get("fresh_cert", False),
        "tamper_signature": behavior.get("tamper_signature", False),
    }
    if body is not None:
        step["request_body"] = body
    accepted = rules.get("accepted_statuses") if success else behavior.get("accepted_statuses")
    if accepted:
        step["accepted_statuses"] = list(accepted)
    return step


def _item_step(item: dict[str, Any]) -> dict[str, Any]:
    """An item without response examples: one step expecting 200."""
    return derive_step(item, {"id": item.get("id"), "code": 200, "name": item.get("name")})


def _items(items: list[Any]) -> list[dict[str, Any]]:
    """Requests in order, folders flattened."""
    found: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("item"), list):
            found += _items(item["item"])
        elif isinstance(item, dict) and item.get("request"):
            found.append(item)
    return found


def _selected(item: dict[str, Any], cases: set[str]) -> list[dict[str, Any]] | None:
    """The response examples of an item that a group selects; None when it selects none."""
    examples = [r for r in item.get("response") or [] if isinstance(r, dict)]
    if not cases:
        return examples
    chosen = [r for r in examples if r.get("id") in cases]
    if chosen:
        return chosen
    return examples if item.get("id") in cases else None


def convert_collection(collection: dict[str, Any],
                       cases: set[str] | None = None) -> list[dict[str, Any]]:
    """The collection as one scenario: success steps (in item order), then error steps."""
    successes: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for item in _items(collection.get("item") or []):
        examples = _selected(item, cases or set())
        if examples is None:
            continue
        if not examples:
            successes.append(_item_step(item))
            continue
        for example in examples:
            step = derive_step(item, example)
            (successes if 200 <= step["expected_status"] < 300 else errors).append(step)
    info = collection.get("info") or {}
    meta = collection.get("_") or {}
    return [{"id": info.get("_postman_id") or meta.get("postman_id") or "postman-collection",
             "name": info.get("name") or "Postman Collection",
             "steps": [*successes, *errors]}]
