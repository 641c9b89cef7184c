"""Registry credentials the fleet grants to a Helm deployment, given to the cluster for the
images the kubelet pulls (reconciler/drivers/helm_pull_secrets.py).

On the real control plane (API server with its ServiceAccount admission, controllers, kwok
nodes), as the device's ServiceAccount under examples/kubernetes/device-rbac.yaml: the
release's `kubernetes.io/dockerconfigjson` Secret and its reference on the namespace's
`default` ServiceAccount are written before Helm installs, next to a pull secret the site
set up itself; pods created in the namespace get both from the admission; the same
password sealed again writes nothing, a new one rewrites the Secret; a step without grants
and the removal take both away; a Secret of that name that is not ours is left alone.

On real nodes (kubelet and containerd running containers): the chart's image is only in a
registry that requires basic authentication, and the pod runs only thanks to the grant
(without it, the kubelet's pull is refused). The registry listens on the host's loopback;
the test serves that port on each node's own loopback too (`tools.kube.relay`, as
realnode.py serves the API server's), where containerd's CRI pulls over plain HTTP
(containerd uses HTTP for a loopback registry without any registry configuration).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kits.chartkit import converge, publish_chart, write_chart
from kits.kubekit import KubeCluster, RealCluster, RealNodes
from kits.registrykit import running_registry

from margo.sealing import seal
from reconciler.charts import ChartCache
from reconciler.desired import DesiredDeployment, parse_deployment
from reconciler.drivers.helm import HelmDriver
from reconciler.drivers.helm_pull_secrets import secret_name
from reconciler.encryption_key import DeviceKey
from reconciler.errors import ApplyError, ErrorCode
from reconciler.releases import release_name
from tools.docker.testimages import rootfs_tar
from tools.kube.nodeimages import serve_http
from tools.kube.relay import connect_in, socket_in, splice

USER = "robot"
#: The registry's password: what no message or log line may ever hold.
PASSWORD = f"kube-grant-{secrets.token_hex(12)}"
ROTATED = f"kube-rotated-{secrets.token_hex(12)}"
DEPLOYMENT_ID = "3c2b1a09-8f7e-4d6c-9b5a-4e3d2c1b0a98"
RELEASE = release_name(DEPLOYMENT_ID, "greeter")
PULL_SECRET = secret_name(RELEASE)
EXTENSION = "x-margo-gitops-extensions"
#: A registry host for the control plane's tests: there kwok runs the pods, nothing pulls.
GRANTED_HOST = "images.example.com:5000"


def deployment(repository: str, greeting: str, *, namespace: str,
               grants: tuple[tuple[str, str], ...] = (), wait: bool = False) -> DesiredDeployment:
    """The greeter chart as an rc.3 ApplicationDeployment, granting `(host, envelope)`s."""
    spec: dict[str, Any] = {
        "applicationId": "com-example-greeter",
        "deploymentProfile": {"type": "helm", "components": [
            {"name": "greeter", "properties": {"repository": repository, "revision": "1.0.0",
                                               "wait": wait, "timeout": "2m0s"}}]},
        "parameters": {"greeting": {"value": greeting, "targets": [
            {"pointer": "config.greeting", "components": ["greeter"]}]}}}
    if grants:
        spec[EXTENSION] = {"registryCredentials": [
            {"registry": host, "username": USER, "password": envelope}
            for host, envelope in grants]}
    return parse_deployment(yaml.safe_dump({
        "id": DEPLOYMENT_ID,
        "metadata": {"name": "greeter-pulls", "namespace": namespace, "deviceId": "kube-box"},
        "spec": spec}, sort_keys=False).encode())


def auths(secret: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The credentials a dockerconfigjson Secret holds: host → (user, password)."""
    config = json.loads(base64.b64decode(secret["data"][".dockerconfigjson"]))
    return {host: tuple(base64.b64decode(entry["auth"]).decode().split(":", 1))
            for host, entry in config["auths"].items()}


def pull_secret_names(kube: KubeCluster, namespace: str) -> list[str]:
    account = kube.admin.get("ServiceAccount", "default", namespace)
    return [s["name"] for s in account.get("imagePullSecrets") or []]


@pytest.fixture
def key(tmp_path: Path) -> DeviceKey:
    return DeviceKey.open(tmp_path / "keys" / "encryption.age")


@pytest.fixture
def chart(registry: str, tmp_path: Path) -> str:
    return publish_chart(registry, write_chart(tmp_path / "src", deployment=True),
                         repo_path="pull-secrets")


