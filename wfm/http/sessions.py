"""Who is looking at the dashboard, proved again on every request, and the token that proves
a form was posted from the dashboard's own page.

Signing in (`?token=` once) sets a cookie holding the operator's token *sealed* (Fernet:
AES-CBC with an HMAC-SHA256, and the time it was sealed) under a key only the servers hold.
Every request opens it and authenticates the token again through `OperatorAuth`, exactly as
if it had come in an Authorization header: so the cookie says who signed in (name, role),
stops working the moment that operator's token is revoked or rotated (or the admin token
file changes), and expires after `SESSION_SECONDS` whatever the browser does. A leaked
cookie is not a credential for the read API or the Git source: only a server can open it.

Why a sealed token rather than a session table or a server-side mapping: replicas share one
PostgreSQL database but neither memory nor files, and a session opened on one must work on
the next request the balancer sends to another. A sealed cookie needs nothing but the key,
and the key comes from one secret every replica reads from the store (`shared_secret`, made
by the first replica that needs it: the same first-one-wins row the onboarding CA uses), so
signing out, a failover or a new replica changes nothing. The alternative, an HMAC of the
token as before roles, cannot name its operator: the server keeps only hashes of operator
tokens, and an OIDC token is checked against its issuer, not looked up.

Forms (rollout actions, sign-out) carry a synchronizer token: an HMAC, under a second key
derived from the same secret, of what the session is bound to (the cookie's value, or the
bearer token's hash for a tool), checked in constant time. Requests a browser marks as
coming from another site (`Sec-Fetch-Site`) or whose `Origin` is not this host are refused
before that. The cookie stays `SameSite=Strict` and `HttpOnly`. On an open server (no
credentials configured: everyone is an anonymous admin) the pages set an anonymous sealed
cookie, so its forms are bound to a browser too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from starlette.requests import Request

from wfm.identity.operators import ANONYMOUS, Operator, OperatorAuth, Role, bearer_token
from wfm.store import identity_rows
from wfm.store.database import Connection, Database

__all__ = ["COOKIE_NAME", "CSRF_FIELD", "SECRET_NAME", "SESSION_SECONDS", "Session",
           "SessionKeys", "Sessions", "cross_site", "shared_secret"]

COOKIE_NAME = "margo_dashboard"
#: The form field that carries the synchronizer token.
CSRF_FIELD = "csrf"
#: How long a sign-in lasts (the cookie's Max-Age, and the oldest sealed token opened).
SESSION_SECONDS = 12 * 3600
#: The store row (`authority` table) that holds the secret the session keys come from.
SECRET_NAME = "dashboard-sessions"
#: What the audit trail says a dashboard action came through (`Operator.via`).
VIA = "dashboard"


class SessionKeys:
    """The keys of the dashboard's sessions, derived from the secret the replicas share:
    one seals tokens into cookies, the other makes the forms' synchronizer tokens."""

    def __init__(self, secret: bytes, *, lifetime: float = SESSION_SECONDS):
        self._fernet = Fernet(base64.urlsafe_b64encode(_derive(secret, b"seal v1")))
        self._csrf = _derive(secret, b"csrf v1")
        self.lifetime = lifetime

    def seal(self, token: str) -> str:
        """The cookie value for `token` (random each time: two sign-ins, two sessions)."""
        return self._fernet.encrypt(token.encode("utf-8", "surrogatepass")).decode("ascii")

    def unseal(self, cookie: str) -> str | None:
        """The token a cookie we sealed holds, unless it is older than the lifetime; None
        for anything else a browser might send."""
        try:
            data = self._fernet.decrypt(cookie.encode("utf-8", "surrogatepass"),
                                        ttl=int(self.lifetime))
            return data.decode("utf-8", "surrogatepass")
        except (InvalidToken, ValueError, TypeError):
            return None

    def csrf(self, binding: str) -> str:
        """The synchronizer token of a session bound to `binding`."""
        mac = hmac.new(self._csrf, binding.encode("utf-8", "surrogatepass"), hashlib.sha256)
        return base64.urlsafe_b64encode(mac.digest()).decode("ascii").rstrip("=")

    def csrf_matches(self, binding: str, offered: str) -> bool:
        """Whether a posted token is the session's, compared in constant time."""
        return hmac.compare_digest(self.csrf(binding).encode(),
                                   offered.encode("utf-8", "surrogatepass"))


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"margo-gitops dashboard " + purpose).derive(secret)


def _read_secret(conn: Connection) -> str | None:
    return identity_rows.shared_secret(conn, SECRET_NAME)


async def shared_secret(db: Database) -> bytes:
    """The secret every replica derives the session keys from: 32 random bytes the first
    replica that needed them offered to the store (a concurrent second one keeps the
    first's), kept with the other secrets replicas share (`identity_rows.offer_secret`).
    Readable by whoever reads the database, as the CA's key is."""
    found = await db.aread(_read_secret)
    if found is None:
        text = base64.b64encode(secrets.token_bytes(32)).decode("ascii")
        await db.write(lambda conn: identity_rows.offer_secret(conn, SECRET_NAME, text))
        found = await db.aread(_read_secret)
    if found is None:  # the write committed, so the row is there: a broken store
        raise RuntimeError("the dashboard session secret was not stored")
    return base64.b64decode(found)


