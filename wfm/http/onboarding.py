"""Getting a device its identity: rc.2 onboarding (the CA certificate, binding a device
certificate's key to a client) and the Oct-2024 OAuth2 client-credentials exchange.

Onboarding is the one device-API door open before anyone is authenticated, so what it
accepts is the operator's policy (`margo serve --onboarding open|closed`).
"""

from __future__ import annotations

import base64
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wfm.http.device_api import Api
from wfm.http.request_parts import json_body
from wfm.identity.credentials import parse_basic
from wfm.identity.signatures import OnboardingError, onboarding_key
from wfm.problems import RETIRED, ProblemError

__all__ = ["Onboarding"]


class Onboarding:
    """`/api/v1/onboarding[/certificate]` (rc.2) and `/oauth/token` (Oct-2024)."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def certificate(self, request: Request) -> Response:
        if self.api.ca_certificate is None:
            raise ProblemError(503, "no CA certificate is configured", retry_after=60)
        encoded = base64.b64encode(self.api.ca_certificate.encode()).decode()
        return JSONResponse({"certificate": encoded})

    async def onboard(self, request: Request) -> Response:
        """rc.2 onboarding: bind the device certificate's key to a client (400 unreadable,
        403 refused by policy, 201 with the clientId). The same key onboarded again gets its
        existing clientId back, so a device that lost the response can retry."""
        doc = await json_body(request)
        try:
            key = onboarding_key(doc)
        except OnboardingError as exc:
            raise ProblemError(exc.status, exc.detail, margo_type="invalid-request"
                               if exc.status == 400 else "not-authorized") from None
        clients, settings = self.api.clients, self.api.identity.settings
        known = clients.by_key_id(key.key_id)
        if known is not None and known.client.retired:
            raise ProblemError(403, "the client relationship for this key has been retired",
                               margo_type="not-authorized", title=RETIRED)
        if known is None and settings.onboarding != "open":
            raise ProblemError(403, "onboarding of new certificates is closed: the operator "
                               "imports them (`margo clients import ID --cert FILE`)",
                               margo_type="not-authorized")
        client_id = known.client.client_id if known else clients.add_key(
            str(uuid.uuid4()), key_id=key.key_id, public_key=key.public_key_pem,
            certificate=key.certificate_pem)
        body = {"clientId": client_id}
        if settings.bearer_tokens:  # development: tokens work alongside
            body["token"] = clients.add(client_id)[1]
        return JSONResponse(body, status_code=201)

    async def oauth_token(self, request: Request) -> Response:
        form = await request.form()
        client_id, secret = form.get("client_id"), form.get("client_secret")
        pair = parse_basic(request.headers.get("authorization", ""))
        if pair:
            client_id, secret = pair
        if form.get("grant_type") != "client_credentials":
            return JSONResponse({"error": "unsupported_grant_type"}, status_code=400)
        clients = self.api.clients
        client = (clients.by_basic(str(client_id), str(secret))
                  if client_id and secret else None)
        if client is None or client.retired:
            return JSONResponse({"error": "invalid_client"}, status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="margo-gitops"'})
        token, expires = await clients.issue_access_token(client)
        return JSONResponse({"access_token": token, "token_type": "Bearer",
                             "expires_in": expires}, headers={"Cache-Control": "no-store"})
