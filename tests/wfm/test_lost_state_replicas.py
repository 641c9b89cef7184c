"""A branch lost from a replica's served repository is lost state there too, never "nothing
to deploy": the replica's copy is derived from what was published in the database, so a
branch published but missing here is answered 503 for a moment while the replica applies
the published state again, and then served as before. No empty manifest is ever given."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.serverkit import replica_client as client
from kits.serverkit import two_replicas
from test_lost_state import box, drop_ref, info_refs, manifest_with_deployments

from compiler.gitstore import device_ref
from tools.polling import poll_until


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with two_replicas(tmp_path, ("lost", "other")) as started:
        yield {**started, "repo": started["repos"][0]}


def test_a_replica_that_lost_a_branch_applies_the_published_state_again(
        replicas: dict[str, Any]) -> None:
    with client(replicas, "lost", 0) as lost, client(replicas, "other", 0) as other:
        assert lost.put("/api/v1/capabilities/box-lost", json=box("box-lost", "a")
                        ).status_code == 201
        before = manifest_with_deployments(lost)
        with client(replicas, "lost", 1) as elsewhere:
            assert manifest_with_deployments(elsewhere) == before

        # No compile may repair anything behind our back: the source cannot be read.
        replicas["source"].rename(replicas["source"].with_name("fleet-away"))
        ref = device_ref("box-lost")
        drop_ref(replicas["repo"], ref)
        # Git on that replica tells lost state apart from no state as REST does (a 404
        # would read "nothing to deploy"), by what was published, and asks for the repair.
        at_lost = {"base": replicas["bases"][0], "tokens": replicas["tokens"]}
        refs = info_refs(at_lost, "lost", "box-lost")
        assert refs.status_code == 503, refs.text
        assert "missing" in refs.json()["detail"] and refs.headers["retry-after"]
        # A new device moves this replica's generation: its manifests are computed again.
        assert other.put("/api/v1/capabilities/box-other", json=box("box-other", "c")
                         ).status_code == 201

        answers: list[tuple[int, Any]] = []

        def served_again() -> bool:
            response = lost.get("/api/v1/deployments")
            answers.append((response.status_code, response.json()))
            return response.status_code == 200 and response.json() == before

        poll_until("the replica to repair its copy", served_again, timeout=20, interval=0.1)
        # Every answer meanwhile was the lost-state 503 or the manifest as it was: never an
        # empty one, never a new version.
        assert all(status == 503 or doc == before for status, doc in answers), answers
        restored = subprocess.run(["git", "-C", str(replicas["repo"]), "rev-parse",
                                   "--verify", "-q", ref], capture_output=True, text=True)
        assert restored.returncode == 0, "the ref is back in the replica's served copy"
        assert info_refs(at_lost, "lost", "box-lost").status_code == 200
