"""A deleted device id starts from an empty history on EVERY replica: the deletion is
published in the shared store with the device's rows (`wfm.fleet.deletions.publish_deletion`),
each replica removes the branch from the repository it serves, a repair or a replica built
from the database never brings it back, and whoever registers the id next, through any
replica, gets a branch of its own with none of the previous owner's commits or objects.
Other devices' branches are untouched."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.serverkit import _one_server, two_replicas
from kits.serverkit import replica_client as client
from test_device_id_reuse import box, manifest_with, report
from test_lost_state import drop_ref

from compiler.gitstore import REPOSITORY_NAME, device_ref
from tools.polling import poll_until

SECRET = "site-of-alice-5d1c"
_GIT_ENV = {"PATH": "/usr/bin:/bin", "GIT_TERMINAL_PROMPT": "0", "HOME": "/nonexistent"}


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with two_replicas(tmp_path, ("alice", "bob")) as started:
        yield started


def git(*args: str, cwd: Path | None = None, check: bool = True
        ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          env=_GIT_ENV, check=False, timeout=60)
    assert not check or done.returncode == 0, done.stderr
    return done


def remote(replicas: dict[str, Any], name: str, replica: int, device_id: str) -> str:
    base = replicas["bases"][replica].replace(
        "http://", f"http://{name}:{replicas['tokens'][name]}@")
    return f"{base}/git/devices/{device_id}.git"


def tip(repo: Path, device_id: str) -> str | None:
    """The branch's commit in a replica's served repository (None: no branch there)."""
    done = git("--git-dir", str(repo), "rev-parse", "--verify", "-q", device_ref(device_id),
               check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def rows(replicas: dict[str, Any], sql: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with contextlib.closing(psycopg.connect(replicas["url"])) as conn:
        return [tuple(r) for r in conn.execute(sql, args).fetchall()]


def test_a_deletion_on_one_replica_is_a_fresh_start_on_every_replica(
        replicas: dict[str, Any], tmp_path: Path) -> None:
    with client(replicas, "alice", 0) as alice, client(replicas, "bob", 1) as bob:
        assert alice.put("/api/v1/capabilities/reused-box",
                         json=box("reused-box", SECRET)).status_code == 201
        assert alice.put("/api/v1/capabilities/alices-other",
                         json=box("alices-other", "alice-keeps")).status_code == 201
        assert bob.put("/api/v1/capabilities/bobs-other",
                       json=box("bobs-other", "bob-keeps")).status_code == 201
        manifest = manifest_with(alice, SECRET)
        manifest_with(alice, "alice-keeps")
        manifest_with(bob, "bob-keeps")
        deployment = next(d["deploymentId"] for d in manifest["deployments"]
                          if SECRET.encode() in alice.get(d["url"]).content)
        assert report(alice, deployment, manifest["manifestVersion"]).status_code == 200
        # Replica 1 takes a report naming the device (it reads Alice's devices once for
        # the generation it serves, not per report).
        with client(replicas, "alice", 1) as alice_on_1:
            assert report(alice_on_1, deployment, manifest["manifestVersion"],
                          deviceId="reused-box").status_code == 200
        # Both replicas serve Alice's branch (a fetch through either syncs it first).
        old = git("ls-remote", remote(replicas, "alice", 1, "reused-box")).stdout.split()[0]
        assert tip(replicas["repos"][1], "reused-box") == old
        others = {d: tip(replicas["repos"][0], d) for d in ("alices-other", "bobs-other")}
        assert None not in others.values()

        assert alice.delete("/api/v1/capabilities/reused-box").status_code == 204
        # The replica that answered serves the deletion already; the other one within a
        # sync, and neither compile nor repair brings the branch back.
        assert tip(replicas["repos"][0], "reused-box") is None
        poll_until("replica 1 to drop the deleted branch",
                   lambda: tip(replicas["repos"][1], "reused-box") is None, timeout=10,
                   interval=0.1)
        assert rows(replicas, "SELECT target FROM git_refs WHERE name = %s",
                    device_ref("reused-box")) == [(None,)]
        assert rows(replicas, "SELECT client_id FROM statuses WHERE deployment_id = %s",
                    deployment) == []
        # ... and no longer takes one: the deletion was a generation, its list is read again.
        with client(replicas, "alice", 1) as alice_on_1:
            refused = report(alice_on_1, deployment, manifest["manifestVersion"],
                             deviceId="reused-box")
        assert refused.status_code == 422
        assert "not one of this client's devices" in refused.json()["detail"]
        assert rows(replicas, "SELECT client_id FROM statuses WHERE deployment_id = %s",
                    deployment) == []

        # A repair (the whole published state applied again) keeps it deleted: lose an
        # unrelated branch on replica 1 and let a poll there ask for the repair (a new
        # device moves the generation, so the manifest is computed again).
        drop_ref(replicas["repos"][1], device_ref("alices-other"))
        assert alice.put("/api/v1/capabilities/alices-third",
                         json=box("alices-third", "alice-adds")).status_code == 201
        with client(replicas, "alice", 1) as alice_on_1:
            poll_until("replica 1 to repair the lost branch",
                       lambda: alice_on_1.get("/api/v1/deployments").status_code == 200
                       and tip(replicas["repos"][1], "alices-other") is not None,
                       timeout=30, interval=0.2)
        assert tip(replicas["repos"][1], "reused-box") is None
        # A replica built from the database alone never has it either.
        with _one_server(replicas["data"] / "replica-2", *replicas["args"],
                         log_dir=replicas["log_dir"]):
            fresh = replicas["data"] / "replica-2" / "repos" / REPOSITORY_NAME
            assert tip(fresh, "alices-other") is not None
            assert tip(fresh, "reused-box") is None

        # Bob registers the id through the other replica: his branch starts from nothing.
        assert bob.put("/api/v1/capabilities/reused-box",
                       json=box("reused-box", "bobs-site")).status_code == 201
        bobs = manifest_with(bob, "bobs-site")
        assert SECRET.encode() not in b"".join(bob.get(d["url"]).content
                                               for d in bobs["deployments"])
        for replica in (1, 0):
            clone = tmp_path / f"clone-{replica}"
            git("clone", "-q", remote(replicas, "bob", replica, "reused-box"), str(clone))
            assert SECRET not in git("log", "-p", "--all", cwd=clone).stdout
            assert old not in git("rev-list", "--all", cwd=clone).stdout
            roots = git("rev-list", "--max-parents=0", "HEAD", cwd=clone).stdout.split()
            assert len(roots) == 1 and roots[0] != old
            # Alice's commits are still objects in the replica's repository, unreachable:
            # the want gate refuses them (protocol v2 takes any id as a want).
            fetch = git("-c", "protocol.version=2", "fetch", "-q", "origin", old, cwd=clone,
                        check=False)
            assert fetch.returncode != 0
        assert report(bob, deployment, bobs["manifestVersion"]).status_code == 200
        assert rows(replicas, "SELECT client_id, device_id FROM statuses WHERE "
                    "deployment_id = %s", deployment) == [("bob", "reused-box")]

        # The other devices' branches never moved, on either replica.
        for repo in replicas["repos"]:
            poll_until("the repaired branch back where it was",
                       lambda repo=repo: {d: tip(repo, d) for d in others} == others,
                       timeout=10, interval=0.1)
        assert git("ls-remote", remote(replicas, "bob", 0, "bobs-other")).stdout.split()[0] \
            == others["bobs-other"]
