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
from wfm.problems import RETIRED, ProblemError
from wfm.store import records

__all__ = ["Callers"]


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
            raise ProblemError(403, "the client relationship has been retired",
                               margo_type="not-authorized", title=RETIRED)
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
