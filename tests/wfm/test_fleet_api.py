"""The read API, the push hook and source watching, against a running `margo serve`."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from kits.serverkit import ROOT, add_client, running_server

from tools.margoserver import margo_server
from tools.polling import poll_until

CAPS = ROOT / "examples" / "capabilities"


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True, env={"GIT_AUTHOR_NAME": "Platform", "PATH": "/usr/bin:/bin",
                                          "GIT_AUTHOR_EMAIL": "p@example.com",
                                          "GIT_COMMITTER_NAME": "Platform",
                                          "GIT_COMMITTER_EMAIL": "p@example.com",
                                          "HOME": str(cwd)}).stdout.strip()


def fleet_repository(work: Path) -> Path:
    """The example fleet as a Git repository with one commit on `main`."""
    shutil.copytree(ROOT / "examples" / "fleet", work)
    git("init", "-q", "-b", "main", cwd=work)
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", "fleet", cwd=work)
    return work


def caps(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CAPS / f"{name}.json").read_text())
    return doc


def poll(http: httpx.Client, predicate: Any, path: str = "/api/v1/deployments") -> Any:
    """The body at `path` once `predicate` holds (or the last one after 20 s)."""
    seen: list[Any] = [None]

    def holds() -> bool:
        seen[0] = http.get(path).json()
        return bool(predicate(seen[0]))

    with contextlib.suppress(TimeoutError):
        poll_until(f"{path} to change", holds, timeout=20, interval=0.2)
    return seen[0]


def github_push(secret: str, ref: str, after: str) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"ref": ref, "before": "0" * 40, "after": after, "deleted": False,
                       "repository": {"full_name": "acme/fleet",
                                      "clone_url": "https://example.invalid/acme/fleet.git"}}
                      ).encode()
    signature = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return body, {"X-GitHub-Event": "push", "X-Hub-Signature-256": signature,
                  "X-GitHub-Delivery": "1", "Content-Type": "application/json"}


SECRET = "s3cret"
INTENT = Path("deployments") / "hello-everywhere.yaml"


@contextlib.contextmanager
def mirrored_server(tmp_path: Path) -> Iterator[tuple[Path, str, httpx.Client]]:
    """A server mirroring the example fleet's repository (fetched on verified push hooks),
    with compose-box-amd64 reported by client edge: (the repository, base URL, its client)."""
    work = fleet_repository(tmp_path / "fleet")
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    data = tmp_path / "data"
    token = add_client(data, "edge")
    with running_server(data, "--source-url", str(work), "--source-branch", "main",
                        "--webhook-secret-file", str(secret_file)) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        http.put("/api/v1/capabilities/compose-box-amd64", json=caps("compose-box-amd64"))
        yield work, base, http


def commit_edit(work: Path, old: str, new: str, message: str) -> str:
    """Replace `old` by `new` in hello-everywhere's intent and commit; the new commit id."""
    intent = work / INTENT
    intent.write_text(intent.read_text().replace(old, new))
    git("commit", "-q", "-am", message, cwd=work)
    return git("rev-parse", "HEAD", cwd=work)


def announce(base: str, head: str, *, secret: str = SECRET,
             ref: str = "refs/heads/main") -> httpx.Response:
    """A GitHub push event for `head` on `ref`, signed with `secret`, to the server's hook."""
    body, headers = github_push(secret, ref, head)
    return httpx.post(f"{base}/hooks/git", content=body, headers=headers)


def test_push_hook_fetches_the_configured_source_and_recompiles(tmp_path: Path) -> None:
    with mirrored_server(tmp_path) as (work, base, http):
        first = poll(http, lambda m: len(m["deployments"]) == 1)
        assert len(first["deployments"]) == 1
        head = commit_edit(work, "namespace: hello", "namespace: hi", "rename namespace")
        assert announce(base, head, secret="wrong").status_code == 401
        time.sleep(1)
        assert http.get("/api/v1/deployments").json() == first  # nothing fetched
        assert announce(base, head, ref="refs/heads/other").status_code == 202
        response = announce(base, head)
        assert response.status_code == 202 and response.json()["fetched"] == head
        second = poll(http, lambda m: m["manifestVersion"] > first["manifestVersion"])
        assert second["manifestVersion"] == first["manifestVersion"] + 1
        assert b"namespace: hi" in http.get(second["deployments"][0]["url"]).content


