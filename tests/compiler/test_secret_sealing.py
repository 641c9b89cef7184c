"""Secrets through the real compiler (issue 32): an intent's secret, encrypted to the fleet
key, reaches each device sealed to that device's own key, and nowhere in clear: not in the
Git objects of any branch, not in the compiler state, not in any problem. Determinism holds
(the previous envelope is kept while plaintext and keys stay), and devices without a key,
sensitive values given in clear and secrets the fleet key cannot open are located errors."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pyrage
import pytest
import yaml
from kits.fleetkit import Fleet, app, device, intent

from compiler.explain import explain_device
from compiler.secrets import FleetKey, encrypt_secret, new_identity_text, write_identity_file
from compiler.snapshot import load_snapshot
from compiler.source import load_source
from margo.errors import DocumentError
from margo.kinds import detect
from margo.sealing import EXTENSION, key_report, open_sealed, parse_sealed
from margo.validation import validate_value
from reconciler.capabilities import shape_capabilities

APP = "com-example-app"
PLAINTEXT = "s3cr3t-Pa55-for-the-db"
PARAMETERS = {
    "password": {"sensitive": True, "targets": [
        {"pointer": "db.password", "components": ["web"]},
        {"pointer": "DB_PASSWORD", "components": ["web-compose"]}]},
    "greeting": {"value": "hello", "targets": [{"pointer": "config.greeting",
                                                "components": ["web"]}]}}


def fleet_key(tmp_path: Path, name: str = "fleet.key") -> FleetKey:
    path = tmp_path / name
    write_identity_file(path, new_identity_text())
    return FleetKey.load(path)


def with_key(doc: dict[str, Any], identity: pyrage.x25519.Identity) -> dict[str, Any]:
    doc[EXTENSION] = key_report(str(identity.to_public()))
    return doc


def secret_fleet(tmp_path: Path, key: FleetKey, plaintext: str = PLAINTEXT,
                 **intent_spec: Any) -> tuple[Fleet, dict[str, pyrage.x25519.Identity]]:
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps[APP] = app(APP, parameters=PARAMETERS)
    spec = {"parameters": {"password": {"secret": encrypt_secret(plaintext, [key.recipient])}},
            **intent_spec}
    fleet.intents["db"] = intent("db", APP, **spec)
    identities = {name: pyrage.x25519.Identity.generate() for name in ("a", "b")}
    for name, identity in identities.items():
        fleet.devices[name] = with_key(device(name), identity)
    return fleet, identities


def sealed_value(fleet: Fleet, device_id: str, file: str = "db.yaml") -> str:
    document = yaml.safe_load(fleet.tree(device_id)[file])
    value: str = document["spec"]["parameters"]["password"]["value"]
    return value


def every_object(repos: Path) -> bytes:
    """Every Git object of the device store, decompressed (`git cat-file --batch`)."""
    git = repos / "fleet-state.git"
    names = subprocess.run(["git", "-C", str(git), "cat-file", "--batch-all-objects",
                            "--batch-check=%(objectname)"], check=True, capture_output=True,
                           text=True).stdout
    return subprocess.run(["git", "-C", str(git), "cat-file", "--batch"], input=names.encode(),
                          check=True, capture_output=True).stdout


def test_each_device_gets_the_secret_sealed_to_its_own_key(tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, identities = secret_fleet(tmp_path, key)
    report = fleet.compile(fleet_key=key)
    assert report.errors == []
    a, b = sealed_value(fleet, "a"), sealed_value(fleet, "b")
    assert open_sealed(a, identities["a"]) == PLAINTEXT
    assert open_sealed(b, identities["b"]) == PLAINTEXT
    with pytest.raises(Exception, match="another device key"):
        open_sealed(a, identities["b"])  # another device's key cannot open it
    # Nothing holds the plaintext: Git objects, the compiler state, the report.
    assert PLAINTEXT.encode() not in every_object(fleet.repos)
    for path in fleet.repos.rglob("*"):
        if path.is_file():
            assert PLAINTEXT.encode() not in path.read_bytes(), path
    assert PLAINTEXT not in repr(report)
    # The served document is still a valid ApplicationDeployment.
    validate_value(yaml.safe_load(fleet.tree("a")["db.yaml"]))


def test_recompiles_keep_the_envelope_until_the_plaintext_or_a_key_changes(
        tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, identities = secret_fleet(tmp_path, key)
    fleet.compile(fleet_key=key, now=1_000)
    first = fleet.tree("a")["db.yaml"]
    # Re-encrypting the same plaintext in the source (new ciphertext) changes nothing.
    fleet.intents["db"]["spec"]["parameters"]["password"]["secret"] = encrypt_secret(
        PLAINTEXT, [key.recipient])
    again = fleet.compile(fleet_key=key, now=2_000)
    assert fleet.tree("a")["db.yaml"] == first, again
    # A new plaintext: sealed anew, for both devices.
    fleet.intents["db"]["spec"]["parameters"]["password"]["secret"] = encrypt_secret(
        "another-one", [key.recipient])
    fleet.compile(fleet_key=key, now=3_000)
    assert open_sealed(sealed_value(fleet, "a"), identities["a"]) == "another-one"
    # A device's key rotated: only that device's value is sealed again.
    b_before = fleet.tree("b")["db.yaml"]
    rotated = pyrage.x25519.Identity.generate()
    fleet.devices["a"] = with_key(device("a"), rotated)
    fleet.compile(fleet_key=key, now=4_000)
    assert open_sealed(sealed_value(fleet, "a"), rotated) == "another-one"
    assert fleet.tree("b")["db.yaml"] == b_before


def test_a_device_without_a_key_gets_no_deployment_and_is_told_why(tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, _ = secret_fleet(tmp_path, key)
    fleet.devices["plain"] = device("plain")
    report = fleet.compile(fleet_key=key)
    [(device_id, problem)] = report.errors
    assert device_id == "plain"
    assert "reported no encryption key" in problem.message and "password" in problem.message
    assert "db.yaml" not in fleet.tree("plain")
    assert PLAINTEXT not in repr(report)


def test_a_sensitive_parameter_in_clear_is_a_located_error(tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, _ = secret_fleet(tmp_path, key)
    fleet.intents["db"]["spec"]["parameters"] = {"password": "in-clear"}
    report = fleet.compile(fleet_key=key)
    problems = [p for _, p in report.errors]
    assert problems and all("sensitive" in p.message for p in problems)
    assert problems[0].file is not None and problems[0].file.endswith("deployments/db.yaml")
    assert problems[0].json_path == "$.spec.parameters.password"


def test_a_secret_the_fleet_key_cannot_open_names_the_intent_not_the_value(
        tmp_path: Path) -> None:
    key, other = fleet_key(tmp_path), fleet_key(tmp_path, "other.key")
    fleet, _ = secret_fleet(tmp_path, other)  # encrypted to another fleet key
    report = fleet.compile(fleet_key=key)
    messages = {p.message for _, p in report.errors}
    assert messages and all("does not decrypt with the fleet key" in m for m in messages)
    # Without any fleet key configured.
    report = fleet.compile(fleet_key=None)
    assert any("no fleet key is configured" in p.message for _, p in report.errors)
    assert all(fleet.tree(d) == {} for d in ("a", "b"))


def test_rule_violations_on_a_secret_do_not_quote_it(tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, _ = secret_fleet(tmp_path, key, plaintext="short")
    fleet.apps[APP] = app(APP, parameters=PARAMETERS, schema=[
        {"name": "pw", "dataType": "string", "minLength": 12, "sensitive": True}],
        settings=[{"parameter": "password", "name": "Password", "schema": "pw"}])
    report = fleet.compile(fleet_key=key)
    assert report.errors
    for _, problem in report.errors:
        assert "short" not in problem.message and problem.found is None
        assert "secret value of password" in problem.message


@pytest.mark.parametrize("shape", ["oct-2024", "rc.2"])
def test_older_shapes_carry_the_envelope_too(tmp_path: Path, shape: str) -> None:
    key = fleet_key(tmp_path)
    fleet, identities = secret_fleet(tmp_path, key, outputShape=shape)
    assert fleet.compile(fleet_key=key).errors == []
    assert detect(yaml.safe_load(fleet.tree("b")["db.yaml"])).shape == shape
    assert open_sealed(sealed_value(fleet, "b"), identities["b"]) == PLAINTEXT
    parse_sealed(sealed_value(fleet, "a"))


def test_a_sensitive_parameter_with_a_default_is_refused() -> None:
    doc = app(APP, parameters={"password": {**PARAMETERS["password"], "value": "default"}})
    with pytest.raises(Exception, match="sensitive parameter has no default") as caught:
        validate_value(doc)
    assert "default" not in str(caught.value).replace("no default", "")


def granting(key: FleetKey, password: str = "robot-token-1") -> dict[str, Any]:
    return {"registryCredentials": [{
        "registry": "registry.example.com:5000", "username": "robot",
        "password": {"secret": encrypt_secret(password, [key.recipient])}}]}


def grant_of(fleet: Fleet, device_id: str) -> dict[str, Any]:
    document = yaml.safe_load(fleet.tree(device_id)["db.yaml"])
    validate_value(document)
    [grant] = document["spec"][EXTENSION]["registryCredentials"]
    return dict(grant)


def test_registry_credentials_are_granted_sealed_to_each_device(tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, identities = secret_fleet(tmp_path, key, **granting(key))
    assert fleet.compile(fleet_key=key, now=1_000).errors == []
    for name, identity in identities.items():
        grant = grant_of(fleet, name)
        assert grant["registry"] == "registry.example.com:5000"
        assert grant["username"] == "robot"
        assert open_sealed(grant["password"], identity) == "robot-token-1"
    assert b"robot-token-1" not in every_object(fleet.repos)
    # Kept while nothing changes; sealed anew when the password does.
    before = fleet.tree("a")["db.yaml"]
    fleet.intents["db"]["spec"].update(granting(key))  # same password, new ciphertext
    fleet.compile(fleet_key=key, now=2_000)
    assert fleet.tree("a")["db.yaml"] == before
    fleet.intents["db"]["spec"].update(granting(key, "robot-token-2"))
    fleet.compile(fleet_key=key, now=3_000)
    assert open_sealed(grant_of(fleet, "a")["password"], identities["a"]) == "robot-token-2"


def test_registry_grants_need_a_key_and_a_shape_that_can_carry_them(tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, _ = secret_fleet(tmp_path, key, outputShape="oct-2024", **granting(key))
    fleet.devices["plain"] = device("plain")
    report = fleet.compile(fleet_key=key)
    messages = [p.message for _, p in report.errors]
    assert any("Oct-2024 document has no place for registry credentials" in m
               for m in messages)
    assert any("plain reported no encryption key" in m and "registry registry.example.com"
               in m for m in messages)
    assert all("robot-token-1" not in m for m in messages)
    # Without outputShape each device gets its own generation's shape: an Oct-2024 device
    # cannot be given the grant (a located problem naming it), an rc.2 device can.
    del fleet.intents["db"]["spec"]["outputShape"]
    del fleet.devices["plain"]
    identity = pyrage.x25519.Identity.generate()
    fleet.devices["b"] = shape_capabilities(with_key(device("b"), identity), "rc.2")
    fleet.devices["old"] = shape_capabilities(with_key(device("old"), identity), "oct-2024")
    report = fleet.compile(fleet_key=key)
    [(device_id, problem)] = report.errors
    assert device_id == "old" and problem.path == ("spec", "registryCredentials")
    assert problem.message.startswith("on device old: an Oct-2024 document has no place for "
                                      "registry credentials"), problem.message
    assert "the device speaks oct-2024" in problem.message
    assert detect(yaml.safe_load(fleet.tree("b")["db.yaml"])).shape == "rc.2"
    assert open_sealed(grant_of(fleet, "b")["password"], identity) == "robot-token-1"


def test_a_registry_granted_twice_or_a_password_in_clear_is_refused(tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, _ = secret_fleet(tmp_path, key, **granting(key))
    grants = fleet.intents["db"]["spec"]["registryCredentials"]
    grants.append(dict(grants[0]))
    report = fleet.compile(fleet_key=key)
    assert any("granted twice" in p.message for _, p in report.errors), report.errors
    fleet.intents["db"]["spec"]["registryCredentials"] = [
        {"registry": "registry.example.com", "username": "robot", "password": "in-clear"}]
    report = fleet.compile(fleet_key=key)
    assert any(p.json_path == "$.spec.registryCredentials[0].password"
               for _, p in report.errors), report.errors


def test_explain_says_why_a_device_without_a_key_gets_nothing(tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, _ = secret_fleet(tmp_path, key)
    fleet.devices["plain"] = device("plain")
    fleet.write()
    [explanation] = explain_device(load_source(fleet.source), load_snapshot(fleet.caps),
                                   "plain", fleet_key=key)
    assert explanation.status == "error"
    assert "reported no encryption key" in explanation.problems[0].message
    [opened] = explain_device(load_source(fleet.source), load_snapshot(fleet.caps), "a",
                              fleet_key=key)
    assert opened.status == "eligible" and PLAINTEXT not in repr(opened)


def test_a_damaged_secret_is_a_located_error_found_without_any_key(tmp_path: Path) -> None:
    key = fleet_key(tmp_path)
    fleet, _ = secret_fleet(tmp_path, key)
    armored = fleet.intents["db"]["spec"]["parameters"]["password"]["secret"]
    fleet.intents["db"]["spec"]["parameters"]["password"]["secret"] = armored.replace(
        "-----END AGE ENCRYPTED FILE-----", "")
    report = fleet.compile(fleet_key=None)
    [problem] = {p.json_path: p for _, p in report.errors}.values()
    assert problem.json_path == "$.spec.parameters.password.secret"
    assert "ASCII-armored age file" in problem.message
    assert problem.file is not None and problem.line is not None


#: Official examples of each generation (the Oct-2024 one is the rc.2 example as Oct-2024
#: named its kind, which validates as Oct-2024).
EXAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "spec-examples" / "valid"
SHAPED = {"rc.3": ("ApplicationDescription-001.yaml", None),
          "rc.2": ("ApplicationDescription-helm_only.yaml", None),
          "oct-2024": ("ApplicationDescription-helm_only.yaml", "application")}


@pytest.mark.parametrize("shape", sorted(SHAPED))
def test_every_description_generation_takes_the_sensitive_flag(shape: str) -> None:
    file, kind = SHAPED[shape]
    doc = yaml.safe_load((EXAMPLES / file).read_text())
    doc["kind"] = kind or doc["kind"]
    name = sorted(doc["parameters"])[0]
    doc["parameters"][name] = {"sensitive": True,
                               "targets": doc["parameters"][name]["targets"]}
    description = validate_value(doc)
    assert str(description.shape) == shape
    assert name in description.sensitive_parameters()
    # A sensitive schema entry marks its settings' parameters, which then take no default.
    rule = doc["configuration"]["schema"][0]
    rule["sensitive"] = True
    marked = {s["parameter"] for section in doc["configuration"]["sections"]
              for s in section["settings"] if s["schema"] == rule["name"]}
    with pytest.raises(DocumentError, match="a sensitive parameter has no default value"):
        validate_value(doc)
    for parameter in marked:
        doc["parameters"][parameter].pop("value", None)
    assert marked <= validate_value(doc).sensitive_parameters()
