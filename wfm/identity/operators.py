"""Who the people and tools calling the fleet API are, and what their role lets them do.

Three roles, each including the one below it: a `viewer` reads (the read API, the
dashboard, metrics); an `operator` changes what the fleet does (rollout pause, resume and
abort, pushes to the hosted source, webhook secrets); an `admin` changes who may do what
(device clients, trust bundles, operators). Every door that changes something asks
`OperatorAuth.require` for the role it needs: no credential (or a bad one) is a 401,
a credential below the role a 403, both as problem documents.

Credentials come from three places, tried in this order: the `--admin-token` file (the
first admin, as before roles existed), operator tokens registered in the store
(`margo operators`; only their hashes are stored) and, when the admin configured an
issuer, OIDC bearer tokens whose role comes from a claim. A server with none of them
configured is open, as it always was: every caller is an anonymous admin, and the audit
trail says so. Once an operator was registered in the store (revoked ones count), the server
is closed for good: revoking the last operator must not open it.

An OIDC token whose claim maps to no role proves who its holder is, not what they may do:
such a caller has `Role.NONE` and is refused (403) everywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from wfm.identity.credentials import same_secret
from wfm.problems import ProblemError

__all__ = ["ANONYMOUS", "Operator", "OperatorAuth", "Role", "TokenLookup", "bearer_token",
           "caller_address", "refusal"]

REALM = 'Bearer realm="margo-gitops"'


class Role(enum.IntEnum):
    """Ordered: a role may do everything the roles below it may. `NONE` is a known caller
    with no role here (an OIDC token whose claim maps to none); it is never registered."""

    NONE = 0
    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Role:
        """The role named `text` (viewer, operator, admin); ValueError naming the choices."""
        role = cls.__members__.get(text.strip().upper())
        if role is None or role is cls.NONE:
            raise ValueError(f"unknown role {text!r}: choose viewer, operator or admin")
        return role


@dataclass(frozen=True, slots=True)
class Operator:
    """A caller the server recognised. `name` is what the audit trail records (an operator's
    registered name, `oidc:<issuer subject>`, `admin-token` or `anonymous`); `via` says which
    credential proved it (token, oidc, admin-token, open)."""

    name: str
    role: Role
    via: str

    def may(self, role: Role) -> bool:
        return self.role >= role


#: Every caller of a server that has no credentials configured.
ANONYMOUS = Operator("anonymous", Role.ADMIN, "open")

#: Finds the operator a presented bearer token belongs to (None: not one of ours).
TokenLookup = Callable[[str], "Operator | None"]


def bearer_token(request: Request) -> str | None:
    """The bearer token of the Authorization header, if it carries one."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    token = value.strip()
    return token if scheme.lower() == "bearer" and token else None


def caller_address(request: Request) -> str | None:
    """The address the request came from, as the audit trail records it (behind a proxy,
    the proxy's)."""
    return request.client.host if request.client is not None else None


class OperatorAuth:
    """Authenticates operators and enforces roles, for every door of the server."""

    def __init__(self, *, admin_token: str | None = None,
                 lookups: tuple[TokenLookup, ...] = (),
                 configured: bool | Callable[[], bool] | None = None):
        """`lookups`: the store's operator tokens, the OIDC verifier... tried in order after
        the admin token. `configured`: whether any credential exists at all, or a function
        that says it now (the store's operators come and go while the server runs); None:
        whether an admin token or a lookup was given. An unconfigured server is open."""
        self.admin_token = admin_token
        self.lookups = lookups
        self._configured = (admin_token is not None or bool(lookups)
                            if configured is None else configured)

    @property
    def configured(self) -> bool:
        configured = self._configured
        return configured() if callable(configured) else configured

    @property
    def open(self) -> bool:
        return not self.configured

    def authenticate(self, token: str | None) -> Operator | None:
        """The operator `token` proves, or None (also for an open server: the caller of
        `require` decides what an open server allows)."""
        if not token:
            return None
        if self.admin_token is not None and same_secret(token, self.admin_token):
            return Operator("admin-token", Role.ADMIN, "admin-token")
        for lookup in self.lookups:
            found = lookup(token)
            if found is not None:
                return found
        return None

    def caller(self, request: Request) -> Operator:
        """Who the request's bearer token proves, whatever its role (`ANONYMOUS` on an open
        server); else a 401 problem (no credential, or one that is not valid)."""
        if self.open:
            return ANONYMOUS
        token = bearer_token(request)
        caller = self.authenticate(token)
        if caller is None:
            detail = ("the operator token is required" if token is None
                      else "that operator credential is not valid")
            raise ProblemError(401, detail, headers={"WWW-Authenticate": REALM})
        return caller

    def require(self, request: Request, role: Role) -> Operator:
        """The caller, when it may act as `role`; else a 401 (no or unknown credential) or
        403 (known, below `role`) problem."""
        caller = self.caller(request)
        if not caller.may(role):
            raise refusal(caller, role)
        return caller


def refusal(caller: Operator, role: Role, doing: str = "this") -> ProblemError:
    """The 403 problem for a known caller below `role`: it names the role needed."""
    held = ("has no role on this server" if caller.role is Role.NONE
            else f"is a {caller.role.label}")
    return ProblemError(403, f"{caller.name} {held}; {doing} needs the {role.label} role")