def test_watch_source_recompiles_local_edits(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples" / "fleet", tmp_path / "fleet")
    data = tmp_path / "data"
    token = add_client(data, "edge")
    with running_server(data, "--source", str(tmp_path / "fleet"), "--watch-source") as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        http.put("/api/v1/capabilities/compose-box-amd64", json=caps("compose-box-amd64"))
        first = poll(http, lambda m: len(m["deployments"]) == 1)
        (tmp_path / "fleet" / "deployments" / "hello-everywhere.yaml").unlink()
        after = poll(http, lambda m: not m["deployments"])
        assert after["deployments"] == [] and after["bundle"] is None
        assert after["manifestVersion"] == first["manifestVersion"] + 1


def test_read_api_shows_devices_deployments_and_explanations(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples" / "fleet", tmp_path / "fleet")
    data = tmp_path / "data"
    token = add_client(data, "edge")
    admin = tmp_path / "admin"
    admin.write_text("operator-token")
    with running_server(data, "--source", str(tmp_path / "fleet"), "--admin-token-file",
                        str(admin)) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        for name in ("k8s-cluster-gpu", "k8s-single-arm64"):
            http.put(f"/api/v1/capabilities/{name}", json=caps(name))
        manifest = poll(http, lambda m: len(m["deployments"]) == 7)
        ref = next(d for d in manifest["deployments"])
        http.post(f"/api/v1/deployments/{ref['deploymentId']}/status", json={
            "deploymentId": ref["deploymentId"], "adoptedManifestVersion": 1,
            "status": {"state": "failed", "error": {"code": "E1", "source": "x",
                                                    "message": "image pull failed"}},
            "components": [{"name": "c", "state": "failed"}]})
        assert httpx.get(f"{base}/api/fleet/devices").status_code == 401
        operator = {"Authorization": "Bearer operator-token"}
        devices = httpx.get(f"{base}/api/fleet/devices", headers=operator).json()["devices"]
        assert [d["deviceId"] for d in devices] == ["k8s-cluster-gpu", "k8s-single-arm64"]
        assert devices[0]["deployments"] == 4
        detail = httpx.get(f"{base}/api/fleet/devices/k8s-single-arm64", headers=operator).json()
        vision = next(e for e in detail["eligibility"] if e["intent"] == "vision-plant-a")
        assert vision["status"] == "not targeted"
        assert detail["history"] and "add hello-everywhere" in detail["history"][0]["message"]
        counts = httpx.get(f"{base}/api/fleet/deployments", headers=operator).json()
        assert counts["total"] == 7
        assert counts["byState"] == {"failed": 1, "pending": 6}
        assert sum(sum(v.values()) for v in counts["byIntent"].values()) == 7
        missing = httpx.get(f"{base}/api/fleet/devices/nope", headers=operator)
        assert missing.status_code == 404
        table = subprocess.run([sys.executable, "-m", "margo_cli.main", "status", "--url", base,
                                "--token-file", str(admin)], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout
        assert "k8s-cluster-gpu" in table and "failed=1" in table
        one = subprocess.run([sys.executable, "-m", "margo_cli.main", "status", "--url", base,
                              "--token-file", str(admin), "--device", "k8s-single-arm64"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert "vision-plant-a: not targeted" in one


def test_pushing_to_the_hosted_source_recompiles(tmp_path: Path) -> None:
    data = tmp_path / "data"
    token = add_client(data, "edge")
    admin = tmp_path / "admin"
    admin.write_text("operator-token")
    work = tmp_path / "work"
    fleet_repository(work)
    with running_server(data, "--host-source", "--admin-token-file", str(admin)) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        http.put("/api/v1/capabilities/compose-box-amd64", json=caps("compose-box-amd64"))
        time.sleep(1)
        assert http.get("/api/v1/deployments").json()["deployments"] == []
        url = base.replace("http://", "http://operator:operator-token@") + "/git/source.git"
        bad = base.replace("http://", "http://operator:wrong@") + "/git/source.git"
        refused = subprocess.run(["git", "push", "-q", bad, "main"], cwd=work,
                                 capture_output=True, text=True, check=False,
                                 env={"PATH": "/usr/bin:/bin", "GIT_TERMINAL_PROMPT": "0",
                                      "HOME": str(work)})
        assert refused.returncode != 0
        for password in ("pässwörd", "operator-tokén"):  # was a 500 (compare_digest on str)
            answer = httpx.get(f"{base}/git/source.git/info/refs",
                               params={"service": "git-receive-pack"},
                               auth=("operator", password))
            assert answer.status_code == 401, answer.text
        git("push", "-q", url, "main", cwd=work)
        manifest = poll(http, lambda m: len(m["deployments"]) == 1)
        assert len(manifest["deployments"]) == 1
        clone = tmp_path / "clone"
        git("clone", "-q", url, str(clone), cwd=tmp_path)
        assert (clone / "deployments" / "hello-everywhere.yaml").exists()


def test_a_fresh_hosted_source_waits_for_its_first_push_without_a_warning(
        tmp_path: Path) -> None:
    """Nothing pushed yet is the normal state of a new server: INFO, not WARNING."""
    add_client(tmp_path / "data", "edge")
    with margo_server(tmp_path / "data", "--host-source", log_level="info",
                      cwd=ROOT) as server:
        poll_until("the server waiting", lambda: "waiting for the first push"
                   in server.log.read_text(), timeout=20, interval=0.1)
        log = server.log.read_text()
    assert ("INFO margo.wfm.compiles: fleet source: nothing pushed or fetched to "
            "refs/heads/main yet; waiting for the first push") in log, log
    assert " WARNING " not in log and " ERROR " not in log, log


@contextlib.contextmanager
def hosted_source(tmp_path: Path) -> Iterator[tuple[httpx.Client, str, Path, dict[str, Any]]]:
    """A server hosting the fleet source (`--host-source`), the example fleet pushed to it
    and compiled for one Compose box: a device client, the push URL, the working copy and
    the first manifest."""
    data = tmp_path / "data"
    token = add_client(data, "edge")
    admin = tmp_path / "admin"
    admin.write_text("operator-token")
    work = fleet_repository(tmp_path / "work")
    with running_server(data, "--host-source", "--admin-token-file", str(admin)) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        url = base.replace("http://", "http://operator:operator-token@") + "/git/source.git"
        http.put("/api/v1/capabilities/compose-box-amd64", json=caps("compose-box-amd64"))
        git("push", "-q", url, "main", cwd=work)
        yield http, url, work, poll(http, lambda m: len(m["deployments"]) == 1)


def refused_push(url: str, work: Path) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """A stock `git push` the server refuses: the process, and what the remote printed."""
    pushed = subprocess.run(["git", "push", url, "main"], cwd=work, capture_output=True,
                            text=True, check=False,
                            env={"PATH": "/usr/bin:/bin", "GIT_TERMINAL_PROMPT": "0",
                                 "HOME": str(work)})
    assert pushed.returncode != 0, pushed.stderr
    return pushed, [line.removeprefix("remote: ").rstrip() for line in
                    pushed.stderr.splitlines() if line.startswith("remote: ")]


def test_a_push_the_compiler_cannot_read_is_refused_with_located_errors(
        tmp_path: Path) -> None:
    """A stock `git push` of a broken intent and a broken descriptor: git prints every
    problem as `remote: file:line:col: path: message` and refuses; the server keeps serving
    the previous source; the fix is accepted."""
    with hosted_source(tmp_path) as (http, url, work, good):
        accepted = git("rev-parse", "HEAD", cwd=work)
        intent = work / "deployments" / "hello-everywhere.yaml"
        intent.write_text(intent.read_text().replace("namespace: hello", "namespace: [hello"))
        descriptor = work / "apps" / "com-example-line-monitor" / "margo.yaml"
        descriptor.write_text(descriptor.read_text().replace("apiVersion:", "apiVersion: 7\n#",
                                                             1))
        git("commit", "-q", "-am", "two mistakes", cwd=work)
        pushed, remote = refused_push(url, work)
        assert any(line.startswith("margo: refusing refs/heads/main") for line in remote), \
            pushed.stderr
        assert any(line.startswith("deployments/hello-everywhere.yaml:") and "invalid YAML"
                   in line for line in remote), pushed.stderr
        assert any(line.startswith("apps/com-example-line-monitor/margo.yaml:")
                   for line in remote), pushed.stderr
        assert "pre-receive hook declined" in pushed.stderr
        assert git("ls-remote", url, "refs/heads/main", cwd=work).split()[0] == accepted
        time.sleep(1)
        assert http.get("/api/v1/deployments").json() == good
        intent.write_text(intent.read_text().replace("namespace: [hello", "namespace: hi"))
        descriptor.write_text(descriptor.read_text().replace("apiVersion: 7\n#", "apiVersion:",
                                                             1))
        git("commit", "-q", "-am", "fixed", cwd=work)
        git("push", "-q", url, "main", cwd=work)
        fixed = poll(http, lambda m: m["manifestVersion"] > good["manifestVersion"])
        assert b"namespace: hi" in http.get(fixed["deployments"][0]["url"]).content


def test_a_push_whose_literal_value_no_device_could_take_is_refused(tmp_path: Path) -> None:
    """`replicas: 99` where the application allows at most 5 breaks on every device: the push
    is refused with the located line `margo validate` prints (the same check); an
    expression is decided per device, so it is accepted."""
    with hosted_source(tmp_path) as (_http, url, work, _):
        accepted = git("rev-parse", "HEAD", cwd=work)
        intent = work / INTENT
        text = intent.read_text()
        expression = text[text.index("    replicas: "):]
        intent.write_text(text.replace(expression, "    replicas: 99\n"))
        git("commit", "-q", "-am", "too many", cwd=work)
        validated = subprocess.run([sys.executable, "-m", "margo_cli.main", "validate",
                                    str(work)], capture_output=True, text=True, check=False,
                                   cwd=ROOT)
        assert validated.returncode == 1
        [line] = [line for line in validated.stdout.splitlines() if ": valid " not in line]
        pushed, remote = refused_push(url, work)
        assert remote[0].startswith("margo: refusing refs/heads/main"), pushed.stderr
        assert remote[1:] == [line.removeprefix(f"{work}/")], pushed.stderr
        assert "$.spec.parameters.replicas: expected an integer between 1 and 5, found 99" \
            in remote[1]
        assert git("ls-remote", url, "refs/heads/main", cwd=work).split()[0] == accepted
        intent.write_text(text.replace(expression, '    replicas: "{{ 99 }}"\n'))
        git("commit", "-q", "-am", "an expression", cwd=work)
        git("push", "-q", url, "main", cwd=work)
        assert git("ls-remote", url, "refs/heads/main", cwd=work).split()[0] != accepted


def test_a_push_with_a_clear_or_damaged_secret_is_refused_without_any_key(
        tmp_path: Path) -> None:
    """Issue 32: the push check verifies secrets' shape without the fleet key (the server
    here has none). A parameter marked sensitive but given in clear is refused at its line,
    then a damaged age file is refused at its line; neither message quotes the value."""
    with hosted_source(tmp_path) as (_http, url, work, _):
        accepted = git("rev-parse", "HEAD", cwd=work)
        descriptor = work / "apps" / "com-example-hello-world" / "margo.yaml"
        descriptor.write_text(descriptor.read_text().replace(
            "  greeting:\n    value: Hello\n", "  greeting:\n    sensitive: true\n", 1))
        git("commit", "-q", "-am", "the greeting is sensitive", cwd=work)
        _, remote = refused_push(url, work)
        [clear] = [line for line in remote if line.startswith(f"{INTENT}:")]
        assert "parameter 'greeting' is sensitive: give it as a secret" in clear, remote
        assert "Hello from" not in "\n".join(remote)
        intent = work / INTENT
        text = intent.read_text()
        greeting = text[text.index("    greeting: "):text.index("    # one replica")]
        intent.write_text(text.replace(greeting, "    greeting:\n      secret: |\n"
                                       "        -----BEGIN AGE ENCRYPTED FILE-----\n"
                                       "        bm90IGFuIGFnZSBmaWxl\n"))
        git("commit", "-q", "-am", "a damaged secret", cwd=work)
        _, remote = refused_push(url, work)
        [damaged] = [line for line in remote if line.startswith(f"{INTENT}:")]
        assert "$.spec.parameters.greeting.secret" in damaged, remote
        assert "ASCII-armored age file" in damaged and "bm90IGFu" not in damaged, remote
        assert git("ls-remote", url, "refs/heads/main", cwd=work).split()[0] == accepted


def test_a_mirrored_source_that_does_not_compile_cleanly_is_a_visible_condition(
        tmp_path: Path) -> None:
    """A mirrored source cannot refuse a push: a broken commit fetched on a push hook shows
    as the source's condition (revision, message, located problems) in the read API and
    `margo status`, while devices keep what the broken intent gave them; the fix clears it."""
    with mirrored_server(tmp_path) as (work, base, http):
        good = poll(http, lambda m: len(m["deployments"]) == 1)
        ready = poll(http, lambda s: s["state"] == "ready", path="/api/fleet/source")
        assert ready["kind"] == "mirrored" and ready["revision"].startswith("git:")
        head = commit_edit(work, "namespace: hello", "namespace: [hello", "a typo")
        assert announce(base, head).status_code == 202
        broken = poll(http, lambda s: s["state"] == "invalid", path="/api/fleet/source")
        assert broken["revision"] == f"git:{head}", broken
        assert broken["problemCount"] == 1
        assert broken["problems"][0].startswith("deployments/hello-everywhere.yaml:"), broken
        assert "invalid YAML" in broken["problems"][0]
        assert http.get("/api/v1/deployments").json()["deployments"] == good["deployments"]
        table = subprocess.run([sys.executable, "-m", "margo_cli.main", "status", "--url", base],
                               capture_output=True, text=True, check=True, cwd=ROOT).stdout
        lines = table.splitlines()
        assert lines[0].startswith(f"source (mirrored): invalid at git:{head}"), table
        assert lines[1].strip() == broken["problems"][0]
        head = commit_edit(work, "namespace: [hello", "namespace: hello", "fixed")
        assert announce(base, head).status_code == 202
        fixed = poll(http, lambda s: s["state"] == "ready" and s["revision"] == f"git:{head}",
                     path="/api/fleet/source")
        assert fixed["problems"] == [] and fixed["message"] is None


def test_explain_fleet_wide_from_a_running_servers_reports(tmp_path: Path) -> None:
    """`margo explain --url URL --intent NAME`: the verdicts on every device that reported,
    as `GET /api/fleet/explain` gives them; bad queries are problems."""
    shutil.copytree(ROOT / "examples" / "fleet", tmp_path / "fleet")
    data = tmp_path / "data"
    token = add_client(data, "edge")
    with running_server(data, "--source", str(tmp_path / "fleet")) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        for name in ("compose-box-amd64", "k8s-single-arm64"):
            assert http.put(f"/api/v1/capabilities/{name}", json=caps(name)).status_code == 201
        result = httpx.get(f"{base}/api/fleet/explain", params={"intent": "vision-plant-a"})
        assert result.status_code == 200
        assert {d["device"]: d["intents"][0]["status"] for d in result.json()["devices"]} == {
            "compose-box-amd64": "not targeted", "k8s-single-arm64": "not targeted"}
        assert httpx.get(f"{base}/api/fleet/explain").status_code == 400
        assert httpx.get(f"{base}/api/fleet/explain", params={"intent": "nope"}
                         ).status_code == 404

        def explain(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "margo_cli.main", "explain", "--url",
                                   base, *args], capture_output=True, text=True, check=False,
                                  cwd=ROOT)

        # Fleet-wide, the devices the intent does not target are counted, listed with --all.
        shown = explain("--intent", "vision-plant-a")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.splitlines() == ["intent vision-plant-a: 2 not targeted",
                                             "  (2 not targeted not listed; --all lists them)"]
        every = explain("--intent", "vision-plant-a", "--all")
        assert every.stdout.splitlines()[0] == "intent vision-plant-a: 2 not targeted"
        assert "  k8s-single-arm64: not targeted" in every.stdout.splitlines()
        chosen = json.loads(explain("--app", "com-example-hello-world", "--status",
                                    "eligible", "--json").stdout)
        assert [d["device"] for d in chosen["devices"]] == ["compose-box-amd64",
                                                             "k8s-single-arm64"]
        assert chosen["hidden"] == 0 and chosen["counts"] == {"eligible": 2}
        # One device: the server's explanation (`eligibility` of GET /api/fleet/devices/ID).
        device = explain("--device", "k8s-single-arm64")
        assert device.returncode == 0, device.stderr
        lines = device.stdout.splitlines()
        assert lines[0] == "device k8s-single-arm64:"
        assert "  vision-plant-a: not targeted (application com-example-gpu-inference " \
            "2.3.0)" in lines
        served = http.get("/api/fleet/devices/k8s-single-arm64").json()["eligibility"]
        as_json = json.loads(explain("--device", "k8s-single-arm64", "--json").stdout)
        assert as_json == {"device": "k8s-single-arm64", "intents": served}
        one = json.loads(explain("--device", "k8s-single-arm64", "--intent", "hello-everywhere",
                                 "--json").stdout)
        assert [e["intent"] for e in one["intents"]] == ["hello-everywhere"]
        untargeted = explain("--device", "k8s-single-arm64", "--status", "not-targeted")
        assert [line for line in untargeted.stdout.splitlines() if not line.startswith("    ")
                ] == ["device k8s-single-arm64:", "  vision-plant-a: not targeted (application "
                      "com-example-gpu-inference 2.3.0)"], untargeted.stdout
        missing = explain("--device", "nope")
        assert missing.returncode == 2 and "no device 'nope'" in missing.stderr
        assert explain("--device", "k8s-single-arm64", "--intent", "nope").returncode == 2


def test_freshness_follows_what_the_device_reported_for_its_current_bytes(
        tmp_path: Path) -> None:
    """pending until `installed` is reported for the deployment's current bytes; pending
    again when the bytes change (a new greeting) until the device reports for the new
    version; failed-on-current when it fails on it. Shown by the read API, margo status
    and the dashboard."""
    shutil.copytree(ROOT / "examples" / "fleet", tmp_path / "fleet")
    data = tmp_path / "data"
    token = add_client(data, "edge")
    with running_server(data, "--source", str(tmp_path / "fleet")) as base, \
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        doc = caps("compose-box-amd64")
        http.put("/api/v1/capabilities/compose-box-amd64", json=doc)
        first = poll(http, lambda m: len(m["deployments"]) == 1)

        def freshness() -> dict[str, Any]:
            found: dict[str, Any] = httpx.get(
                f"{base}/api/fleet/devices/compose-box-amd64").json()["freshness"]
            return found

        def report(manifest: dict[str, Any], state: str) -> None:
            ref = manifest["deployments"][0]
            response = http.post(f"/api/v1/deployments/{ref['deploymentId']}/status", json={
                "deploymentId": ref["deploymentId"],
                "adoptedManifestVersion": manifest["manifestVersion"],
                "status": {"state": state, **({"error": {"code": "E1", "message": "boom"}}
                                              if state == "failed" else {})},
                "components": [{"name": "hello-world", "state": state}]})
            assert response.status_code == 200, response.text

        assert freshness()["state"] == "pending"
        assert freshness()["lastSeen"] is not None
        report(first, "installed")
        assert freshness()["state"] == "current"
        doc["labels"]["example.com/site"] = "plant-q"  # a new greeting: new bytes
        http.put("/api/v1/capabilities/compose-box-amd64", json=doc)
        second = poll(http, lambda m: m["manifestVersion"] > first["manifestVersion"])
        assert second["deployments"][0]["digest"] != first["deployments"][0]["digest"]
        assert freshness()["state"] == "pending"
        report(first, "installed")  # late, for the old version: still pending
        assert freshness()["state"] == "pending"
        report(second, "failed")
        assert freshness()["state"] == "failed-on-current"
        table = subprocess.run([sys.executable, "-m", "margo_cli.main", "status", "--url", base],
                               capture_output=True, text=True, check=True, cwd=ROOT).stdout
        row = next(line for line in table.splitlines() if line.startswith("compose-box-amd64"))
        assert "failed-on-current" in row and "s ago" in row
        assert "  compose-box-amd64: hello-everywhere: boom [E1]" in table.splitlines()
        page = httpx.get(f"{base}/").text
        assert 'data-testid="freshness">failed-on-current<' in page
        report(second, "installed")
        assert freshness()["state"] == "current"
