"""Push webhooks: each provider's signed push is accepted, and everything forged or garbled is not.

Payloads are trimmed copies of the documented GitHub, Gitea/Forgejo and GitLab push payloads;
the tests sign them themselves with ``hmac`` exactly as the providers do.
"""

from __future__ import annotations

import copy
import dataclasses
import hmac
import io
import json
from http.client import parse_headers
from typing import Any

import pytest

from wfm.http import webhooks
from wfm.http.webhooks import MAX_BODY_BYTES, PushEvent, WebhookError, verify_push

SECRET = "It's a Secret to Everybody"
WRONG_SECRET = "It's a secret to everybody"
BEFORE = "6113728f27ae82c7b1a177c8d03f9e96e0adf246"
AFTER = "0d1a26e67d8f5eaf1f6ba5c57fc3c7d91ac0fd1c"
ZEROS = "0" * 40
GITHUB_DELIVERY = "72d3162e-cc78-11e3-81ab-4c9367dc0958"
GITEA_DELIVERY = "f6266f16-1bf3-46a5-9ea4-602e06ead473"
GITLAB_UUID = "9cdd8a5c-2c6f-4a3e-8a4f-6d6b2c1f0e3a"


# --- payloads ---------------------------------------------------------------------------------


def github_push(**changes: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "ref": "refs/heads/main",
        "before": BEFORE,
        "after": AFTER,
        "created": False,
        "deleted": False,
        "forced": False,
        "base_ref": None,
        "compare": f"https://github.com/acme/fleet/compare/{BEFORE[:12]}...{AFTER[:12]}",
        "commits": [
            {
                "id": AFTER,
                "tree_id": "f9d2a07e9488b91af2641b26b9407fe22a451433",
                "distinct": True,
                "message": "Roll out edge-agent 1.4 to line 3",
                "timestamp": "2024-05-14T10:02:11+02:00",
                "url": f"https://github.com/acme/fleet/commit/{AFTER}",
                "author": {"name": "Ada", "email": "ada@example.com", "username": "ada"},
                "committer": {"name": "Ada", "email": "ada@example.com", "username": "ada"},
                "added": [],
                "removed": [],
                "modified": ["deployments/line-3.yaml"],
            }
        ],
        "head_commit": {"id": AFTER, "message": "Roll out edge-agent 1.4 to line 3"},
        "repository": {
            "id": 186853002,
            "node_id": "MDEwOlJlcG9zaXRvcnkxODY4NTMwMDI=",
            "name": "fleet",
            "full_name": "acme/fleet",
            "private": True,
            "owner": {"name": "acme", "login": "acme", "id": 21031067},
            "html_url": "https://github.com/acme/fleet",
            "url": "https://github.com/acme/fleet",
            "git_url": "git://github.com/acme/fleet.git",
            "ssh_url": "git@github.com:acme/fleet.git",
            "clone_url": "https://github.com/acme/fleet.git",
            "default_branch": "main",
        },
        "pusher": {"name": "ada", "email": "ada@example.com"},
        "sender": {"login": "ada", "id": 21031067, "type": "User"},
    }
    payload.update(changes)
    return payload


def github_ping() -> dict[str, Any]:
    return {
        "zen": "Keep it logically awesome.",
        "hook_id": 30,
        "hook": {"type": "Repository", "id": 30, "events": ["push"], "active": True},
        "repository": {"full_name": "acme/fleet"},
        "sender": {"login": "ada"},
    }


def gitea_push(**changes: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "ref": "refs/heads/develop",
        "before": BEFORE,
        "after": AFTER,
        "compare_url": f"http://gitea.internal:3000/acme/fleet/compare/{BEFORE}...{AFTER}",
        "commits": [
            {
                "id": AFTER,
                "message": "Webhooks Yay!",
                "url": f"http://gitea.internal:3000/acme/fleet/commit/{AFTER}",
                "author": {"name": "Gitea", "email": "someone@gitea.io", "username": "gitea"},
                "committer": {"name": "Gitea", "email": "someone@gitea.io", "username": "gitea"},
                "timestamp": "2017-03-13T13:52:11-04:00",
            }
        ],
        "repository": {
            "id": 140,
            "owner": {"id": 1, "login": "acme", "full_name": "", "username": "acme"},
            "name": "fleet",
            "full_name": "acme/fleet",
            "private": False,
            "fork": False,
            "html_url": "http://gitea.internal:3000/acme/fleet",
            "ssh_url": "ssh://gitea@gitea.internal:2222/acme/fleet.git",
            "clone_url": "http://gitea.internal:3000/acme/fleet.git",
            "default_branch": "develop",
        },
        "pusher": {"id": 1, "login": "gitea", "username": "gitea"},
        "sender": {"id": 1, "login": "gitea", "username": "gitea"},
    }
    payload.update(changes)
    return payload


