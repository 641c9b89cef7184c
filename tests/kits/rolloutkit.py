"""Test kit: a real `margo serve` (on the suite's store: `kits.serverkit`) holding a staged
rollout in progress, with operators of each role registered in its store, for the
dashboard's rollout actions (tests/wfm and tests/browser).

The intent `web` rolls out in two waves (a canary, then the rest) over two devices that
never report: once its second revision started, the canary stays pending for the wave
deadline (an hour), so the rollout stays `progressing` until someone pauses or aborts it.

    with rollout_server(tmp_path, {"olivia": "operator", "victor": "viewer"}) as server:
        server.rollout()["status"]          # "progressing"
        server.tokens["olivia"]             # her token, shown once by the registry
        server.revoke("olivia")             # as `margo operators revoke` does
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kits.fleetkit import Fleet, app, device, intent
from kits.pgkit import database_for
from kits.serverkit import STORE, add_client, running_server
from tools.polling import poll_until
from wfm.identity.operators import Role
from wfm.identity.operatorstore import OperatorRegistry
from wfm.store.opening import open_database

__all__ = ["ADMIN_TOKEN", "DEVICES", "INTENT", "RolloutServer", "rollout_server"]

ADMIN_TOKEN = "rollout-admin-token"
INTENT = "web"
DEVICES = ("d0", "d1")
ROLLOUT = {"waves": [{"name": "canary", "devices": 1}, {"name": "rest"}], "soak": "1s"}


@dataclass
class RolloutServer:
    base: str
    data: Path
    fleet: Fleet
    #: Each registered operator's token, by name.
    tokens: dict[str, str]

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=10,
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    def rollout(self) -> dict[str, Any]:
        """The rollout of `web` as the read API shows it."""
        with self.admin() as http:
            response = http.get(f"/api/fleet/rollouts/{INTENT}")
            assert response.status_code == 200, response.text
            view: dict[str, Any] = response.json()
            return view

    @contextlib.contextmanager
    def registry(self) -> Iterator[OperatorRegistry]:
        """The server's operators, changed beside it (what `margo operators` does)."""
        db = open_database(_store(self.data))
        try:
            yield OperatorRegistry(db)
        finally:
            db.close()

    def revoke(self, name: str) -> None:
        with self.registry() as operators:
            operators.revoke(name)

    def rotate(self, name: str) -> str:
        with self.registry() as operators:
            token = operators.rotate(name)
        self.tokens[name] = token
        return token

    def start_revision(self, greeting: str) -> None:
        """Edit the intent (the server watches its source) and wait for the new revision's
        rollout to progress."""
        before = self.rollout()["revision"]
        self.fleet.intents[INTENT]["spec"]["parameters"]["greeting"] = greeting
        self.fleet.write()
        poll_until("the new revision's rollout", lambda: (
            lambda view: view["revision"] != before and view["status"] == "progressing"
            and view["waves"][0]["moved"] == 1)(self.rollout()), timeout=30, interval=0.1)


def _store(data: Path) -> str | Path:
    return database_for(data) if STORE[0] == "replicas" else data / "wfm.sqlite"


@contextlib.contextmanager
def rollout_server(workdir: Path, operators: Mapping[str, str]) -> Iterator[RolloutServer]:
    """The server, its rollout of `web` progressing, `operators` (name -> role) registered."""
    fleet = Fleet(workdir / "fleet")
    fleet.apps["com-example-app"] = app()
    fleet.intents[INTENT] = intent(INTENT, parameters={"greeting": "greeting-v1"},
                                   profile={"type": "compose"}, rollout=ROLLOUT)
    fleet.write()
    data = workdir / "data"
    client = add_client(data, "plant")
    (workdir / "admin").write_text(ADMIN_TOKEN + "\n")
    server = RolloutServer("", data, fleet, {})
    with server.registry() as registry:
        server.tokens.update({name: registry.add(name, Role.parse(role))
                              for name, role in operators.items()})
    with running_server(data, "--source", str(fleet.source), "--watch-source",
                        "--admin-token-file", str(workdir / "admin")) as base, \
            httpx.Client(base_url=base, timeout=10,
                         headers={"Authorization": f"Bearer {client}"}) as http:
        server.base = base
        for device_id in DEVICES:
            response = http.put(f"/api/v1/capabilities/{device_id}",
                                json=device(device_id, types=("compose",)))
            assert response.status_code == 201, response.text

        def first_revision_complete() -> bool:
            with server.admin() as admin:
                view = admin.get(f"/api/fleet/rollouts/{INTENT}")
                served = admin.get("/api/fleet/deployments").json()["total"]
            return view.status_code == 200 and view.json()["status"] == "complete" and \
                served == len(DEVICES)

        poll_until("the first revision", first_revision_complete, timeout=30, interval=0.1)
        server.start_revision("greeting-v2")
        yield server
