"""Registry credentials the fleet grants to a deployment, on the device, against a real OCI
registry that requires basic authentication (`docker-registry` with htpasswd).

Each grant is sealed here as the server's compiler seals it (`margo.sealing.seal`, to the
recipient the device generated) into `spec.x-margo-gitops-extensions.registryCredentials`.
What is asserted: a chart (the render driver, in a whole device client: Git source, state,
journal) and a Compose package and its image (the Compose driver on the real Docker engine)
are pulled only thanks to the grant, and the same deployment without it fails with
PULL_FAILED; a grant serves only the deployment carrying it; the device's own configuration
wins for a host it names; the same password sealed again redeploys nothing; a tampered
grant fails the step with SECRET_UNREADABLE and the previous release stays; and the
password is nowhere the device keeps or says anything (data directory, journal, logs,
cycle results, error messages: byte searches), nor left in a temporary file.
"""

from __future__ import annotations

import logging
import secrets
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pyrage
import pytest
import yaml
from kits.chartkit import write_chart
from kits.dockerkit import (
    DockerEngine,
    ImageSet,
    clear_engine,
    compose_package,
    inspect,
    web_service,
)
from kits.gitbox import Box, found_anywhere, git_box, tampered
from kits.registrykit import running_registry

from margo.sealing import seal
from reconciler.assembly import open_reconciler
from reconciler.charts import ChartCache
from reconciler.config import load_config
from reconciler.desired import DesiredDeployment, parse_deployment
from reconciler.drivers.compose import ComposeDriver
from reconciler.encryption_key import DeviceKey
from reconciler.errors import ApplyError, ErrorCode
from reconciler.oci import OciClient
from reconciler.planner import plan
from reconciler.registry_credentials import RegistryCredential, docker_config_text, with_granted
from reconciler.registry_grants import open_grants, parse_grants
from reconciler.runner import CycleResult
from reconciler.state import DeviceState

USER = "robot"
#: The registry's one password: what no file, log line or message may ever hold.
PASSWORD = f"grant-{secrets.token_hex(12)}"
DEVICE = "grant-box"
FIRST = "7d1c2b3a-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
SECOND = "0b9e8d7c-6f5a-4b3c-9d2e-1f0a9b8c7d6e"
EXTENSION = "x-margo-gitops-extensions"


@pytest.fixture(scope="module")
def private_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry that refuses anonymous pulls (htpasswd: robot / PASSWORD)."""
    with running_registry(tmp_path_factory.mktemp("private"),
                          users={USER: PASSWORD}) as host:
        yield host


def grants(host: str, envelope: str) -> dict[str, Any]:
    return {EXTENSION: {"registryCredentials": [
        {"registry": host, "username": USER, "password": envelope}]}}


def temporary_configs() -> set[Path]:
    """The private credential folders the device makes (and must remove) in the temp dir."""
    root = Path(tempfile.gettempdir())
    return {*root.glob("margo-helm-registry-*"), *root.glob("margo-docker-config-*")}


def push_chart(host: str, root: Path, name: str, repo_path: str = "private") -> str:
    """Package a greeter chart called `name` and push it with the registry's credentials."""
    scratch = root / f"push-{repo_path}-{name}"
    scratch.mkdir(parents=True)
    config = scratch / "config.json"
    config.write_text(docker_config_text([], {host: (USER, PASSWORD)}))
    archive = helm.package(write_chart(scratch, name=name), destination=scratch)
    with helm.RegistryClient(plain_http=True, credentials_file=config) as client:
        helm.push(archive, f"oci://{host}/{repo_path}", client=client, plain_http=True)
    return f"oci://{host}/{repo_path}/{name}"


def helm_document(deployment_id: str, repository: str, greeting: str,
                  spec_extra: dict[str, Any] | None = None, *, rc2: bool = False) -> bytes:
    spec: dict[str, Any] = {"deploymentProfile": {"type": "helm", "components": [
        {"name": "greeter", "properties": {"repository": repository, "revision": "1.0.0",
                                           "wait": False}}]},
        "parameters": {"greeting": {"value": greeting, "targets": [
            {"pointer": "config.greeting", "components": ["greeter"]}]}},
        **(spec_extra or {})}
    if rc2:  # rc.2: apiVersion/kind, the application id an annotation, no deviceId
        return yaml.safe_dump({
            "apiVersion": "application.margo.org/v1alpha1", "kind": "ApplicationDeployment",
            "id": deployment_id, "metadata": {
                "name": f"app-{deployment_id[:4]}", "namespace": "edge",
                "annotations": {"applicationId": "com-example-greeter"}},
            "spec": spec}, sort_keys=False).encode()
    return yaml.safe_dump({
        "id": deployment_id,
        "metadata": {"name": f"app-{deployment_id[:4]}", "namespace": "edge",
                     "deviceId": DEVICE},
        "spec": {"applicationId": "com-example-greeter", **spec}}, sort_keys=False).encode()


