"""The device API's routes: every generation's paths, bound to the surface that answers.

The routes every device calls all the time come first (routing tries each in turn).
"""

from __future__ import annotations

from starlette.routing import Route

from wfm.http.callers import Callers
from wfm.http.capabilities import CapabilityIntake
from wfm.http.device_api import Api
from wfm.http.manifests import Manifests
from wfm.http.onboarding import Onboarding
from wfm.http.statuses import StatusIntake

__all__ = ["DeviceEdge", "routes"]


class DeviceEdge:
    """The device API's surfaces over one `Api`."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.callers = Callers(api)
        self.capabilities = CapabilityIntake(api, self.callers)
        self.statuses = StatusIntake(api, self.callers)
        self.manifests = Manifests(api, self.callers)
        self.onboarding = Onboarding(api)


def routes(edge: DeviceEdge) -> list[Route]:
    caps, statuses, manifests = edge.capabilities, edge.statuses, edge.manifests
    rc2 = "/api/v1/clients/{clientId}"
    return [
        # rc.3
        Route("/api/v1/deployments", manifests.get_manifest, methods=["GET"]),
        Route("/api/v1/deployments/{deploymentId}/status", statuses.post, methods=["POST"]),
        Route("/api/v1/capabilities/{deviceId:path}", caps.put, methods=["PUT"]),
        Route("/api/v1/capabilities/{deviceId:path}", caps.delete, methods=["DELETE"]),
        Route("/api/v1/deployments/{deploymentId}/{digest}", manifests.get_deployment,
              methods=["GET"]),
        Route("/api/v1/bundles/{digest}", manifests.get_bundle, methods=["GET"]),
        # rc.2
        Route("/api/v1/onboarding", edge.onboarding.onboard, methods=["POST"]),
        Route("/api/v1/onboarding/certificate", edge.onboarding.certificate,
              methods=["GET"]),
        Route(f"{rc2}/capabilities", caps.put, methods=["POST", "PUT"]),
        Route(f"{rc2}/capabilities/{{deviceId:path}}", caps.put, methods=["POST", "PUT"]),
        Route(f"{rc2}/capabilities/{{deviceId:path}}", caps.delete, methods=["DELETE"]),
        Route(f"{rc2}/deployments", manifests.get_manifest, methods=["GET"]),
        Route(f"{rc2}/deployments/{{deploymentId}}/status", statuses.post, methods=["POST"]),
        Route(f"{rc2}/deployment/{{deploymentId}}/status", statuses.post, methods=["POST"]),
        Route(f"{rc2}/deployments/{{deploymentId}}/{{digest}}", manifests.get_deployment,
              methods=["GET"]),
        Route(f"{rc2}/bundles/{{digest}}", manifests.get_bundle, methods=["GET"]),
        # Oct-2024 Preview Release 1
        Route("/oauth/token", edge.onboarding.oauth_token, methods=["POST"]),
        Route("/device/{deviceId:path}/capabilities", caps.put_oct_2024,
              methods=["POST", "PUT"]),
        Route("/device/{deviceId:path}/deployment/{deploymentId}/status", statuses.post,
              methods=["POST"]),
    ]