@pytest.fixture
def driver(kube: KubeCluster, key: DeviceKey, tmp_path: Path) -> Iterator[HelmDriver]:
    with ChartCache(tmp_path / "cache") as cache:
        helm_driver = HelmDriver(cache, kubeconfig=kube.device_kubeconfig(), key=key)
        yield helm_driver
        helm_driver.close()


# --------------------------------------------------------------------------- control plane


def test_grants_become_the_releases_pull_secret_on_the_default_service_account(
        driver: HelmDriver, kube: KubeCluster, key: DeviceKey, chart: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    namespace = "pull-secrets"
    # The site's own pull secret on the namespace's default account: it stays, first.
    kube.admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kube.admin.apply({"apiVersion": "v1", "kind": "ServiceAccount",
                      "metadata": {"name": "default", "namespace": namespace},
                      "imagePullSecrets": [{"name": "site-pull"}]})
    envelope = seal(PASSWORD, key.recipient(), mac="0" * 32)

    converge(driver, [deployment(chart, "one", namespace=namespace,
                                 grants=((GRANTED_HOST, envelope),))])
    secret = kube.admin.get("Secret", PULL_SECRET, namespace)
    assert secret["type"] == "kubernetes.io/dockerconfigjson"
    assert auths(secret) == {GRANTED_HOST: (USER, PASSWORD)}
    labels = secret["metadata"]["labels"]
    assert (labels["margo-gitops.dev/managed-by"], labels["margo-gitops.dev/deployment"],
            labels["margo-gitops.dev/component"], labels["margo-gitops.dev/release"]) == (
        "margo-gitops", DEPLOYMENT_ID, "greeter", RELEASE)
    assert pull_secret_names(kube, namespace) == ["site-pull", PULL_SECRET]
    # The ServiceAccount admission gives the account's pull secrets to every new pod that
    # names none: the release's own pods, and any other.
    kube.until("the release's pod", lambda: kube.pods(namespace, f"app.kubernetes.io/"
                                                                  f"instance={RELEASE}"))
    [pod] = kube.pods(namespace, f"app.kubernetes.io/instance={RELEASE}")
    assert pod["spec"]["imagePullSecrets"] == [{"name": "site-pull"}, {"name": PULL_SECRET}]
    other = kube.admin.request("POST", f"/api/v1/namespaces/{namespace}/pods", json={
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bystander"},
        "spec": {"containers": [{"name": "c", "image": f"{GRANTED_HOST}/x:1"}]}}).json()
    assert other["spec"]["imagePullSecrets"] == [{"name": "site-pull"}, {"name": PULL_SECRET}]
    kube.admin.delete("Pod", "bystander", namespace)

    # The same password sealed again: nothing in the cluster changes.
    versions = (secret["metadata"]["resourceVersion"],
                kube.admin.get("ServiceAccount", "default", namespace)["metadata"][
                    "resourceVersion"])
    again = seal(PASSWORD, key.recipient(), mac="0" * 32)
    assert again != envelope
    converge(driver, [deployment(chart, "two", namespace=namespace,
                                 grants=((GRANTED_HOST, again),))])
    assert (kube.admin.get("Secret", PULL_SECRET, namespace)["metadata"]["resourceVersion"],
            kube.admin.get("ServiceAccount", "default", namespace)["metadata"][
                "resourceVersion"]) == versions

    # A new password: the Secret is rewritten, the account left as it is.
    converge(driver, [deployment(chart, "three", namespace=namespace, grants=(
        (GRANTED_HOST, seal(ROTATED, key.recipient(), mac="1" * 32)),))])
    assert auths(kube.admin.get("Secret", PULL_SECRET, namespace)) == {
        GRANTED_HOST: (USER, ROTATED)}
    assert kube.admin.get("ServiceAccount", "default", namespace)["metadata"][
        "resourceVersion"] == versions[1]

    # The grant withdrawn: the next step takes the Secret and its reference away.
    converge(driver, [deployment(chart, "four", namespace=namespace)])
    assert kube.admin.find("Secret", PULL_SECRET, namespace) is None
    assert pull_secret_names(kube, namespace) == ["site-pull"]

    # Granted again, then the deployment removed: uninstalled, and nothing of it left.
    converge(driver, [deployment(chart, "five", namespace=namespace,
                                 grants=((GRANTED_HOST, envelope),))])
    assert pull_secret_names(kube, namespace) == ["site-pull", PULL_SECRET]
    converge(driver, [])
    assert kube.admin.find("Secret", PULL_SECRET, namespace) is None
    assert pull_secret_names(kube, namespace) == ["site-pull"]
    assert driver.installed() == []

    text = caplog.text
    for password in (PASSWORD, ROTATED):
        assert password not in text
        assert base64.b64encode(f"{USER}:{password}".encode()).decode() not in text


def test_a_namespace_the_driver_makes_and_a_secret_that_is_not_ours(
        driver: HelmDriver, kube: KubeCluster, key: DeviceKey, chart: str) -> None:
    envelope = seal(PASSWORD, key.recipient(), mac="0" * 32)
    # A namespace that does not exist yet: made, with the account holding our reference
    # (made by us or by the controller, whichever came first), before Helm installs.
    fresh = "pull-fresh"
    assert fresh not in kube.namespaces()
    converge(driver, [deployment(chart, "one", namespace=fresh,
                                 grants=((GRANTED_HOST, envelope),))])
    assert pull_secret_names(kube, fresh) == [PULL_SECRET]
    converge(driver, [])
    assert kube.admin.find("Secret", PULL_SECRET, fresh) is None
    assert pull_secret_names(kube, fresh) == []

    # A Secret of that name someone else made is neither overwritten nor deleted.
    taken = "pull-taken"
    kube.admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": taken}})
    theirs = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": PULL_SECRET, "namespace": taken},
              "stringData": {"note": "theirs"}}
    kube.apply(theirs)
    with pytest.raises(ApplyError) as raised:
        converge(driver, [deployment(chart, "one", namespace=taken,
                                     grants=((GRANTED_HOST, envelope),))])
    error = raised.value
    assert (error.code, error.retryable) == (ErrorCode.INSTALL_FAILED, False)
    assert "margo-gitops did not make it" in error.message and PASSWORD not in error.message
    assert kube.admin.get("Secret", PULL_SECRET, taken)["data"] == {
        "note": base64.b64encode(b"theirs").decode()}
    assert driver.installed() == []  # refused before Helm touched anything
    # Without grants, a step leaves it alone too.
    converge(driver, [deployment(chart, "one", namespace=taken)])
    assert kube.admin.find("Secret", PULL_SECRET, taken) is not None