# --------------------------------------------------------------------------- reading, opening


def test_grants_are_read_from_rc3_and_rc2_documents_and_stay_sealed(tmp_path: Path) -> None:
    key = DeviceKey.open(tmp_path / "keys" / "encryption.age")
    envelope = seal(PASSWORD, key.recipient(), mac="0" * 32)
    host = "registry.example.com:5000"
    plain = parse_deployment(helm_document(FIRST, "oci://r.example/c/greeter", "Hi"))
    assert plain.registry_grants == () and plain.components[0].sealed_digest == ""
    for rc2 in (False, True):
        granted = parse_deployment(helm_document(FIRST, "oci://r.example/c/greeter", "Hi",
                                                 grants(host, envelope), rc2=rc2))
        [grant] = granted.registry_grants
        assert (grant.registry, grant.username, grant.password) == (host, USER, envelope)
        assert envelope not in repr(granted.registry_grants)
        # A grant is a reconfigure (values_digest), not an upgrade; in the retry key too.
        [component], [before] = granted.components, plain.components
        assert component.spec_digest == before.spec_digest
        assert component.values_digest != before.values_digest
        assert component.sealed_digest
    first = parse_deployment(helm_document(FIRST, "oci://r.example/c/greeter", "Hi",
                                           grants(host, envelope)))
    # Sealed again (a new ciphertext, the same mac): the planner sees no change ...
    again = parse_deployment(helm_document(FIRST, "oci://r.example/c/greeter", "Hi", grants(
        host, seal(PASSWORD, key.recipient(), mac="0" * 32))))
    assert again.components[0].values_digest == first.components[0].values_digest
    # ... a new password (another mac) is a reconfigure.
    changed = parse_deployment(helm_document(FIRST, "oci://r.example/c/greeter", "Hi", grants(
        host, seal("another", key.recipient(), mac="9" * 32))))
    assert changed.components[0].values_digest != first.components[0].values_digest

    # What the device cannot use is refused with the document, never quoting a password.
    clear = {"registry": host, "username": USER, "password": PASSWORD}
    for bad, words in [("nope", "must be a list"),
                       ([{**clear, "registry": "not a host"}], "registry host[:port]"),
                       ([{**clear, "username": ""}], "username"),
                       ([clear], "not sealed"),
                       ([{**clear, "password": envelope}] * 2, "granted twice")]:
        with pytest.raises(ValueError, match="registryCredentials") as raised:
            parse_grants({EXTENSION: {"registryCredentials": bad}}, file="doc.yaml")
        assert words in str(raised.value) and PASSWORD not in str(raised.value)


def test_opening_grants_precedence_and_redaction(tmp_path: Path) -> None:
    key = DeviceKey.open(tmp_path / "keys" / "encryption.age")
    envelope = seal(PASSWORD, key.recipient(), mac="0" * 32)
    [grant] = parse_grants(grants("r.example", envelope), file="doc.yaml")
    opened = open_grants([grant], key, deployment="web")
    assert opened.credentials == {"r.example": (USER, PASSWORD)}
    assert PASSWORD not in repr(opened)
    # The device's own credentials win for a host they name; grants add the others.
    assert with_granted({"r.example": ("own", "pw")}, {"r.example": (USER, PASSWORD),
                                                       "other.example": (USER, "x")}) == {
        "r.example": ("own", "pw"), "other.example": (USER, "x")}
    # Messages lose the password, alone or as the base64 of `user:password` (config.json).
    token = docker_config_text([], opened.credentials).split('"auth": "')[1].split('"')[0]
    with pytest.raises(ApplyError) as raised, opened.redacting():
        raise ApplyError(ErrorCode.PULL_FAILED, f"refused {PASSWORD} ({token})")
    assert raised.value.message == "refused <sealed value> (<sealed value>)"

    stranger = str(pyrage.x25519.Identity.generate().to_public())
    for envelope_now, opener, words in [
            (tampered(envelope), key, "damaged or tampered with"),
            (seal(PASSWORD, stranger, mac="0" * 32), key, "sealed to another device key"),
            (envelope, None, "no key")]:
        [bad] = parse_grants(grants("r.example", envelope_now), file="doc.yaml")
        with pytest.raises(ApplyError) as raised:
            open_grants([bad], opener, deployment="web")
        error = raised.value
        assert (error.code, error.retryable) == (ErrorCode.SECRET_UNREADABLE, False)
        assert words in error.message and "r.example" in error.message
        assert PASSWORD not in error.message


