"""The dashboard's roles and rollout actions over real HTTP: a running `margo serve` with a
staged rollout in progress (`kits.rolloutkit`) and operators of each role registered in its
store. A viewer sees the rollout without buttons and is refused a post; an operator pauses,
resumes and aborts from the page's forms, which carry the session's CSRF token and are
refused without it, with another's, or from another site; a sign-in stops working when its
token is rotated or revoked. `test_dashboard_actions_replicas.py` runs the same on two
replicas behind a round-robin balancer, where a session opened on one replica is used on
the other."""

from __future__ import annotations

import contextlib
import html
import re
from collections.abc import Callable, Iterator

import httpx
import pytest
from kits.rolloutkit import ADMIN_TOKEN, INTENT, RolloutServer, rollout_server
from kits.serverkit import REPLICAS

from tools.polling import poll_until
from wfm.http.sessions import COOKIE_NAME, SessionKeys, cross_site

OPERATORS = {"olivia": "operator", "victor": "viewer", "rita": "operator"}
#: One server for the module under `--dist loadgroup`: its tests follow one rollout (each
#: still holds alone on a server of its own: a worker runs its share in the module's order).
pytestmark = pytest.mark.xdist_group("dashboard-actions")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutServer]:
    with rollout_server(tmp_path_factory.mktemp("dashboard-actions"), OPERATORS) as running:
        yield running


@contextlib.contextmanager
def signed_in(server: RolloutServer, name: str) -> Iterator[httpx.Client]:
    """A browser-like client signed in through `?token=` (it keeps the cookie)."""
    with httpx.Client(base_url=server.base, timeout=10) as client:
        response = client.get("/", params={"token": server.tokens[name]})
        assert response.status_code == 200, response.text
        assert client.cookies.get(COOKIE_NAME), response.headers
        yield client