def gitlab_push(**changes: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "object_kind": "push",
        "event_name": "push",
        "before": BEFORE,
        "after": AFTER,
        "ref": "refs/heads/main",
        "ref_protected": True,
        "checkout_sha": AFTER,
        "user_id": 4,
        "user_name": "John Smith",
        "user_username": "jsmith",
        "project_id": 15,
        "project": {
            "id": 15,
            "name": "Fleet",
            "web_url": "https://gitlab.example.com/plant/ops/fleet",
            "git_ssh_url": "git@gitlab.example.com:plant/ops/fleet.git",
            "git_http_url": "https://gitlab.example.com/plant/ops/fleet.git",
            "namespace": "ops",
            "visibility_level": 0,
            "path_with_namespace": "plant/ops/fleet",
            "default_branch": "main",
        },
        "commits": [
            {
                "id": AFTER,
                "message": "Roll out edge-agent 1.4\n",
                "timestamp": "2024-05-14T10:02:11+02:00",
                "url": f"https://gitlab.example.com/plant/ops/fleet/-/commit/{AFTER}",
                "author": {"name": "John Smith", "email": "[REDACTED]"},
                "added": [],
                "modified": ["deployments/line-3.yaml"],
                "removed": [],
            }
        ],
        "total_commits_count": 1,
        "repository": {
            "name": "Fleet",
            "url": "git@gitlab.example.com:plant/ops/fleet.git",
            "homepage": "https://gitlab.example.com/plant/ops/fleet",
            "git_http_url": "https://gitlab.example.com/plant/ops/fleet.git",
            "git_ssh_url": "git@gitlab.example.com:plant/ops/fleet.git",
            "visibility_level": 0,
        },
    }
    payload.update(changes)
    return payload


def gitlab_tag_push(**changes: Any) -> dict[str, Any]:
    return gitlab_push(
        **{"object_kind": "tag_push", "event_name": "tag_push", "ref": "refs/tags/v1.4.0"} | changes
    )


def without(payload: dict[str, Any], dotted: str) -> dict[str, Any]:
    """A deep copy of ``payload`` without the field at ``dotted`` (e.g. "repository.clone_url")."""
    result = copy.deepcopy(payload)
    *parents, last = dotted.split(".")
    node = result
    for part in parents:
        node = node[part]
    del node[last]
    return result


def encode(payload: Any) -> bytes:
    return json.dumps(payload, indent=2).encode()


# --- signing, as the providers do it ------------------------------------------------------------


def hmac_hex(body: bytes, secret: str = SECRET, digest: str = "sha256") -> str:
    return hmac.new(secret.encode(), body, digest).hexdigest()


def github_headers(body: bytes, event: str = "push", secret: str = SECRET) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": "GitHub-Hookshot/044aadd",
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": GITHUB_DELIVERY,
        "X-GitHub-Hook-ID": "292430182",
        "X-Hub-Signature": "sha1=" + hmac_hex(body, secret, "sha1"),
        "X-Hub-Signature-256": "sha256=" + hmac_hex(body, secret),
    }


def gitea_headers(body: bytes, event: str = "push", secret: str = SECRET) -> dict[str, str]:
    """Gitea's real header set, GitHub- and Gogs-compatible copies included."""
    signature = hmac_hex(body, secret)
    return {
        "Content-Type": "application/json",
        "X-GitHub-Delivery": GITEA_DELIVERY,
        "X-GitHub-Event": event,
        "X-Gogs-Delivery": GITEA_DELIVERY,
        "X-Gogs-Event": event,
        "X-Gogs-Signature": signature,
        "X-Gitea-Delivery": GITEA_DELIVERY,
        "X-Gitea-Event": event,
        "X-Gitea-Event-Type": event,
        "X-Gitea-Signature": signature,
        "X-Hub-Signature": "sha1=" + hmac_hex(body, secret, "sha1"),
        "X-Hub-Signature-256": "sha256=" + signature,
    }


def forgejo_headers(body: bytes, event: str = "push", secret: str = SECRET) -> dict[str, str]:
    signature = hmac_hex(body, secret)
    return {
        "Content-Type": "application/json",
        "X-Forgejo-Delivery": GITEA_DELIVERY,
        "X-Forgejo-Event": event,
        "X-Forgejo-Signature": signature,
        "X-Gitea-Delivery": GITEA_DELIVERY,
        "X-Gitea-Event": event,
        "X-Gitea-Signature": signature,
    }


def gitlab_headers(event: str = "Push Hook", token: str = SECRET) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": "GitLab/17.0.0",
        "X-Gitlab-Event": event,
        "X-Gitlab-Event-UUID": GITLAB_UUID,
        "X-Gitlab-Instance": "https://gitlab.example.com",
        "X-Gitlab-Webhook-UUID": "16de3f5e-8a8d-4a5b-9f2d-6ce1b0c3b0a7",
        "X-Gitlab-Token": token,
    }


