"""The fleet server's HTTP edge: one module per API surface, each small.

The device API (`device_routes` binds its routes) is split by what a request does:
`callers` (who is calling), `capabilities` and `statuses` (report intake), `manifests`
(desired state), `onboarding` (rc.2 onboarding, Oct-2024 tokens); `device_api` holds what
they share. Beside it: the read API and its push hook (`fleet_api`, `webhooks`), the
dashboard, and `GET /metrics` (`metrics_endpoint`). Handlers hold no SQL: they call the
store's functions (`wfm.store.records`).
"""