def text(page: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def actions(page: str) -> list[str]:
    return re.findall(r'data-action="(\w+)"', page)


def csrf_of(page: str) -> str:
    tokens = set(re.findall(r'name="csrf" value="([^"]+)"', page))
    assert len(tokens) == 1, tokens  # one per session, whatever the form
    return tokens.pop()


def status_of(page: str) -> str:
    found = re.search(rf'data-rollout="{INTENT}".*?data-testid="rollout-status">([^<]+)<',
                      page, re.S)
    assert found, page
    return str(found[1])


#: What a browser adds to a form it posts from the page itself.
SAME_ORIGIN = {"Sec-Fetch-Site": "same-origin"}


def test_a_viewer_sees_the_rollout_but_no_action_and_is_refused_a_post(
        server: RolloutServer) -> None:
    with signed_in(server, "victor") as viewer:
        page = viewer.get("/").text
        assert status_of(page) == "progressing" and actions(page) == []
        assert "Signed in as victor (viewer)" in text(page) and "Sign out" in text(page)
        refused = viewer.post(f"/rollouts/{INTENT}/pause", data={"csrf": csrf_of(page)},
                              headers=SAME_ORIGIN)
        assert refused.status_code == 403
        assert "victor is a viewer; pause needs the operator role" in text(refused.text)
    assert server.rollout()["status"] == "progressing"


def test_an_operator_pauses_and_resumes_from_the_pages_forms(server: RolloutServer) -> None:
    with signed_in(server, "olivia") as olivia:
        page = olivia.get("/").text
        assert "Signed in as olivia (operator)" in text(page)
        assert actions(page) == ["pause", "abort"]  # only what applies while progressing
        paused = olivia.post(f"/rollouts/{INTENT}/pause", data={"csrf": csrf_of(page)},
                             headers=SAME_ORIGIN)
        assert paused.status_code == 303, paused.text
        assert paused.headers["location"] == f"/#rollout-{INTENT}"
        assert server.rollout()["status"] == "paused"
        page = olivia.get(paused.headers["location"]).text
        assert status_of(page) == "paused" and actions(page) == ["resume", "abort"]
        resumed = olivia.post(f"/rollouts/{INTENT}/resume", data={"csrf": csrf_of(page)})
        assert resumed.status_code == 303, resumed.text  # a tool's post: no browser headers
        assert server.rollout()["status"] == "progressing"
        again = olivia.post(f"/rollouts/{INTENT}/resume", data={"csrf": csrf_of(page)})
        assert again.status_code == 409 and "resume needs it paused" in text(again.text)
    with server.admin() as admin:
        trail = admin.get("/api/fleet/audit", params={"actor": "olivia"}).json()["entries"]
    assert [(e["action"], e["outcome"], e["via"]) for e in trail
            if e["outcome"] != "refused"] == [
        ("rollout.pause", "ok", "dashboard:token"), ("rollout.resume", "ok", "dashboard:token"),
        ("rollout.resume", "failed", "dashboard:token")]


#: (what is wrong, the form: "own" for the page's token, "victor" for a viewer's, the headers)
REFUSED_FORMS = [
    ("no token", {}, SAME_ORIGIN),
    ("a wrong token", {"csrf": "x" * 43}, SAME_ORIGIN),
    ("another session's token", "victor", SAME_ORIGIN),
    ("another site", "own", {"Sec-Fetch-Site": "cross-site"}),
    ("a sibling site", "own", {"Sec-Fetch-Site": "same-site"}),
    ("another origin", "own", {"Origin": "http://evil.example"}),
    ("an opaque origin", "own", {"Origin": "null"}),
]


@pytest.mark.parametrize(("case", "form", "headers"), REFUSED_FORMS,
                         ids=[case for case, _, _ in REFUSED_FORMS])
def test_a_form_without_the_sessions_token_or_from_elsewhere_is_refused(
        server: RolloutServer, case: str, form: dict[str, str] | str,
        headers: dict[str, str]) -> None:
    with signed_in(server, "olivia") as olivia:
        page = olivia.get("/").text
        if form == "own":
            form = {"csrf": csrf_of(page)}
        elif form == "victor":
            with signed_in(server, "victor") as viewer:
                form = {"csrf": csrf_of(viewer.get("/").text)}
        assert isinstance(form, dict)
        refused = olivia.post(f"/rollouts/{INTENT}/pause", data=form, headers=headers)
        assert refused.status_code == 403, case
        assert "Refused" in text(refused.text)
    assert server.rollout()["status"] == "progressing", case


def test_a_bearer_caller_is_refused_a_form_without_its_token(server: RolloutServer) -> None:
    """A tool with an Authorization header gets pages whose forms carry a token bound to
    its credential; the header alone does not make a post."""
    headers = {"Authorization": f"Bearer {server.tokens['victor']}"}
    page = httpx.get(server.base + "/", headers=headers).text
    assert "Signed in as victor (viewer)" in text(page) and "Sign out" not in text(page)
    with server.admin() as admin:
        assert admin.post(f"/rollouts/{INTENT}/pause").status_code == 403
        assert server.rollout()["status"] == "progressing"


def everywhere(what: str, check: Callable[[], bool]) -> None:
    """Wait until `check` holds on every replica: as many times in a row as there are
    (each replica notices a change to the operators within a second of its own)."""
    poll_until(what, lambda: all(check() for _ in range(REPLICAS)), timeout=10)


def test_a_rotated_or_revoked_token_closes_its_session(server: RolloutServer) -> None:
    with signed_in(server, "rita") as rita:
        page = rita.get("/")
        assert page.status_code == 200 and "Signed in as rita (operator)" in text(page.text)
        server.rotate("rita")
        everywhere("the old token's session closed", lambda: rita.get("/").status_code == 401)
        closed = rita.get("/")
        assert "progressing" not in closed.text and "Operator token needed" in closed.text
    with signed_in(server, "rita") as rita:  # with the new token
        assert rita.get("/").status_code == 200
        server.revoke("rita")
        everywhere("the revoked operator's session closed",
                   lambda: rita.get("/").status_code == 401)
        assert rita.get("/", params={"token": server.tokens["rita"]}).status_code == 401


def test_sign_out_forgets_the_cookie(server: RolloutServer) -> None:
    with signed_in(server, "victor") as viewer:
        page = viewer.get("/").text
        assert viewer.post("/signout", data={}, headers=SAME_ORIGIN).status_code == 403
        out = viewer.post("/signout", data={"csrf": csrf_of(page)}, headers=SAME_ORIGIN)
        assert out.status_code == 200 and "Signed out" in text(out.text)
        assert not viewer.cookies.get(COOKIE_NAME)
        assert viewer.get("/").status_code == 401


def test_an_abort_shows_the_rolled_back_rollout_with_its_live_counts(
        server: RolloutServer) -> None:
    """Last: an abort ends the rollout (a new revision would start another)."""
    with signed_in(server, "olivia") as olivia:
        page = olivia.get("/").text
        aborted = olivia.post(f"/rollouts/{INTENT}/abort", data={"csrf": csrf_of(page)},
                              headers=SAME_ORIGIN, follow_redirects=True)
        assert aborted.status_code == 200 and str(aborted.url).endswith(f"/#rollout-{INTENT}")
    view = server.rollout()
    assert view["status"] == "rolled back" and view["reason"] == "aborted by olivia"
    page = aborted.text
    assert status_of(page) == "rolled back" and actions(page) == []
    assert "aborted by olivia" in text(page)
    for wave in view["waves"]:  # the page's wave rows are the read API's counts
        row = re.search(rf'<th scope="row">{wave["name"]}</th>(.*?)</tr>', page, re.S)
        assert row, wave
        assert re.findall(r'<td class="num">(\d+)</td>', row[1]) == [
            str(wave[k]) for k in ("devices", "moved", "installed", "failed", "stale",
                                   "pending", "held")]
    assert sum(w["moved"] for w in view["waves"]) == 1  # the canary had moved


# --- the pure parts ------------------------------------------------------------------------

def test_sealed_tokens_open_only_with_the_same_secret_and_within_the_lifetime() -> None:
    keys = SessionKeys(b"s" * 32)
    cookie = keys.seal("the-token")
    assert "the-token" not in cookie and keys.seal("the-token") != cookie  # random each time
    assert keys.unseal(cookie) == "the-token"
    assert SessionKeys(b"t" * 32).unseal(cookie) is None
    assert keys.unseal(cookie[:-2] + ("A" if cookie[-2] != "A" else "B") + cookie[-1]) is None
    for junk in ("", "x", "\u00e9\ud800", ADMIN_TOKEN):
        assert keys.unseal(junk) is None
    assert SessionKeys(b"s" * 32, lifetime=-1).unseal(cookie) is None  # too old


def test_csrf_tokens_are_bound_to_the_session_and_secret() -> None:
    keys = SessionKeys(b"s" * 32)
    token = keys.csrf("cookie:a")
    assert keys.csrf_matches("cookie:a", token)
    assert not keys.csrf_matches("cookie:b", token)
    assert not SessionKeys(b"t" * 32).csrf_matches("cookie:a", token)
    assert not keys.csrf_matches("cookie:a", "\u00e9")  # never a crash on what is posted


def test_cross_site_trusts_the_browsers_own_headers() -> None:
    host = {"host": "fleet.example:8080"}
    assert cross_site(host) is None  # a tool: the CSRF token decides
    assert cross_site({**host, "sec-fetch-site": "same-origin"}) is None
    assert cross_site({**host, "sec-fetch-site": "same-origin",
                       "origin": "https://proxy.example"}) is None  # a proxy that rewrote Host
    assert cross_site({**host, "origin": "http://fleet.example:8080"}) is None
    assert cross_site({**host, "origin": "https://FLEET.example:8080"}) is None
    assert cross_site({"host": "10.0.0.5:8080", "x-forwarded-host": "fleet.example",
                       "origin": "https://fleet.example"}) is None
    for refused in ({"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"},
                    {"sec-fetch-site": "none"}, {"origin": "http://fleet.example:8081"},
                    {"origin": "null"}, {"origin": "http://[::1"}):
        assert cross_site({**host, **refused}) is not None, refused