def replaced(headers: dict[str, str], **values: str | None) -> dict[str, str]:
    """``headers`` with some replaced (``X_Hub_Signature_256="..."``) or dropped (``=None``)."""
    result = dict(headers)
    for key, value in values.items():
        name = key.replace("_", "-")
        matches = [k for k in result if k.lower() == name.lower()]
        for match in matches:
            del result[match]
        if value is not None:
            result[name] = value
    return result


def tamper(body: bytes) -> bytes:
    """The body with one byte changed: a commit id digit of ``after``."""
    index = body.index(AFTER.encode())
    return body[:index] + b"1" + body[index + 1 :]


# --- valid pushes ---------------------------------------------------------------------------------

GITHUB_BODY = encode(github_push())
GITEA_BODY = encode(gitea_push())
GITLAB_BODY = encode(gitlab_push())

GITHUB_EVENT = PushEvent(
    provider="github",
    repository="https://github.com/acme/fleet.git",
    full_name="acme/fleet",
    ref="refs/heads/main",
    after=AFTER,
    deleted=False,
    delivery=GITHUB_DELIVERY,
)
GITEA_EVENT = PushEvent(
    provider="gitea",
    repository="http://gitea.internal:3000/acme/fleet.git",
    full_name="acme/fleet",
    ref="refs/heads/develop",
    after=AFTER,
    deleted=False,
    delivery=GITEA_DELIVERY,
)
GITLAB_EVENT = PushEvent(
    provider="gitlab",
    repository="https://gitlab.example.com/plant/ops/fleet.git",
    full_name="plant/ops/fleet",
    ref="refs/heads/main",
    after=AFTER,
    deleted=False,
    delivery=GITLAB_UUID,
)


def github_case(payload: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    body = encode(payload)
    return body, github_headers(body)


def gitea_case(payload: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    body = encode(payload)
    return body, gitea_headers(body)


def gitlab_case(payload: dict[str, Any], event: str = "Push Hook") -> tuple[bytes, dict[str, str]]:
    return encode(payload), gitlab_headers(event)


SHA256_COMMIT = "a" * 64
DELETED_GITLAB = gitlab_push(after=ZEROS, checkout_sha=None, commits=[], total_commits_count=0)

VALID_PUSHES = [
    pytest.param(*github_case(github_push()), GITHUB_EVENT, id="github-branch-push"),
    pytest.param(
        *github_case(github_push(ref="refs/tags/v1.4.0", created=True, before=ZEROS)),
        dataclasses.replace(GITHUB_EVENT, ref="refs/tags/v1.4.0"),
        id="github-tag-push",
    ),
    pytest.param(
        *github_case(github_push(after=ZEROS, deleted=True, commits=[], head_commit=None)),
        dataclasses.replace(GITHUB_EVENT, after=ZEROS, deleted=True),
        id="github-branch-deleted",
    ),
    pytest.param(
        *github_case(github_push(after=AFTER.upper())),
        GITHUB_EVENT,
        id="github-upper-case-commit-id-normalised",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(github_headers(GITHUB_BODY), X_GitHub_Delivery=None),
        dataclasses.replace(GITHUB_EVENT, delivery=None),
        id="github-without-delivery-header",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(github_headers(GITHUB_BODY), X_Hub_Signature=None),
        GITHUB_EVENT,
        id="github-sha256-only-without-legacy-sha1",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(
            github_headers(GITHUB_BODY),
            X_Hub_Signature_256="sha256=" + hmac_hex(GITHUB_BODY).upper(),
        ),
        GITHUB_EVENT,
        id="github-upper-case-hex-signature",
    ),
    pytest.param(
        *gitea_case(gitea_push()), GITEA_EVENT, id="gitea-push-with-github-compat-headers"
    ),
    pytest.param(
        GITEA_BODY,
        {
            "X-Gitea-Event": "push",
            "X-Gitea-Delivery": GITEA_DELIVERY,
            "X-Gitea-Signature": hmac_hex(GITEA_BODY),
        },
        GITEA_EVENT,
        id="gitea-push-gitea-headers-only",
    ),
    pytest.param(
        GITEA_BODY,
        forgejo_headers(GITEA_BODY),
        GITEA_EVENT,
        id="forgejo-push-both-signatures",
    ),
    pytest.param(
        GITEA_BODY,
        {
            "X-Forgejo-Event": "push",
            "X-Forgejo-Delivery": GITEA_DELIVERY,
            "X-Forgejo-Signature": hmac_hex(GITEA_BODY),
        },
        GITEA_EVENT,
        id="forgejo-push-forgejo-headers-only",
    ),
    pytest.param(
        *gitea_case(gitea_push(after=ZEROS, commits=[])),
        dataclasses.replace(GITEA_EVENT, after=ZEROS, deleted=True),
        id="gitea-branch-deleted-derived-from-zero-after",
    ),
    pytest.param(
        *gitea_case(gitea_push(ref="refs/tags/v2.0", before=ZEROS)),
        dataclasses.replace(GITEA_EVENT, ref="refs/tags/v2.0"),
        id="gitea-tag-push",
    ),
    pytest.param(
        *gitea_case(gitea_push(after=SHA256_COMMIT)),
        dataclasses.replace(GITEA_EVENT, after=SHA256_COMMIT),
        id="gitea-sha256-object-format-commit",
    ),
    pytest.param(*gitlab_case(gitlab_push()), GITLAB_EVENT, id="gitlab-push"),
    pytest.param(
        *gitlab_case(gitlab_tag_push(), "Tag Push Hook"),
        dataclasses.replace(GITLAB_EVENT, ref="refs/tags/v1.4.0"),
        id="gitlab-tag-push",
    ),
    pytest.param(
        *gitlab_case(DELETED_GITLAB),
        dataclasses.replace(GITLAB_EVENT, after=ZEROS, deleted=True),
        id="gitlab-branch-deleted",
    ),
    pytest.param(
        *gitlab_case(gitlab_tag_push(after=ZEROS, checkout_sha=None), "Tag Push Hook"),
        dataclasses.replace(GITLAB_EVENT, ref="refs/tags/v1.4.0", after=ZEROS, deleted=True),
        id="gitlab-tag-deleted",
    ),
    pytest.param(
        *gitlab_case(without(gitlab_push(), "after")),
        GITLAB_EVENT,
        id="gitlab-after-missing-uses-checkout_sha",
    ),
    pytest.param(
        *gitlab_case(without(gitlab_push(), "project.git_http_url")),
        GITLAB_EVENT,
        id="gitlab-url-from-repository-git_http_url",
    ),
    pytest.param(
        GITLAB_BODY,
        replaced(gitlab_headers(), X_Gitlab_Event_UUID=None),
        dataclasses.replace(GITLAB_EVENT, delivery=None),
        id="gitlab-without-event-uuid",
    ),
]


@pytest.mark.parametrize(("body", "headers", "expected"), VALID_PUSHES)
def test_valid_push_is_accepted(body: bytes, headers: dict[str, str], expected: PushEvent) -> None:
    assert verify_push(body, headers, SECRET) == expected


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        pytest.param(*github_case(github_push()), id="github"),
        pytest.param(*gitea_case(gitea_push()), id="gitea"),
        pytest.param(*gitlab_case(gitlab_push()), id="gitlab"),
    ],
)
def test_secret_may_be_bytes(body: bytes, headers: dict[str, str]) -> None:
    event = verify_push(body, headers, SECRET.encode())
    assert event is not None
    assert event.after == AFTER