@dataclass(frozen=True, slots=True)
class Session:
    """Who is looking (`operator`, its `via` saying it came through the dashboard), what
    the page's forms are bound to, and whether the dashboard cookie signed them in (so they
    can sign out). `new_cookie`: an anonymous session to set (an open server's)."""

    operator: Operator
    binding: str
    signed_in: bool
    #: The synchronizer token of this session's forms.
    csrf: str
    new_cookie: str | None = None
    #: The server has no credentials: everyone is an anonymous admin.
    open_server: bool = False

    @property
    def may_act(self) -> bool:
        """Whether the page offers rollout actions (the operator role)."""
        return self.operator.may(Role.OPERATOR)


def cross_site(headers: Mapping[str, str]) -> str | None:
    """Why a form post did not come from this site's own page, as far as the browser tells
    (None: nothing says so). A browser that sends `Sec-Fetch-Site` (every current one) says
    it itself: it must be same-origin. Else an `Origin`, when sent, must name this host as
    the request (`Host`) or a proxy in front (`X-Forwarded-Host`) does, the port included:
    no page can set either header on a form it posts. The scheme is not compared (a proxy
    may end TLS), and a proxy that rewrites `Host` without saying so only matters for
    browsers too old to send `Sec-Fetch-Site`."""
    site = headers.get("sec-fetch-site")
    if site is not None:
        return None if site == "same-origin" else (
            f"the browser says the form came from elsewhere (Sec-Fetch-Site: {site[:40]})")
    origin = headers.get("origin")
    if origin is None:
        return None
    hosts = {headers.get("host", "").lower(),
             headers.get("x-forwarded-host", "").split(",")[0].strip().lower()} - {""}
    try:
        netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
    except ValueError:
        netloc = ""
    if netloc not in hosts:
        return f"the form came from another origin ({origin[:200]})"
    return None


class Sessions:
    """The dashboard's sessions on one server: `auth` authenticates every token (the
    fleet API's own), `db` is the store once the server started."""

    def __init__(self, auth: OperatorAuth, db: Callable[[], Database]):
        self.auth, self._db = auth, db
        self._keys: SessionKeys | None = None

    async def keys(self) -> SessionKeys:
        if self._keys is None:
            self._keys = SessionKeys(await shared_secret(self._db()))
        return self._keys

    async def session(self, request: Request) -> Session | None:
        """The caller of a page or a form: a bearer header, else the cookie; on an open
        server, an anonymous admin. None: not signed in (or no longer: the token behind the
        cookie was revoked, rotated or is too old)."""
        keys = await self.keys()
        token = bearer_token(request)
        if token is not None:
            caller = await self._db().offload(self.auth.authenticate, token)
            if caller is not None:
                binding = "bearer:" + hashlib.sha256(token.encode("utf-8", "surrogatepass")
                                                     ).hexdigest()
                return Session(_through_dashboard(caller), binding, False, keys.csrf(binding))
        cookie = request.cookies.get(COOKIE_NAME, "")
        sealed = keys.unseal(cookie) if cookie else None
        if await self.is_open():
            fresh = keys.seal("") if sealed is None else None
            binding = "cookie:" + (fresh or cookie)
            return Session(_through_dashboard(ANONYMOUS), binding, False, keys.csrf(binding),
                           new_cookie=fresh, open_server=True)
        caller = await self._db().offload(self.auth.authenticate, sealed) if sealed else None
        if caller is None:
            return None
        binding = "cookie:" + cookie
        return Session(_through_dashboard(caller), binding, True, keys.csrf(binding))

    async def is_open(self) -> bool:
        """Whether the server has no credentials (the store's operators may be asked)."""
        return await self._db().offload(lambda: self.auth.open)

    async def sign_in(self, token: str) -> tuple[Operator, str] | None:
        """The operator `token` proves and the cookie that keeps them signed in; None when
        it proves nobody."""
        caller = await self._db().offload(self.auth.authenticate, token)
        if caller is None:
            return None
        return _through_dashboard(caller), (await self.keys()).seal(token)

    async def form_refusal(self, request: Request, session: Session) -> str | None:
        """Why a posted form is refused (another site, a missing or wrong synchronizer
        token); None when it came from this session's own page."""
        elsewhere = cross_site(request.headers)
        if elsewhere is not None:
            return elsewhere
        form = await request.form()
        offered = form.get(CSRF_FIELD)
        if not isinstance(offered, str) or not offered:
            return "the form carries no CSRF token"
        if not (await self.keys()).csrf_matches(session.binding, offered):
            return "the form's CSRF token is not this session's"
        return None


def _through_dashboard(caller: Operator) -> Operator:
    """`caller`, with `via` saying the dashboard carried its credential (the audit trail's
    `via`: `dashboard:token`, `dashboard:admin-token`, `dashboard:open`...)."""
    return replace(caller, via=f"{VIA}:{caller.via}")