# --------------------------------------------------------------------------- real nodes

# A Deployment the kubelet probes (GET / on 8080); its image comes from `image`.
REAL_DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: "{{ .Release.Name }}"}
spec:
  replicas: 1
  selector: {matchLabels: {app.kubernetes.io/instance: "{{ .Release.Name }}"}}
  template:
    metadata: {labels: {app.kubernetes.io/instance: "{{ .Release.Name }}"}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
        - name: app
          image: "{{ .Values.image }}"
          env: [{name: GREETING, value: "{{ .Values.config.greeting }}"}]
          readinessProbe:
            httpGet: {path: /, port: 8080}
            periodSeconds: 1
"""


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def push_image(host: str, repository: str, tag: str, command: tuple[str, ...],
               files: dict[str, str]) -> str:
    """An OCI image (busybox and `files`, one uncompressed layer) pushed with the
    registry's credentials; its reference."""
    layer = rootfs_tar(files)
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": list(command), "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": _digest(layer), "size": len(layer)}]}).encode()
    with httpx.Client(base_url=f"http://{host}", auth=(USER, PASSWORD), timeout=60) as http:
        for blob in (layer, config):
            started = http.post(f"/v2/{repository}/blobs/uploads/")
            started.raise_for_status()
            location = httpx.URL(started.headers["Location"])  # keeps its own query
            http.put(location.copy_add_param("digest", _digest(blob)), content=blob,
                     headers={"Content-Type": "application/octet-stream"}).raise_for_status()
        http.put(f"/v2/{repository}/manifests/{tag}", content=manifest, headers={
            "Content-Type": "application/vnd.oci.image.manifest.v1+json"}).raise_for_status()
    return f"{host}/{repository}:{tag}"


def node_namespace(nodes: RealNodes, name: str) -> int:
    """The network namespace of a real node (its init process's, PID 1 inside), opened."""
    unshare = nodes.nodes[name].process.pid
    [init, *_] = Path(f"/proc/{unshare}/task/{unshare}/children").read_text().split()
    found = os.open(f"/proc/{init}/ns/net", os.O_RDONLY)
    assert os.readlink(f"/proc/{init}/ns/net") != os.readlink("/proc/self/ns/net")
    return found


@contextlib.contextmanager
def served_in_nodes(nodes: RealNodes, port: int) -> Iterator[None]:
    """The host's 127.0.0.1:`port` served on 127.0.0.1:`port` of every real node too (a
    listener made in the node's namespace, each connection made from the host's), every
    connection closed at the end (containerd keeps its own open)."""
    host = os.open("/proc/self/ns/net", os.O_RDONLY)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="registry-relay", daemon=True)
    thread.start()
    servers: list[asyncio.Server] = []
    streams: set[asyncio.StreamWriter] = set()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        streams.add(writer)
        try:
            upstream = await connect_in(host, "127.0.0.1", port)
        except OSError:
            writer.close()
            return
        streams.add(upstream[1])
        await splice((reader, writer), upstream)

    async def serve(listener: socket.socket) -> asyncio.Server:
        return await asyncio.start_server(relay, sock=listener)

    async def stop() -> None:
        for server in servers:
            server.close()
        for writer in streams:
            writer.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        for server in servers:
            await server.wait_closed()
        for writer in streams:
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    try:
        for name in nodes.nodes:
            inside = node_namespace(nodes, name)
            try:
                listener = socket_in(inside)
            finally:
                os.close(inside)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(64)
            servers.append(asyncio.run_coroutine_threadsafe(serve(listener), loop).result(10))
        yield
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        os.close(host)