def test_non_ascii_secret_is_utf8() -> None:
    secret = "fleet-ключ-🔑"
    body = GITEA_BODY
    assert verify_push(body, gitea_headers(body, secret=secret), secret) == GITEA_EVENT
    assert verify_push(body, gitea_headers(body, secret=secret), secret.encode()) == GITEA_EVENT


# --- authenticated events that are not pushes --------------------------------------------------

PING_BODY = encode(github_ping())


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        pytest.param(PING_BODY, github_headers(PING_BODY, "ping"), id="github-ping"),
        pytest.param(
            b'{"action": "opened"}',
            github_headers(b'{"action": "opened"}', "issues"),
            id="github-issues-event",
        ),
        pytest.param(b"{}", gitea_headers(b"{}", "create"), id="gitea-create-event"),
        pytest.param(b"{}", forgejo_headers(b"{}", "release"), id="forgejo-release-event"),
        pytest.param(
            b'{"object_kind": "merge_request"}',
            gitlab_headers("Merge Request Hook"),
            id="gitlab-merge-request-hook",
        ),
        pytest.param(
            b"not even json", github_headers(b"not even json", "ping"), id="ping-unparsed"
        ),
    ],
)
def test_non_push_event_returns_none(body: bytes, headers: dict[str, str]) -> None:
    assert verify_push(body, headers, SECRET) is None


# --- refused requests ----------------------------------------------------------------------------

GH_HEADERS = github_headers(GITHUB_BODY)
GITEA_HEADERS = gitea_headers(GITEA_BODY)
GOOD_GH_HEX = hmac_hex(GITHUB_BODY)
NOT_JSON = b"payload=%7B%22ref%22%3A%22refs%2Fheads%2Fmain%22%7D"


def signed_github(body: bytes) -> tuple[bytes, dict[str, str]]:
    return body, github_headers(body)