def test_the_oci_client_and_the_chart_cache_use_a_grant_for_one_call(
        private_registry: str, tmp_path: Path) -> None:
    """The granted credential serves the call that carries it, nothing after it; the
    device's own credentials win; the chart cache's private config is gone at once."""
    host = private_registry
    chart = push_chart(host, tmp_path, "scoped")
    with OciClient(credentials={host: (USER, PASSWORD)}) as admin:
        package = compose_package(admin, f"oci://{host}/compose/scoped", "1.0.0",
                                  {"web": web_service("busybox")})
    granted = {host: (USER, PASSWORD)}
    with OciClient() as oci:
        assert oci.pull(package, "1.0.0", granted=granted).data
        with pytest.raises(ApplyError) as raised:  # the grant's token went with its call
            oci.pull(package, "1.0.0")
        assert raised.value.code == ErrorCode.PULL_FAILED
        assert "requires credentials" in raised.value.message
    with OciClient(credentials={host: (USER, "wrong")}) as oci, \
            pytest.raises(ApplyError) as raised:
        oci.pull(package, "1.0.0", granted=granted)  # the device's own credentials win
    assert raised.value.code == ErrorCode.PULL_FAILED and "refused our credentials" in \
        raised.value.message

    wrong = tmp_path / "wrong-password"
    wrong.write_text("wrong\n")
    wrong.chmod(0o600)
    before = temporary_configs()
    with ChartCache(tmp_path / "own", credentials=[RegistryCredential(host, USER, wrong)]) \
            as charts, pytest.raises(ApplyError) as raised:
        charts.fetch(chart, "1.0.0", granted=granted)
    assert raised.value.code == ErrorCode.PULL_FAILED
    with ChartCache(tmp_path / "cache") as charts:
        assert charts.load(charts.fetch(chart, "1.0.0", granted=granted)).name == "scoped"
        assert temporary_configs() == before  # removed with the fetch, not at close
    with ChartCache(tmp_path / "other") as charts, pytest.raises(ApplyError) as raised:
        charts.fetch(chart, "1.0.0")
    assert raised.value.code == ErrorCode.PULL_FAILED and PASSWORD not in str(raised.value)


# --------------------------------------------------------------------------- a whole device


class GrantBox(Box):
    """A box whose desired state is any number of deployment documents."""

    def publish(self, *documents: bytes) -> None:
        self.commit({f"deployment-{index}.yaml": data for index, data in enumerate(documents)})


def make_box(root: Path, registries: dict[str, Any] | None = None) -> GrantBox:
    return git_box(root, GrantBox, device=DEVICE, model="G-1", registries=registries)


def outcomes(result: CycleResult) -> list[tuple[str, str, str]]:
    return [(action, deployment, outcome) for action, deployment, _, outcome in result.steps]


