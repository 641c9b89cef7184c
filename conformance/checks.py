"""The kit's assertion language: `{name}` context substitution, field paths into a response,
and every validation operation of its step schema (README section 2.3).

Verdicts must match the kit's own runner, or a vendor's "pass" here would mean something
else than a pass there. So the operators follow its JavaScript semantics where they differ
from Python's: `contains` stringifies the value (`String(x ?? '')`), `equals` never treats
`true` as `1`, a missing context variable becomes the kit's 404-provoking fallback or "".
Two deliberate departures, both only where the kit's behaviour is an accident of JavaScript:
digests are computed over the exact response bytes (the kit re-encodes text, which breaks
on binary bodies), and `equals` compares lists and objects by value (JavaScript's `===`
compares them by identity, so such a check could never pass).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "APP_DESCRIPTION_MEDIA_TYPE",
    "BUNDLE_MEDIA_TYPE",
    "CONTEXT_FALLBACKS",
    "OPERATIONS",
    "Response",
    "field_value",
    "substitute",
    "validate",
]

BUNDLE_MEDIA_TYPE = "application/vnd.margo.bundle.v1+tar+gzip"
APP_DESCRIPTION_MEDIA_TYPE = "application/vnd.margo.app.description.v1+yaml"
MARGO_APP_MEDIA_PREFIX = "application/vnd.margo.app."
ZERO_DIGEST = "sha256:" + "0" * 64
# Well-formed ids for context that was never extracted: the WFM answers 404, not a redirect
# for a double slash (the kit's CONTEXT_FALLBACKS).
CONTEXT_FALLBACKS = {"deploymentId": "deployment-none-00000000",
                     "deploymentDigest": ZERO_DIGEST, "bundleDigest": ZERO_DIGEST}
_PLACEHOLDER = re.compile(r"\{([^}]+)\}")


@dataclass(frozen=True)
class Response:
    """What a step observed: an HTTP answer, an `oras` result, or a transport failure
    (`status` 0 with `transport_error`). Header names are lower case."""

    method: str
    endpoint: str
    status: int
    headers: Mapping[str, str]
    body: bytes
    transport_error: str | None = None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    @property
    def source(self) -> Any:
        """The parsed body as the kit sees it: JSON, `{}` when empty, `{"_body": text}`
        when not JSON."""
        if not self.body:
            return {}
        try:
            return json.loads(self.body)
        except ValueError:
            return {"_body": self.text}


def _js_string(value: Any) -> str:
    """JavaScript's `String(value ?? '')`, for the string operators."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return ",".join(_js_string(v) for v in value)
    if isinstance(value, dict):
        return "[object Object]"
    return str(value)


def _number(value: Any) -> float:
    """JavaScript's `Number(value)`: NaN for what is not a number."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    if value is None:
        return 0.0
    try:
        return float(str(value).strip() or 0)
    except ValueError:
        return math.nan


def _same(actual: Any, expected: Any) -> bool:
    """Strict equality: booleans equal only booleans, numbers compare by value."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return isinstance(actual, bool) and isinstance(expected, bool) and actual == expected
    if isinstance(actual, int | float) and isinstance(expected, int | float):
        return actual == expected
    return type(actual) is type(expected) and bool(actual == expected)


def substitute(value: Any, context: Mapping[str, Any]) -> Any:
    """Replace `{name}` in every string (recursively) by the context value, else by the
    kit's fallback for that name, else by nothing."""
    if isinstance(value, str):
        def replace(match: re.Match[str]) -> str:
            found = context.get(match.group(1))
            if found is not None and found != "":
                return _js_string(found)
            return CONTEXT_FALLBACKS.get(match.group(1), "")
        return _PLACEHOLDER.sub(replace, value)
    if isinstance(value, list):
        return [substitute(v, context) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, context) for k, v in value.items()}
    return value


