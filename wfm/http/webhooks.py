"""Verify push webhooks from Git hosting (GitHub, Gitea/Forgejo, GitLab) for ``POST /hooks/git``.

The fleet server fetches the fleet-source repository and recompiles when it is told about a push.
Whoever can reach the hook endpoint can make it do that, so every request is authenticated with a
shared secret *before* anything else looks at it. This module is pure: it takes the raw body bytes
and the request headers (any mapping; names are matched case-insensitively) and either returns a
:class:`PushEvent`, returns ``None`` for an authenticated event that is not a push (GitHub's
``ping`` when a hook is created, a merge-request hook, ...), or raises :class:`WebhookError`
whose ``status`` is the HTTP status to answer with (400 malformed, 401 not authenticated).

Provider schemes
----------------
GitHub
    Detected by ``X-GitHub-Event``. The body is signed with HMAC-SHA256 keyed by the hook secret
    and sent as ``X-Hub-Signature-256: sha256=<64 hex digits>``. Delivery id:
    ``X-GitHub-Delivery``.
Gitea and Forgejo
    Detected by ``X-Gitea-Event`` or ``X-Forgejo-Event``. The signature is the bare hex
    HMAC-SHA256 of the body in ``X-Gitea-Signature`` / ``X-Forgejo-Signature`` (Forgejo sends
    both; every one present must match). Gitea also sends GitHub- and Gogs-compatible headers
    (``X-GitHub-Event``, ``X-Hub-Signature-256``...), so the Gitea headers are looked for first
    and only the Gitea signature counts for a Gitea request. Delivery id: ``X-Gitea-Delivery`` /
    ``X-Forgejo-Delivery``.
GitLab
    Detected by ``X-Gitlab-Event`` (``Push Hook``; ``Tag Push Hook`` is a push of a tag ref).
    GitLab does not sign bodies: it sends the configured secret token verbatim in
    ``X-Gitlab-Token``, so that header is compared with the secret (in constant time, via
    fixed-length SHA-256 digests so that not even the length leaks). The token travels in the
    clear inside the request, which is why the endpoint must only be served over TLS. Delivery
    id: ``X-Gitlab-Event-UUID``.

Why GitHub's SHA-1 signature is refused
---------------------------------------
GitHub still sends the legacy ``X-Hub-Signature: sha1=...`` next to the SHA-256 one, only for
old receivers. HMAC-SHA1 is not known to be forgeable today, but SHA-1 is deprecated, and a
receiver that accepts *either* header is only as strong as the weaker one and invites a
downgrade (strip the SHA-256 header, attack the SHA-1 one). One algorithm, one header: a request
carrying only ``X-Hub-Signature`` is rejected with 401 and a message saying why.

Before the body
---------------
:func:`check_headers` runs every check the headers allow before the body is read (the server
calls it before buffering up to 25 MiB, `wfm.http.fleet_api`): the secret is configured, one
provider is named, its signature header is present and well formed, and GitLab's token,
which is sent in a header, matches. What needs the body (GitHub's and Gitea's HMAC) cannot
be checked before it; such bodies count against the server's webhook budget
(`wfm.admission.budgets`) while they are read.

Order of checks
---------------
1. An empty secret is a configuration error: :class:`ValueError` (not ``WebhookError``), raised
   whatever the request, so the server can refuse to serve hooks without a secret.
2. Bodies over :data:`MAX_BODY_BYTES` (25 MiB, GitHub's own cap) → 400, before hashing them.
3. Provider detection from the event headers → 400 when none (or two conflicting ones) is found.
4. Signature / token check → 401. The body is not decoded or parsed before this succeeds, and
   the check runs for every event type, pings included.
5. Non-push events → ``None``. Push events: the body must be a UTF-8 JSON object with the push
   fields, else 400 (parsed by :mod:`margo.jsonstrict`: no NaN, no infinite numbers, no
   duplicate keys).

Error messages say what is wrong and which header or field; they never include the secret, the
received signature or token, or pieces of the body.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from margo import jsonstrict

__all__ = ["MAX_BODY_BYTES", "PushEvent", "WebhookError", "check_headers", "verify_push"]

MAX_BODY_BYTES = 25 * 1024 * 1024
"""Largest body accepted (25 MiB); larger ones are rejected with 400 before being hashed."""

_HEX_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
# SHA-1 object ids, and SHA-256 ones for repositories in Git's sha256 object format (Gitea ≥ 1.22).
_COMMIT_ID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# What `git check-ref-format` forbids anywhere in a ref name (besides control characters).
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//|/\.")

_GITHUB_EVENT = "x-github-event"
_GITEA_EVENTS = ("x-gitea-event", "x-forgejo-event")
_GITEA_SIGNATURES = ("x-gitea-signature", "x-forgejo-signature")
_GITEA_DELIVERIES = ("x-gitea-delivery", "x-forgejo-delivery")
_GITLAB_EVENT = "x-gitlab-event"
_GITLAB_PUSH_KINDS = {"push hook": "push", "tag push hook": "tag_push"}


class WebhookError(ValueError):
    """A webhook request that must be refused; ``status`` is the HTTP status to answer with.

    400: malformed request (unknown provider, oversized or unparsable body, missing push fields).
    401: missing, malformed or wrong signature / token.
    """

    status: int

    def __init__(self, message: str, status: int = 400) -> None:
        if status not in (400, 401):
            raise ValueError(f"WebhookError status must be 400 or 401, not {status!r}")
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class PushEvent:
    """An authenticated push: which repository, which ref, and where the ref now points."""

    provider: str  # "github" | "gitea" | "gitlab"
    repository: str  # clone URL as sent (https clone_url / git_http_url)
    full_name: str  # owner/repo (path_with_namespace for GitLab)
    ref: str  # e.g. "refs/heads/main"
    after: str  # new commit id (lower-case hex), all zeros for a deleted ref
    deleted: bool
    delivery: str | None  # X-GitHub-Delivery / X-Gitea-Delivery / X-Gitlab-Event-UUID


def verify_push(body: bytes, headers: Mapping[str, str], secret: str | bytes) -> PushEvent | None:
    """Authenticate a Git hosting webhook and extract the push it reports.

    Returns the :class:`PushEvent` for push events and ``None`` for authenticated events that are
    not pushes. Raises :class:`WebhookError` (``status`` 400 or 401) for requests to refuse, and
    plain :class:`ValueError` when ``secret`` is empty (a configuration error).
    """
    key = _secret_bytes(secret)
    if not isinstance(body, bytes | bytearray):
        raise TypeError(f"body must be the raw request bytes, not {type(body).__name__}")
    if len(body) > MAX_BODY_BYTES:
        raise WebhookError(
            f"body is {len(body)} bytes, more than the {MAX_BODY_BYTES}-byte limit", 400
        )
    data = bytes(body)
    h = _Headers(headers)
    provider = _detect_provider(h)

    if provider == "github":
        _verify_github(data, h, key)
        if (h.get(_GITHUB_EVENT) or "").lower() != "push":
            return None
        return _parse_github_style("github", data, h.get("x-github-delivery"))
    if provider == "gitea":
        _verify_gitea(data, h, key)
        events = {(h.get(name) or "").lower() for name in _GITEA_EVENTS if name in h}
        if len(events) > 1:
            raise WebhookError("X-Gitea-Event and X-Forgejo-Event disagree", 400)
        if events != {"push"}:
            return None
        delivery = next((h.get(n) for n in _GITEA_DELIVERIES if h.get(n)), None)
        return _parse_github_style("gitea", data, delivery)
    _verify_gitlab(h, key)
    kind = _GITLAB_PUSH_KINDS.get((h.get(_GITLAB_EVENT) or "").lower())
    if kind is None:
        return None
    return _parse_gitlab(data, kind, h.get("x-gitlab-event-uuid"))


def check_headers(headers: Mapping[str, str], secret: str | bytes) -> None:
    """What can be refused before the body is read: raises like :func:`verify_push` would
    (ValueError for an empty secret, WebhookError 400 for no or two providers, 401 for a
    missing or malformed signature header or a wrong GitLab token). Passing it is no
    authentication for GitHub and Gitea: their HMAC covers the body."""
    key = _secret_bytes(secret)
    h = _Headers(headers)
    provider = _detect_provider(h)
    if provider == "github":
        _github_signature(h)
    elif provider == "gitea":
        for name, signature in _gitea_signatures(h):
            if not _HEX_SHA256.fullmatch(signature):
                raise WebhookError(f"{name} is not a hex HMAC-SHA256 (64 hex digits)", 401)
    else:
        _verify_gitlab(h, key)


# --- headers and provider detection ----------------------------------------------------------


class _Headers:
    """Case-insensitive view of the request headers; empty values count as absent.

    A header sent several times with different values is ambiguous and refused when read (401 for
    the authentication headers, 400 otherwise) instead of silently picking one.
    """

    _AUTH = frozenset({"x-hub-signature-256", "x-gitlab-token", *_GITEA_SIGNATURES})

    def __init__(self, headers: Mapping[str, str]) -> None:
        self._values: dict[str, str] = {}
        self._conflicts: set[str] = set()
        for name, value in headers.items():
            folded = name.strip().lower()
            text = value.strip(" \t")
            if not text:
                continue
            if self._values.setdefault(folded, text) != text:
                self._conflicts.add(folded)

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def get(self, name: str) -> str | None:
        if name in self._conflicts:
            status = 401 if name in self._AUTH else 400
            raise WebhookError(f"header {_display(name)} sent more than once, differently", status)
        return self._values.get(name)


def _display(name: str) -> str:
    return "-".join(part.capitalize() for part in name.split("-"))


def _detect_provider(h: _Headers) -> str:
    if any(name in h for name in _GITEA_EVENTS):
        return "gitea"  # Gitea also sends X-GitHub-Event: its own headers take precedence
    github, gitlab = _GITHUB_EVENT in h, _GITLAB_EVENT in h
    if github and gitlab:
        raise WebhookError("both X-GitHub-Event and X-Gitlab-Event sent: ambiguous provider", 400)
    if github:
        return "github"
    if gitlab:
        return "gitlab"
    raise WebhookError(
        "unknown webhook provider: expected an X-GitHub-Event, X-Gitea-Event, X-Forgejo-Event "
        "or X-Gitlab-Event header",
        400,
    )


# --- authentication --------------------------------------------------------------------------


def _secret_bytes(secret: str | bytes) -> bytes:
    if isinstance(secret, str):
        key = secret.encode("utf-8")
    elif isinstance(secret, bytes | bytearray):
        key = bytes(secret)
    else:
        raise TypeError(f"webhook secret must be str or bytes, not {type(secret).__name__}")
    if not key:
        raise ValueError("webhook secret is empty: configure a secret before serving /hooks/git")
    return key


def _verify_github(body: bytes, h: _Headers, key: bytes) -> None:
    _check_hmac(body, key, _github_signature(h), "X-Hub-Signature-256")


def _github_signature(h: _Headers) -> str:
    """The hex digest of X-Hub-Signature-256 (401 when missing or not `sha256=...`)."""
    signature = h.get("x-hub-signature-256")
    if signature is None:
        if "x-hub-signature" in h:
            raise WebhookError(
                "only the legacy SHA-1 X-Hub-Signature was sent; X-Hub-Signature-256 is "
                "required (SHA-1 signatures are not accepted)",
                401,
            )
        raise WebhookError("missing X-Hub-Signature-256 header (is the hook's secret set?)", 401)
    algorithm, sep, hexdigest = signature.partition("=")
    if not sep or algorithm.strip().lower() != "sha256":
        raise WebhookError("X-Hub-Signature-256 must have the form sha256=<64 hex digits>", 401)
    return hexdigest.strip()


def _verify_gitea(body: bytes, h: _Headers, key: bytes) -> None:
    for name, signature in _gitea_signatures(h):
        _check_hmac(body, key, signature, name)


def _gitea_signatures(h: _Headers) -> list[tuple[str, str]]:
    """(header as displayed, value) of every Gitea/Forgejo signature sent (401: none)."""
    present = [(_display(name), h.get(name) or "") for name in _GITEA_SIGNATURES if name in h]
    if not present:
        raise WebhookError(
            "missing X-Gitea-Signature / X-Forgejo-Signature header (is the hook's secret set?)",
            401,
        )
    return present


def _check_hmac(body: bytes, key: bytes, hexdigest: str, header: str) -> None:
    if not _HEX_SHA256.fullmatch(hexdigest):
        raise WebhookError(f"{header} is not a hex HMAC-SHA256 (64 hex digits)", 401)
    expected = hmac.new(key, body, hashlib.sha256).digest()
    if not hmac.compare_digest(expected, bytes.fromhex(hexdigest)):
        raise WebhookError(f"{header} does not match the body: wrong secret or altered body", 401)


def _verify_gitlab(h: _Headers, key: bytes) -> None:
    token = h.get("x-gitlab-token")
    if token is None:
        raise WebhookError("missing X-Gitlab-Token header (is the hook's secret token set?)", 401)
    given = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
    if not hmac.compare_digest(given, hashlib.sha256(key).digest()):
        raise WebhookError("X-Gitlab-Token does not match the configured secret", 401)


# --- payloads (only ever reached after authentication) ---------------------------------------


def _load_object(body: bytes) -> dict[str, Any]:
    try:
        payload = jsonstrict.loads(body)  # NaN, 1e999, duplicate keys: refused
    except jsonstrict.JsonRefused as exc:
        raise WebhookError(
            f"body is not UTF-8 JSON ({exc.reason}; set the hook's content type to "
            "application/json)", 400
        ) from None
    if not isinstance(payload, dict):
        raise WebhookError(f"body is JSON but not an object ({type(payload).__name__})", 400)
    return payload


def _object(payload: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    value = payload.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise WebhookError(f"push payload field {key!r} is not an object", 400)
    return value


def _text(
    obj: Mapping[str, Any] | None, key: str, where: str, check: Callable[[str], bool] | None = None
) -> str:
    value = None if obj is None else obj.get(key)
    if not isinstance(value, str) or not value:
        raise WebhookError(f"push payload lacks the string field {where!r}", 400)
    if _CONTROL.search(value) or (check is not None and not check(value)):
        raise WebhookError(f"push payload field {where!r} is not valid", 400)
    return value


def _valid_ref(ref: str) -> bool:
    return (
        ref.startswith("refs/")
        and not _REF_FORBIDDEN.search(ref)
        and not ref.endswith(("/", ".", ".lock"))
    )


def _valid_url(url: str) -> bool:
    return not url.startswith("-") and not any(c.isspace() for c in url)


def _commit_id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _COMMIT_ID.fullmatch(value.lower()):
        raise WebhookError(f"push payload field {where!r} is not a commit id (hex)", 400)
    return value.lower()


def _is_zero(commit: str) -> bool:
    return commit.strip("0") == ""


def _parse_github_style(provider: str, body: bytes, delivery: str | None) -> PushEvent:
    """GitHub and Gitea/Forgejo push payloads share the fields we need."""
    payload = _load_object(body)
    repo = _object(payload, "repository")
    ref = _text(payload, "ref", "ref", _valid_ref)
    after = _commit_id(payload.get("after"), "after")
    deleted = _is_zero(after)
    stated = payload.get("deleted")
    if stated is not None:
        if not isinstance(stated, bool):
            raise WebhookError("push payload field 'deleted' is not a boolean", 400)
        if stated != deleted:
            raise WebhookError("push payload 'deleted' disagrees with 'after'", 400)
    return PushEvent(
        provider=provider,
        repository=_text(repo, "clone_url", "repository.clone_url", _valid_url),
        full_name=_text(repo, "full_name", "repository.full_name"),
        ref=ref,
        after=after,
        deleted=deleted,
        delivery=delivery,
    )


def _parse_gitlab(body: bytes, kind: str, delivery: str | None) -> PushEvent:
    payload = _load_object(body)
    object_kind = payload.get("object_kind")
    if object_kind is not None and object_kind != kind:
        raise WebhookError("X-Gitlab-Event does not match the payload's object_kind", 400)
    ref = _text(payload, "ref", "ref", _valid_ref)
    if kind == "tag_push" and not ref.startswith("refs/tags/"):
        raise WebhookError("Tag Push Hook for a ref that is not under refs/tags/", 400)
    if payload.get("after") is not None:
        after = _commit_id(payload["after"], "after")
    else:
        after = _commit_id(payload.get("checkout_sha"), "checkout_sha")
    project = _object(payload, "project")
    repository = _object(payload, "repository")
    if project is not None and project.get("git_http_url") is not None:
        url = _text(project, "git_http_url", "project.git_http_url", _valid_url)
    else:
        url = _text(repository, "git_http_url", "repository.git_http_url", _valid_url)
    return PushEvent(
        provider="gitlab",
        repository=url,
        full_name=_text(project, "path_with_namespace", "project.path_with_namespace"),
        ref=ref,
        after=after,
        deleted=_is_zero(after),
        delivery=delivery,
    )
