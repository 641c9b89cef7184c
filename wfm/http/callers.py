"""Who is calling the device API, and what the caller may reach.

Every device-API request starts here: `authenticate` finds the client from the first proof
the request presents (`wfm.identity.proofs` has the rules and the policy), `scoped` also checks
that an rc.2 path names the caller's own client id, and `may_fetch` answers Git hosting
whether the caller may read a device's repository.
"""

from __future__ import annotations

from starlette.requests import Request

from wfm.http.device_api import Api
from wfm.http.request_parts import header
from wfm.identity.clients import Client
from wfm.identity.credentials import parse_basic, same_secret
from wfm.identity.proofs import SIGNED_SCOPE_KEY
from wfm.problems import RETIRED, ProblemError
from wfm.store import records

__all__ = ["Admission", "Callers"]

#: What authenticating a request reads of its scope: its headers (tokens, a proxy's
#: Client-Cert), its path parameters (an rc.2 path's clientId), the TLS layer's client
#: certificate, the peer (is it a trusted proxy) and the verified rc.2 signature.
_ADMISSION_KEYS = ("type", "headers", "path_params", "extensions", "client", SIGNED_SCOPE_KEY)


class Callers:
    """Authentication of the device API, for its surfaces and for Git hosting."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def authenticate(self, request: Request) -> Client:
        """The caller, from the first proof it presents: an SVID (rc.3), an rc.2 signature,
        then (when enabled) a token. `wfm.identity.proofs` has the rules and the policy."""
        identity = self.api.identity
        client = identity.svid_caller(request) or identity.signature_caller(request)
        if client is None and identity.settings.bearer_tokens:
            client = await self._token_caller(request)
        if client is None:
            raise ProblemError(401, "valid client credentials are required",
                               headers={"WWW-Authenticate": f"{identity.challenge} "
                                        'realm="margo-gitops"'})
        if client.retired:
            raise _retired()
        return identity.vouch(request, client)  # its body: the device API's budget

    async def _token_caller(self, request: Request) -> Client | None:
        authorization = header(request, b"authorization") or ""
        scheme, _, value = authorization.partition(" ")
        credentials = self.api.credentials
        if scheme.lower() == "bearer" and value.strip():
            return await credentials.client(value.strip())
        if scheme.lower() == "basic":
            pair = parse_basic(authorization)
            if pair is None:
                return None
            client = await credentials.client(pair[1])
            return client if client is not None and same_secret(pair[0],
                                                                client.client_id) else None
        return None

    async def scoped(self, request: Request) -> tuple[Client, str]:
        """The caller and the URL prefix its manifest URLs use (rc.2 paths carry the id)."""
        client = await self.authenticate(request)
        path_client = request.path_params.get("clientId")
        if path_client is None:
            return client, "/api/v1"
        if path_client != client.client_id:
            raise ProblemError(403, "a client may only use its own clientId",
                               margo_type="not-authorized")
        return client, f"/api/v1/clients/{client.client_id}"

    def admission(self, request: Request, client: Client) -> Admission:
        """For a request that waits a while after it was authenticated (a held poll):
        whether its caller is still admitted, asked at each wake (`Admission`)."""
        return Admission(self, request, client)

    async def readmit(self, request: Request, client: Client) -> None:
        """`request`'s caller once more, after credentials changed since it was `client`:
        the refusal a request arriving now would get, raised. An rc.2 request's signature
        was verified once, with the client's row as it was then, so the row is read
        afresh."""
        again, _ = await self.scoped(request)
        row = await self.api.db.offload(self.api.clients.get, again.client_id)
        if again.client_id != client.client_id or row is None or row.retired:
            raise _retired()

    async def may_fetch(self, request: Request, device_id: str) -> bool:
        """Git hosting: the caller (HTTP basic `<clientId>:<token>`, or a bearer token) may
        read this device's repository only if the device is one of its own. With replicas,
        the repository is first brought to the newest published generation, so the two
        requests of one fetch (advertisement, pack) may reach different replicas: the
        second never lacks what the first advertised, and no replica serves a branch older
        than what another already answered before the request arrived."""
        try:
            client = await self.authenticate(request)
        except ProblemError:
            return False
        owner = await self.api.db.aread(lambda conn: records.device_owner(conn, device_id))
        if owner != client.client_id:
            return False
        if request.url.path.endswith("/info/refs"):  # a Git device's poll: it was heard
            self.api.polls.seen(client.client_id)
        await self.api.caught_up()
        return True


def _retired() -> ProblemError:
    """The refusal of a retired client's request."""
    return ProblemError(403, "the client relationship has been retired",
                        margo_type="not-authorized", title=RETIRED)


class Admission:
    """Whether a held request's caller is still admitted: `await admission()` raises what a
    request arriving now would be refused with. Asked at every wake of a held poll: the
    request is authenticated again from what the server remembers (a few microseconds: an
    access token or an SVID that expired meanwhile is refused), and once the credentials
    epoch moved (a client retired, a token replaced, by any process:
    `wfm.identity.credentialcache`) with the client's row read afresh (`Callers.readmit`).
    One object per held request (no closure: see `wfm.http.manifest_waits._HeldPoll`),
    keeping only what authenticating reads of the request's scope (`_ADMISSION_KEYS`), the
    request made again from it at a wake: the handler's copy of the scope and its
    `Request` would cost 1.4 KiB per held poll (`bench/held_polls.py`)."""

    __slots__ = ("callers", "client", "epoch", "parts")

    def __init__(self, callers: Callers, request: Request, client: Client) -> None:
        self.callers, self.client = callers, client
        self.parts = tuple(request.scope.get(key) for key in _ADMISSION_KEYS)
        self.epoch = callers.api.credentials.epoch

    async def __call__(self) -> None:
        epoch = self.callers.api.credentials.epoch
        request = Request({key: value for key, value in zip(_ADMISSION_KEYS, self.parts,
                                                            strict=True) if value is not None})
        if epoch == self.epoch:
            await self.callers.scoped(request)
            return
        self.epoch = epoch
        await self.callers.readmit(request, self.client)