def field_value(response: Response, path: str) -> Any:
    """`_body` (raw text), `_headers.<name>` (case-insensitive), else a dot path into the
    JSON body (numeric parts index arrays). None when absent."""
    if path == "_body":
        return response.text
    parts = path.split(".")
    if parts[0] == "_headers":
        return response.headers.get(".".join(parts[1:]).lower()) if len(parts) > 1 else dict(
            response.headers)
    current: Any = response.source
    for part in parts:
        if isinstance(current, list) and part.isdigit():
            index = int(part)
            current = current[index] if index < len(current) else None
        elif isinstance(current, dict):
            current = current.get(part)
        else:
            return None
    return current


# (response, field path, the field's value, the substituted expected value) -> failure or "".
Operation = Callable[[Response, str, Any, Any], str]


def _body_digest(response: Response) -> str:
    return "sha256:" + hashlib.sha256(response.body).hexdigest()


def _etag_is_body_digest(response: Response, _: str, __: Any, ___: Any) -> str:
    """MI-015: the ETag is a strong validator, sha256 of the exact body."""
    raw = response.headers.get("etag")
    if raw is None:
        return "ETag header is missing"
    normalised = raw.removeprefix("W/").strip('"')
    digest = _body_digest(response)
    return "" if normalised == digest else (
        f"ETag {raw!r} is not sha256 of the response body (expected {digest}) (MI-015)")


def _body_sha256_equals(response: Response, _: str, __: Any, expected: Any) -> str:
    """MI-025: the served bytes hash to the digest the manifest advertised."""
    wanted = _js_string(expected).removeprefix("sha256:").lower()
    if not wanted:
        return "the expected digest is empty"
    actual = hashlib.sha256(response.body).hexdigest()
    return "" if actual == wanted else (
        f"served body sha256 ({actual}) does not match the manifest digest ({wanted}) (MI-025)")


def _layers(response: Response) -> list[Any]:
    layers = field_value(response, "layers")
    return layers if isinstance(layers, list) else []


def _has_description_layer(response: Response, _: str, __: Any, ___: Any) -> str:
    """AR-002: one layer carries the Application Description media type."""
    if any(isinstance(layer, dict) and layer.get("mediaType") == APP_DESCRIPTION_MEDIA_TYPE
           for layer in _layers(response)):
        return ""
    return f"no layer has mediaType {APP_DESCRIPTION_MEDIA_TYPE!r} (the Application Description)"


def _margo_layer_types(response: Response, _: str, __: Any, ___: Any) -> str:
    """AR-004/011: every layer has a Margo media type, never a generic one."""
    generic = []
    for layer in _layers(response):
        layer = layer if isinstance(layer, dict) else {}
        media_type = _js_string(layer.get("mediaType"))
        if not media_type.startswith(MARGO_APP_MEDIA_PREFIX):
            title = (layer.get("annotations") or {}).get("org.opencontainers.image.title")
            generic.append(f"{title or layer.get('digest')}: {media_type!r}")
    return "" if not generic else "layer(s) without a Margo media type: " + ", ".join(generic)


def _bundle_null_when_empty(response: Response, _: str, __: Any, ___: Any) -> str:
    """MI-009: with no deployments, `bundle` is present and null (not omitted)."""
    source = response.source
    deployments = field_value(response, "deployments")
    if isinstance(deployments, list) and not deployments:
        present = isinstance(source, dict) and "bundle" in source and source["bundle"] is None
        return "" if present else (
            "bundle must be present and null when the deployments array is empty (MI-009)")
    return ""


def _bundle_media_type(response: Response, _: str, __: Any, ___: Any) -> str:
    """MI-031: a present bundle has the Margo bundle media type."""
    bundle = field_value(response, "bundle")
    if bundle is None:
        return ""
    media_type = bundle.get("mediaType") if isinstance(bundle, dict) else None
    return "" if media_type == BUNDLE_MEDIA_TYPE else (
        f"bundle.mediaType expected {BUNDLE_MEDIA_TYPE!r}, got {media_type!r} (MI-031)")