def test_a_device_pulls_a_private_chart_only_with_its_grant(
        private_registry: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    first_chart = push_chart(private_registry, tmp_path, "greeter")
    second_chart = push_chart(private_registry, tmp_path, "greeter", repo_path="other")
    box = make_box(tmp_path)
    before = temporary_configs()
    results: list[CycleResult] = []
    with open_reconciler(load_config(box.config)) as device:
        recipient = DeviceKey.open(box.home / "data" / "keys" / "encryption.age",
                                   create=False).recipient()
        envelope = seal(PASSWORD, recipient, mac="0" * 32)

        # Without the grant: the registry refuses the pull.
        box.publish(helm_document(FIRST, first_chart, "one"))
        results.append(device.cycle())
        [(action, _, outcome)] = outcomes(results[-1])
        assert (action, outcome) == ("install", "failed: PULL_FAILED")
        assert private_registry in results[-1].failures[-1]

        # With it: tried again at once (the grant is a new retry key), pulled, rendered.
        box.publish(helm_document(FIRST, first_chart, "one", grants(private_registry,
                                                                      envelope)))
        results.append(device.cycle())
        assert [(a, o) for a, _, o in outcomes(results[-1])] == [("install", "ok")]
        assert 'greeting: "one"' in box.rendered(FIRST).read_text()

        # The same password sealed again (a new ciphertext, the same mac): nothing to do.
        box.publish(helm_document(FIRST, first_chart, "one", grants(
            private_registry, seal(PASSWORD, recipient, mac="0" * 32))))
        results.append(device.cycle())
        assert results[-1].fetched == "adopted" and outcomes(results[-1]) == []

        # A second deployment from the same registry, without a grant: the first one's
        # grant is not used for it.
        kept = helm_document(FIRST, first_chart, "one", grants(private_registry, envelope))
        box.publish(kept, helm_document(SECOND, second_chart, "two"))
        results.append(device.cycle())
        assert outcomes(results[-1]) == [("install", SECOND, "failed: PULL_FAILED")]
        assert not box.rendered(SECOND).exists()

        # Tampered with (and a new greeting, so there is a step): SECRET_UNREADABLE before
        # anything is written, the previous render kept; tried again once the grant is whole.
        box.publish(helm_document(FIRST, first_chart, "three", grants(
            private_registry, tampered(seal(PASSWORD, recipient, mac="0" * 32)))))
        results.append(device.cycle())
        assert [(a, o) for a, _, o in outcomes(results[-1])] == [
            ("reconfigure", "failed: SECRET_UNREADABLE")]
        assert "damaged or tampered with" in results[-1].failures[-1]
        assert private_registry in results[-1].failures[-1]
        assert 'greeting: "one"' in box.rendered(FIRST).read_text()
        box.publish(helm_document(FIRST, first_chart, "three", grants(private_registry,
                                                                        envelope)))
        results.append(device.cycle())
        assert [(a, o) for a, _, o in outcomes(results[-1])] == [("reconfigure", "ok")]
        assert 'greeting: "three"' in box.rendered(FIRST).read_text()

    with DeviceState(box.home / "data" / "device-state.sqlite") as state:
        journal = b"\n".join(entry.body for entry in state.pending(1000))
    assert ErrorCode.SECRET_UNREADABLE.encode() in journal
    assert ErrorCode.PULL_FAILED.encode() in journal
    # The envelopes are kept (the search sees them), the password nowhere.
    assert found_anywhere(box.home / "data", ["margo-sealed:v1:"])
    assert found_anywhere(box.home, [PASSWORD]) == []
    assert PASSWORD not in caplog.text
    assert [r for r in results if PASSWORD in str(r)] == []
    assert temporary_configs() == before


def test_the_devices_own_credentials_win_over_a_grant(private_registry: str,
                                                      tmp_path: Path) -> None:
    chart = push_chart(private_registry, tmp_path, "greeter", repo_path="precedence")
    for case, password, granted in [("own wrong", "wrong", PASSWORD),
                                    ("own right", PASSWORD, "wrong")]:
        root = tmp_path / case.replace(" ", "-")
        root.mkdir()
        (root / "password").write_text(password + "\n")
        (root / "password").chmod(0o600)
        box = make_box(root, {private_registry: {"username": USER,
                                                 "passwordFile": str(root / "password")}})
        with open_reconciler(load_config(box.config)) as device:
            recipient = DeviceKey.open(box.home / "data" / "keys" / "encryption.age",
                                       create=False).recipient()
            box.publish(helm_document(FIRST, chart, "hi", grants(
                private_registry, seal(granted, recipient, mac="0" * 32))))
            result = device.cycle()
        [(_, _, outcome)] = outcomes(result)
        assert outcome == ("failed: PULL_FAILED" if case == "own wrong" else "ok"), case


# --------------------------------------------------------------------------- Compose


@pytest.fixture
def engine(docker_engine: DockerEngine, test_images: ImageSet) -> Iterator[DockerEngine]:
    yield docker_engine
    clear_engine(docker_engine)


def compose_document(repository: str, greeting: str,
                     spec_extra: dict[str, Any] | None = None) -> DesiredDeployment:
    return parse_deployment(yaml.safe_dump({
        "id": FIRST,
        "metadata": {"name": "web", "namespace": "web", "deviceId": DEVICE},
        "spec": {"applicationId": "com-example-web", "deploymentProfile": {
            "type": "compose", "components": [{"name": "web", "properties": {
                "repository": repository, "revision": "1.0.0", "wait": True,
                "timeout": "0m30s"}}]},
            "parameters": {"greeting": {"value": greeting, "targets": [
                {"pointer": "GREETING", "components": ["web"]}]}},
            **(spec_extra or {})}}).encode())


def converge(driver: ComposeDriver, deployment: DesiredDeployment) -> list[str]:
    the_plan = plan([deployment], driver.installed())
    for step in the_plan.changes:
        driver.apply(step, deployment)
        driver.confirm(step, deployment)
    return [str(step.action) for step in the_plan.changes]


def push_private_image(engine: DockerEngine, source: str, target: str, config: Path) -> None:
    """Tag `source` as `target` and push it with the registry's credentials, logged in
    only in `config` (never the user's own Docker config), then drop both from the engine."""
    env = engine.env({"DOCKER_CONFIG": str(config)})
    for argv, stdin in ((["pull", source], None), (["tag", source, target], None),
                        (["login", "-u", USER, "--password-stdin", target.split("/")[0]],
                         PASSWORD.encode()), (["push", target], None),
                        (["rmi", target, source], None)):
        done = subprocess.run([engine.docker, *argv], env=env, input=stdin,
                              capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-800:]


def test_a_compose_package_and_its_image_only_with_the_grant(
        engine: DockerEngine, test_images: ImageSet, private_registry: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    image = f"{private_registry}/margo-grants/web:1.0"
    push_private_image(engine, test_images.web_1, image, tmp_path / "pusher")
    with OciClient(credentials={private_registry: (USER, PASSWORD)}) as admin:
        repository = compose_package(admin, f"oci://{private_registry}/compose/granted",
                                     "1.0.0", {"web": web_service(image)})
    key = DeviceKey.open(tmp_path / "keys" / "encryption.age")
    envelope = seal(PASSWORD, key.recipient(), mac="0" * 32)
    before = temporary_configs()
    messages: list[str] = []
    try:
        with OciClient(timeout=10.0) as oci:
            driver = ComposeDriver(tmp_path / "work", oci, docker=engine.docker,
                                   compose=engine.compose, docker_host=engine.host,
                                   grace_seconds=5.0, command_timeout=60.0, key=key)
            # Without the grant: the package pull is refused.
            with pytest.raises(ApplyError) as raised:
                converge(driver, compose_document(repository, "one"))
            assert raised.value.code == ErrorCode.PULL_FAILED
            assert private_registry in raised.value.message
            messages.append(raised.value.message)

            # With it: the package (our OCI client) and the image (the engine, through a
            # private DOCKER_CONFIG) are pulled; the container runs the private image.
            granted = grants(private_registry, envelope)
            assert converge(driver, compose_document(repository, "one", granted)) == [
                "install"]
            [container] = engine.text("ps", "-q", "--filter",
                                      f"ancestor={image}").split()
            assert inspect(engine, container)["State"]["Health"]["Status"] == "healthy"

            # Sealed again, the same password: nothing to do.
            assert converge(driver, compose_document(repository, "one", grants(
                private_registry, seal(PASSWORD, key.recipient(), mac="0" * 32)))) == []

            # Tampered with: SECRET_UNREADABLE before the engine is touched.
            with pytest.raises(ApplyError) as raised:
                converge(driver, compose_document(repository, "two", grants(
                    private_registry, tampered(envelope))))
            assert (raised.value.code, raised.value.retryable) == (
                ErrorCode.SECRET_UNREADABLE, False)
            messages.append(raised.value.message)
            assert engine.text("ps", "-q", "--filter", f"ancestor={image}").split() == [
                container]
    finally:
        engine.run("rmi", "-f", image, check=False)
    assert found_anywhere(tmp_path / "work", [PASSWORD]) == []
    assert [m for m in messages if PASSWORD in m] == []
    assert PASSWORD not in caplog.text
    assert temporary_configs() == before