@pytest.fixture
def private_registry(tmp_path: Path) -> Iterator[str]:
    """A registry that refuses anonymous pulls (htpasswd: robot / PASSWORD)."""
    with running_registry(tmp_path / "private", users={USER: PASSWORD}) as host:
        yield host


def waiting(pod: dict[str, Any]) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return str(((statuses[0].get("state") or {}).get("waiting") or {}).get("reason", ""))


def test_a_pod_runs_on_a_real_node_only_thanks_to_the_grant(
        real_kube: RealCluster, registry: str, private_registry: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    image = push_image(private_registry, "private/greeter", "7.0.0", serve_http(
        '"private greeter says: ${GREETING:-nothing}"'), {"www/index.html": "private\n"})
    source = write_chart(tmp_path / "src", name="private-greeter")
    (source / "templates" / "deployment.yaml").write_text(REAL_DEPLOYMENT)
    values = yaml.safe_load((source / "values.yaml").read_text())
    (source / "values.yaml").write_text(yaml.safe_dump({**values, "image": image}))
    (source / "values.schema.json").unlink()
    chart = publish_chart(registry, source, repo_path="pull-secrets-real")
    key = DeviceKey.open(tmp_path / "keys" / "encryption.age")
    envelope = seal(PASSWORD, key.recipient(), mac="0" * 32)
    namespace = "pull-real"
    selector = f"app.kubernetes.io/instance={RELEASE}"

    with ChartCache(tmp_path / "cache") as cache, \
            served_in_nodes(real_kube.nodes, int(private_registry.rsplit(":", 1)[1])):
        driver = HelmDriver(cache, kubeconfig=real_kube.device_kubeconfig(), key=key)
        try:
            # Without the grant: the chart installs, and the kubelet's pull is refused.
            converge(driver, [deployment(chart, "nobody", namespace=namespace)])
            [refused] = real_kube.until("the pull refused", lambda: [
                p for p in real_kube.pods(namespace, selector)
                if waiting(p) in ("ErrImagePull", "ImagePullBackOff")], timeout=90)
            assert "imagePullSecrets" not in refused["spec"]
            refusal = refused["status"]["containerStatuses"][0]["state"]["waiting"].get(
                "message", "")
            assert "401 Unauthorized" in refusal, refusal  # the registry said no

            # With it: the new pod pulls with the release's pull secret, runs, and is
            # Ready (Helm waits for it).
            converge(driver, [deployment(chart, "Servus", namespace=namespace, wait=True,
                                         grants=((private_registry, envelope),))])
            def granted() -> list[dict[str, Any]] | None:
                pods = real_kube.pods(namespace, selector)
                running = real_kube.running_pods(namespace, selector)
                return running if len(pods) == len(running) == 1 and running[0][
                    "metadata"]["name"] != refused["metadata"]["name"] else None

            [pod] = real_kube.until("only the granted pod, running", granted, timeout=60)
            assert pod["spec"]["imagePullSecrets"] == [{"name": PULL_SECRET}]
            assert pod["status"]["containerStatuses"][0]["image"].endswith(
                "private/greeter:7.0.0")
            assert "private greeter says: Servus" in real_kube.pod_log(
                namespace, pod["metadata"]["name"])

            converge(driver, [])
            assert real_kube.admin.find("Secret", PULL_SECRET, namespace) is None
            assert pull_secret_names(real_kube, namespace) == []
        finally:
            driver.close()
    assert PASSWORD not in caplog.text