def _simple(test: Callable[[Any, Any], bool],
            message: Callable[[str, Any, Any], str]) -> Operation:
    """An operator on one field's value."""
    def check(response: Response, path: str, actual: Any, expected: Any) -> str:
        return "" if test(actual, expected) else message(path, actual, expected)
    return check


def _length(value: Any) -> str:
    """A length for a failure message, with the items when they are short enough to read."""
    if not isinstance(value, list):
        return type(value).__name__
    items = repr(value)
    return f"{len(value)}: {items}" if len(items) <= 300 else str(len(value))


def _regex_matches(pattern: Any, actual: Any) -> bool:
    try:
        return re.search(str(pattern), _js_string(actual)) is not None
    except re.error:
        return False


OPERATIONS: dict[str, Operation] = {
    "exists": _simple(lambda a, e: a is not None, lambda f, a, e: f"{f} is missing"),
    "is_string": _simple(lambda a, e: isinstance(a, str), lambda f, a, e: f"{f} is not a string"),
    "is_number": _simple(lambda a, e: isinstance(a, int | float) and not isinstance(a, bool),
                         lambda f, a, e: f"{f} is not a number (got {a!r})"),
    "is_array": _simple(lambda a, e: isinstance(a, list), lambda f, a, e: f"{f} is not an array"),
    "not_empty": _simple(lambda a, e: a is not None and _js_string(a) != "",
                         lambda f, a, e: f"{f} is empty"),
    "equals": _simple(_same, lambda f, a, e: f"{f} expected {e!r}, got {a!r}"),
    "contains": _simple(lambda a, e: _js_string(e) in _js_string(a),
                        lambda f, a, e: f"{f} does not contain {e!r} (got {a!r})"),
    "not_contains": _simple(lambda a, e: _js_string(e) not in _js_string(a),
                            lambda f, a, e: f"{f} must not contain {e!r} (got {a!r})"),
    "one_of": _simple(lambda a, e: isinstance(e, list) and any(_same(a, x) for x in e),
                      lambda f, a, e: f"{f} expected one of {e!r}, got {a!r}"),
    "greater_than": _simple(lambda a, e: _number(a) > _number(e),
                            lambda f, a, e: f"{f} expected > {e!r}, got {a!r}"),
    "array_length_gte": _simple(lambda a, e: isinstance(a, list) and len(a) >= _number(e),
                                lambda f, a, e: f"{f} expected length >= {e}, got {_length(a)}"),
    "array_length_equals": _simple(
        lambda a, e: isinstance(a, list) and len(a) == _number(e),
        lambda f, a, e: f"{f} expected length == {e}, got {_length(a)}"),
    "etag_is_body_digest": _etag_is_body_digest,
    "body_sha256_equals": _body_sha256_equals,
    "has_application_description_layer": _has_description_layer,
    "layer_media_types_are_margo_specific": _margo_layer_types,
    "bundle_null_when_no_deployments": _bundle_null_when_empty,
    "bundle_media_type": _bundle_media_type,
}


def validate(response: Response, validation: Mapping[str, Any],
             context: Mapping[str, Any]) -> str:
    """"" when the validation holds, else why not. `matches_regex` uses the raw pattern:
    substituting context into it would eat quantifiers such as `{64}`."""
    operation = validation.get("operation")
    path = validation.get("field")
    actual = field_value(response, str(path)) if path is not None else None
    if operation == "matches_regex":
        pattern = validation.get("value")
        return "" if _regex_matches(pattern, actual) else (
            f"{path} value {actual!r} does not match pattern {pattern}")
    check = OPERATIONS.get(str(operation))
    if check is None:
        return f"unsupported validation operation: {operation}"
    expected = substitute(validation.get("value"), context)
    return check(response, str(path), actual, expected)