REJECTED = [
    # authentication: 401
    pytest.param(
        GITHUB_BODY,
        github_headers(GITHUB_BODY, secret=WRONG_SECRET),
        401,
        "does not match",
        id="github-wrong-secret",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(GH_HEADERS, X_Hub_Signature_256=None, X_Hub_Signature=None),
        401,
        "missing X-Hub-Signature-256",
        id="github-no-signature-at-all",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(GH_HEADERS, X_Hub_Signature_256=None),
        401,
        "SHA-1",
        id="github-sha1-only-signature",
    ),
    pytest.param(tamper(GITHUB_BODY), GH_HEADERS, 401, "does not match", id="github-tampered-body"),
    pytest.param(
        GITHUB_BODY,
        replaced(GH_HEADERS, X_Hub_Signature_256=GOOD_GH_HEX),
        401,
        "sha256=",
        id="github-sha256-prefix-missing",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(GH_HEADERS, X_Hub_Signature_256="sha1=" + hmac_hex(GITHUB_BODY, digest="sha1")),
        401,
        "sha256=",
        id="github-sha1-value-in-sha256-header",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(GH_HEADERS, X_Hub_Signature_256="sha256=" + "zz" * 32),
        401,
        "hex",
        id="github-non-hex-signature",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(GH_HEADERS, X_Hub_Signature_256="sha256=" + GOOD_GH_HEX[:-2]),
        401,
        "hex",
        id="github-truncated-signature",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(
            GH_HEADERS, X_Hub_Signature_256="sha256=" + GOOD_GH_HEX[:32] + " " + GOOD_GH_HEX[32:]
        ),
        401,
        "hex",
        id="github-signature-with-inner-space",
    ),
    pytest.param(
        PING_BODY,
        github_headers(PING_BODY, "ping", secret=WRONG_SECRET),
        401,
        "does not match",
        id="github-ping-wrong-secret",
    ),
    pytest.param(
        GITEA_BODY,
        gitea_headers(GITEA_BODY, secret=WRONG_SECRET),
        401,
        "X-Gitea-Signature does not match",
        id="gitea-wrong-secret",
    ),
    pytest.param(
        tamper(GITEA_BODY), GITEA_HEADERS, 401, "does not match", id="gitea-tampered-body"
    ),
    pytest.param(
        GITEA_BODY,
        replaced(GITEA_HEADERS, X_Gitea_Signature=None),
        401,
        "missing X-Gitea-Signature",
        id="gitea-github-compat-signature-does-not-count",
    ),
    pytest.param(
        GITEA_BODY,
        replaced(GITEA_HEADERS, X_Gitea_Signature="sha256=" + hmac_hex(GITEA_BODY)),
        401,
        "hex",
        id="gitea-signature-must-be-bare-hex",
    ),
    pytest.param(
        GITEA_BODY,
        replaced(forgejo_headers(GITEA_BODY), X_Forgejo_Signature=hmac_hex(b"{}")),
        401,
        "X-Forgejo-Signature does not match",
        id="forgejo-one-of-two-signatures-wrong",
    ),
    pytest.param(
        GITLAB_BODY,
        gitlab_headers(token=WRONG_SECRET),
        401,
        "X-Gitlab-Token",
        id="gitlab-wrong-token",
    ),
    pytest.param(
        GITLAB_BODY,
        gitlab_headers(token=SECRET + "x"),
        401,
        "X-Gitlab-Token",
        id="gitlab-token-with-extra-character",
    ),
    pytest.param(
        GITLAB_BODY,
        replaced(gitlab_headers(), X_Gitlab_Token=None),
        401,
        "missing X-Gitlab-Token",
        id="gitlab-missing-token",
    ),
    pytest.param(
        GITLAB_BODY,
        gitlab_headers(token=""),
        401,
        "missing X-Gitlab-Token",
        id="gitlab-empty-token",
    ),
    pytest.param(
        GITLAB_BODY,
        replaced(gitlab_headers(), X_Gitlab_Token=hmac_hex(GITLAB_BODY)),
        401,
        "X-Gitlab-Token",
        id="gitlab-hmac-is-not-the-token",
    ),
    # unknown or ambiguous provider: 400, nothing to verify against
    pytest.param(
        GITHUB_BODY,
        {"X-Event-Key": "repo:push", "X-Hub-Signature": "sha256=" + GOOD_GH_HEX},
        400,
        "unknown webhook provider",
        id="unknown-provider-bitbucket",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(GH_HEADERS, X_GitHub_Event=None),
        400,
        "unknown webhook provider",
        id="github-signature-without-event-header",
    ),
    pytest.param(
        GITHUB_BODY,
        replaced(GH_HEADERS, X_GitHub_Event=""),
        400,
        "unknown webhook provider",
        id="empty-event-header",
    ),
    pytest.param(GITHUB_BODY, {}, 400, "unknown webhook provider", id="no-headers"),
    pytest.param(
        GITLAB_BODY,
        gitlab_headers() | {"X-GitHub-Event": "push"},
        400,
        "ambiguous",
        id="github-and-gitlab-headers",
    ),
    # malformed after a valid signature: 400
    pytest.param(*signed_github(NOT_JSON), 400, "application/json", id="form-encoded-body"),
    pytest.param(*signed_github(b'{"ref": "refs/heads/main",'), 400, "JSON", id="truncated-json"),
    pytest.param(*signed_github(b""), 400, "JSON", id="empty-body"),
    pytest.param(*signed_github(b"\xff\xfe{}"), 400, "UTF-8", id="not-utf8"),
    pytest.param(*signed_github(b"[" * 100_000), 400, "JSON", id="absurdly-nested-json"),
    pytest.param(*signed_github(b'["refs/heads/main"]'), 400, "not an object", id="json-array"),
    pytest.param(*signed_github(b'"push"'), 400, "not an object", id="json-string"),
    pytest.param(
        *signed_github(encode(without(github_push(), "ref"))), 400, "'ref'", id="ref-missing"
    ),
    pytest.param(
        *signed_github(encode(github_push(ref="main"))), 400, "'ref'", id="ref-not-fully-qualified"
    ),
    pytest.param(
        *signed_github(encode(github_push(ref="refs/heads/a..b"))),
        400,
        "'ref'",
        id="ref-with-double-dot",
    ),
    pytest.param(
        *signed_github(encode(github_push(ref="refs/heads/x\nmain"))),
        400,
        "'ref'",
        id="ref-with-newline",
    ),
    pytest.param(
        *signed_github(encode(without(github_push(), "after"))), 400, "'after'", id="after-missing"
    ),
    pytest.param(
        *signed_github(encode(github_push(after=AFTER[:7]))), 400, "'after'", id="after-short-sha"
    ),
    pytest.param(
        *signed_github(encode(github_push(after="g" * 40))), 400, "'after'", id="after-not-hex"
    ),
    pytest.param(
        *signed_github(encode(github_push(after=int(AFTER[:8], 16)))),
        400,
        "'after'",
        id="after-not-a-string",
    ),
    pytest.param(
        *signed_github(encode(github_push(deleted="false"))),
        400,
        "boolean",
        id="deleted-not-a-boolean",
    ),
    pytest.param(
        *signed_github(encode(github_push(deleted=True))),
        400,
        "disagrees",
        id="deleted-true-but-after-is-a-commit",
    ),
    pytest.param(
        *signed_github(encode(without(github_push(), "repository"))),
        400,
        "repository.clone_url",
        id="repository-missing",
    ),
    pytest.param(
        *signed_github(encode(github_push(repository="acme/fleet"))),
        400,
        "'repository' is not an object",
        id="repository-not-an-object",
    ),
    pytest.param(
        *signed_github(encode(without(github_push(), "repository.clone_url"))),
        400,
        "repository.clone_url",
        id="clone-url-missing",
    ),
    pytest.param(
        *signed_github(
            encode(github_push(repository={"full_name": "a/b", "clone_url": "--upload-pack=x"}))
        ),
        400,
        "repository.clone_url",
        id="clone-url-that-git-would-read-as-an-option",
    ),
    pytest.param(
        *signed_github(encode(without(github_push(), "repository.full_name"))),
        400,
        "repository.full_name",
        id="full-name-missing",
    ),
    pytest.param(
        *gitea_case(without(gitea_push(), "repository.clone_url")),
        400,
        "repository.clone_url",
        id="gitea-clone-url-missing",
    ),
    pytest.param(
        GITEA_BODY,
        replaced(forgejo_headers(GITEA_BODY), X_Forgejo_Event="create"),
        400,
        "disagree",
        id="forgejo-and-gitea-event-headers-disagree",
    ),
    pytest.param(
        *gitlab_case(without(gitlab_push(), "project")),
        400,
        "project.path_with_namespace",
        id="gitlab-project-missing",
    ),
    pytest.param(
        *gitlab_case(without(without(gitlab_push(), "after"), "checkout_sha")),
        400,
        "'checkout_sha'",
        id="gitlab-no-commit-id",
    ),
    pytest.param(
        *gitlab_case(
            without(without(gitlab_push(), "project.git_http_url"), "repository.git_http_url")
        ),
        400,
        "git_http_url",
        id="gitlab-no-http-url",
    ),
    pytest.param(
        *gitlab_case(gitlab_push(), "Tag Push Hook"),
        400,
        "object_kind",
        id="gitlab-tag-hook-with-push-payload",
    ),
    pytest.param(
        *gitlab_case(gitlab_tag_push(object_kind=None, ref="refs/heads/main"), "Tag Push Hook"),
        400,
        "refs/tags/",
        id="gitlab-tag-hook-for-a-branch",
    ),
    pytest.param(*gitlab_case([gitlab_push()]), 400, "not an object", id="gitlab-json-array"),
]


@pytest.mark.parametrize(("body", "headers", "status", "message"), REJECTED)
def test_bad_request_is_refused(
    body: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    with pytest.raises(WebhookError) as caught:
        verify_push(body, headers, SECRET)
    assert caught.value.status == status
    assert message in str(caught.value)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(("body", "headers", "status", "message"), REJECTED)
def test_error_messages_never_echo_secrets(
    body: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    with pytest.raises(WebhookError) as caught:
        verify_push(body, headers, SECRET)
    text = str(caught.value)
    assert SECRET not in text
    assert WRONG_SECRET not in text
    for name, value in headers.items():
        if value and any(
            word in name.lower() for word in ("signature", "token", "delivery", "uuid")
        ):
            assert value not in text
    assert text.isprintable()


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        pytest.param(b"{not json", github_headers(b"{not json", secret=WRONG_SECRET), id="github"),
        pytest.param(b"{not json", gitea_headers(b"{not json", secret=WRONG_SECRET), id="gitea"),
        pytest.param(b"{not json", gitlab_headers(token=WRONG_SECRET), id="gitlab"),
        pytest.param(
            b"{not json",
            replaced(github_headers(b"{not json"), X_Hub_Signature_256=None),
            id="github-sha1-only",
        ),
    ],
)
def test_signature_is_checked_before_the_body_is_parsed(
    body: bytes, headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Malformed JSON with a bad signature is a 401, and json is never even called."""

    def forbidden(*args: object, **kwargs: object) -> object:
        raise AssertionError("body parsed before authentication")

    monkeypatch.setattr(webhooks.jsonstrict, "loads", forbidden)
    with pytest.raises(WebhookError) as caught:
        verify_push(body, headers, SECRET)
    assert caught.value.status == 401


# --- header names in any case ------------------------------------------------------------------


def _alternating(name: str) -> str:
    return "".join(c.upper() if i % 2 else c.lower() for i, c in enumerate(name))


CASINGS = [
    pytest.param(str.lower, id="lower"),
    pytest.param(str.upper, id="upper"),
    pytest.param(str.title, id="title"),
    pytest.param(_alternating, id="alternating"),
]
PROVIDER_REQUESTS = [
    pytest.param(GITHUB_BODY, GH_HEADERS, GITHUB_EVENT, id="github"),
    pytest.param(GITEA_BODY, GITEA_HEADERS, GITEA_EVENT, id="gitea"),
    pytest.param(GITEA_BODY, forgejo_headers(GITEA_BODY), GITEA_EVENT, id="forgejo"),
    pytest.param(GITLAB_BODY, gitlab_headers(), GITLAB_EVENT, id="gitlab"),
]


@pytest.mark.parametrize("casing", CASINGS)
@pytest.mark.parametrize(("body", "headers", "expected"), PROVIDER_REQUESTS)
def test_header_names_in_any_case(
    body: bytes, headers: dict[str, str], expected: PushEvent, casing: Any
) -> None:
    recased = {casing(name): value for name, value in headers.items()}
    assert verify_push(body, recased, SECRET) == expected


@pytest.mark.parametrize("casing", CASINGS)
def test_rejections_do_not_depend_on_header_case(casing: Any) -> None:
    headers = {casing(k): v for k, v in replaced(GH_HEADERS, X_Hub_Signature_256=None).items()}
    with pytest.raises(WebhookError, match="SHA-1") as caught:
        verify_push(GITHUB_BODY, headers, SECRET)
    assert caught.value.status == 401


@pytest.mark.parametrize(("body", "headers", "expected"), PROVIDER_REQUESTS)
def test_http_message_headers_from_http_server(
    body: bytes, headers: dict[str, str], expected: PushEvent
) -> None:
    """``BaseHTTPRequestHandler.headers`` (an ``http.client.HTTPMessage``) works as is."""
    raw = "".join(f"{name.lower()}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    message = parse_headers(io.BytesIO(raw.encode("latin-1")))
    assert verify_push(body, message, SECRET) == expected  # type: ignore[arg-type]


def test_header_values_are_trimmed() -> None:
    headers = {name: f" {value}\t" for name, value in GH_HEADERS.items()}
    assert verify_push(GITHUB_BODY, headers, SECRET) == GITHUB_EVENT


class _MultiHeaders(dict[str, str]):
    """A mapping whose ``items()`` repeats a header, like multi-valued header containers."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        super().__init__(pairs)
        self._pairs = pairs

    def items(self) -> Any:
        return list(self._pairs)


@pytest.mark.parametrize(
    ("name", "status"),
    [
        pytest.param("x-hub-signature-256", 401, id="signature"),
        pytest.param("X-GitHub-Delivery", 400, id="delivery"),
    ],
)
def test_conflicting_duplicate_header_is_refused(name: str, status: int) -> None:
    pairs = [*GH_HEADERS.items(), (name, "sha256=" + "0" * 64)]
    with pytest.raises(WebhookError, match="more than once") as caught:
        verify_push(GITHUB_BODY, _MultiHeaders(pairs), SECRET)
    assert caught.value.status == status


def test_identical_duplicate_header_is_fine() -> None:
    pairs = [*GH_HEADERS.items(), ("x-hub-signature-256", GH_HEADERS["X-Hub-Signature-256"])]
    assert verify_push(GITHUB_BODY, _MultiHeaders(pairs), SECRET) == GITHUB_EVENT


# --- body size ---------------------------------------------------------------------------------


def test_body_over_25_mib_is_refused_before_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MAX_BODY_BYTES == 25 * 1024 * 1024
    body = GITHUB_BODY + b" " * (MAX_BODY_BYTES + 1 - len(GITHUB_BODY))

    def forbidden(*args: object, **kwargs: object) -> object:
        raise AssertionError("oversized body hashed")

    monkeypatch.setattr(webhooks.hmac, "new", forbidden)
    with pytest.raises(WebhookError, match="limit") as caught:
        verify_push(body, GH_HEADERS, SECRET)
    assert caught.value.status == 400


def test_body_of_exactly_25_mib_is_accepted() -> None:
    body = GITHUB_BODY + b" " * (MAX_BODY_BYTES - len(GITHUB_BODY))
    assert len(body) == MAX_BODY_BYTES
    assert verify_push(body, github_headers(body), SECRET) == GITHUB_EVENT


# --- configuration and API errors ----------------------------------------------------------------


@pytest.mark.parametrize("secret", [pytest.param("", id="str"), pytest.param(b"", id="bytes")])
@pytest.mark.parametrize(
    ("body", "headers"),
    [
        pytest.param(GITHUB_BODY, GH_HEADERS, id="valid-github-request"),
        pytest.param(GITLAB_BODY, gitlab_headers(token=""), id="gitlab-empty-token"),
        pytest.param(b"", {}, id="unknown-provider"),
    ],
)
def test_empty_secret_is_a_configuration_error(
    secret: str | bytes, body: bytes, headers: dict[str, str]
) -> None:
    with pytest.raises(ValueError, match="secret is empty") as caught:
        verify_push(body, headers, secret)
    assert type(caught.value) is ValueError  # not a WebhookError: no HTTP status to answer with


@pytest.mark.parametrize(
    ("body", "secret"),
    [
        pytest.param(GITHUB_BODY.decode(), SECRET, id="body-as-str"),
        pytest.param(GITHUB_BODY, None, id="secret-none"),
    ],
)
def test_wrong_argument_types(body: Any, secret: Any) -> None:
    with pytest.raises(TypeError):
        verify_push(body, GH_HEADERS, secret)


def test_webhook_error_carries_status() -> None:
    error = WebhookError("bad signature", 401)
    assert isinstance(error, ValueError)
    assert error.status == 401
    assert WebhookError("malformed").status == 400
    with pytest.raises(ValueError, match="400 or 401"):
        WebhookError("teapot", 418)


def test_push_event_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        GITHUB_EVENT.ref = "refs/heads/evil"  # type: ignore[misc]
    assert not hasattr(GITHUB_EVENT, "__dict__")  # slots


# --- before the body: check_headers ----------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "status", "message"),
    [
        pytest.param({"X-GitHub-Event": "push"}, 401, "missing X-Hub-Signature-256",
                     id="github-unsigned"),
        pytest.param({"X-GitHub-Event": "push", "X-Hub-Signature": "sha1=" + "0" * 40}, 401,
                     "SHA-1", id="github-sha1-only"),
        pytest.param({"X-GitHub-Event": "push", "X-Hub-Signature-256": "md5=00"}, 401,
                     "sha256=<64 hex digits>", id="github-malformed"),
        pytest.param({"X-Gitea-Event": "push"}, 401, "missing X-Gitea-Signature",
                     id="gitea-unsigned"),
        pytest.param({"X-Gitea-Event": "push", "X-Gitea-Signature": "zz"}, 401,
                     "not a hex HMAC-SHA256", id="gitea-malformed"),
        pytest.param(gitlab_headers(token=WRONG_SECRET), 401, "does not match",
                     id="gitlab-wrong-token"),
        pytest.param({"X-Gitlab-Event": "Push Hook"}, 401, "missing X-Gitlab-Token",
                     id="gitlab-without-token"),
        pytest.param({}, 400, "unknown webhook provider", id="no-provider"),
    ],
)
def test_what_the_headers_show_is_refused_before_the_body(
    headers: dict[str, str], status: int, message: str
) -> None:
    """The server calls check_headers before it reads (up to 25 MiB of) the body."""
    with pytest.raises(WebhookError) as caught:
        webhooks.check_headers(headers, SECRET)
    assert caught.value.status == status
    assert message in str(caught.value)


@pytest.mark.parametrize(("body", "headers", "expected"), VALID_PUSHES)
def test_the_headers_of_every_authentic_push_pass(
    body: bytes, headers: dict[str, str], expected: PushEvent
) -> None:
    webhooks.check_headers(headers, SECRET)


def test_a_forged_but_well_formed_signature_passes_the_headers_not_the_body() -> None:
    """GitHub's and Gitea's HMAC covers the body: the headers cannot tell a forgery."""
    headers = github_headers(GITHUB_BODY, secret=WRONG_SECRET)
    webhooks.check_headers(headers, SECRET)
    with pytest.raises(WebhookError) as caught:
        verify_push(GITHUB_BODY, headers, SECRET)
    assert caught.value.status == 401


def test_an_empty_secret_is_a_configuration_error_before_the_body() -> None:
    with pytest.raises(ValueError, match="secret is empty") as caught:
        webhooks.check_headers(GH_HEADERS, "")
    assert type(caught.value) is ValueError
