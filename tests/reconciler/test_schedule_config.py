"""Polling windows, downtime and the device configuration file."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from margo.errors import DocumentError
from reconciler.config import load_config
from reconciler.schedule import Schedule, parse_window


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_daily_and_weekday_windows() -> None:
    work = parse_window("Mon-Fri 08:00-18:00")
    assert work.contains(at("2026-11-30T08:00"))  # a Monday
    assert not work.contains(at("2026-11-30T18:00"))
    assert not work.contains(at("2026-11-29T12:00"))  # a Sunday
    night = parse_window("22:00-06:00")
    assert night.contains(at("2026-11-30T23:30")) and night.contains(at("2026-12-01T05:59"))
    assert not night.contains(at("2026-11-30T12:00"))
    weekend_night = parse_window("Sat 22:00-02:00")
    assert weekend_night.contains(at("2026-12-06T01:00"))  # Sunday 01:00, started Saturday
    assert not weekend_night.contains(at("2026-12-07T01:00"))  # Monday 01:00
    assert parse_window("Fri-Mon 00:00-24:00").days == frozenset({4, 5, 6, 0})


@pytest.mark.parametrize("bad", ["8-18", "25:00-26:00", "08:00-08:00", "Funday 08:00-09:00",
                                 "08:60-09:00", "2026-12-24T00:00Z/2026-12-23T00:00Z"])
def test_bad_windows_say_what_is_wrong(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_window(bad, one_off=True)


def test_one_off_windows_are_downtime_only() -> None:
    with pytest.raises(ValueError, match="downtime"):
        parse_window("2026-12-24T00:00:00Z/2026-12-27T00:00:00Z")
    window = parse_window("2026-12-24T00:00:00Z/2026-12-27T00:00:00Z", one_off=True)
    assert window.contains(at("2026-12-25T10:00"))


def test_schedule_contact_rules_and_next_check() -> None:
    schedule = Schedule(interval=60, polling=(parse_window("06:00-22:00"),),
                        downtime=(parse_window("Sun 00:00-24:00"),))
    assert schedule.may_contact(at("2026-11-30T10:00"))
    assert not schedule.may_contact(at("2026-11-30T23:00"))  # outside the polling hours
    assert not schedule.may_contact(at("2026-11-29T10:00"))  # Sunday downtime
    assert schedule.next_check(at("2026-11-30T10:00")) == at("2026-11-30T10:01")
    assert schedule.next_check(at("2026-11-30T21:59:30")) == at("2026-12-01T06:00")
    assert schedule.next_check(at("2026-11-28T21:59:30")) == at("2026-11-30T06:00")


def test_time_zones_apply_to_recurring_windows() -> None:
    berlin = Schedule(polling=(parse_window("08:00-09:00"),), timezone="Europe/Berlin")
    assert berlin.may_contact(at("2026-11-30T07:30"))  # 08:30 in Berlin (UTC+1)
    assert not berlin.may_contact(at("2026-11-30T08:30"))


def test_never_allowed_schedule_still_returns_a_time() -> None:
    schedule = Schedule(interval=5, downtime=(parse_window("00:00-24:00"),))
    start = at("2026-11-30T10:00")
    assert schedule.next_check(start) == start + timedelta(seconds=5)


GOOD = """\
device: {id: edge-01}
server: {url: "http://127.0.0.1:8080", clientId: site-a, tokenFile: token}
source: {type: margo-rest}
driver: {type: render}
dataDir: data
schedule:
  interval: 45s
  pollingWindows: ["06:00-22:00"]
  downtime: ["Sun 00:00-06:00", "2026-12-24T00:00:00Z/2026-12-27T00:00:00Z"]
  timezone: Europe/Berlin
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "device.yaml"
    path.write_text(text)
    (tmp_path / "token").write_text("secret\n")
    return path


def test_a_good_config_resolves_paths_and_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    assert config.api == "rc.3" and config.source == "margo-rest"
    assert config.data_dir == tmp_path / "data"
    assert config.output_dir == tmp_path / "data" / "rendered"
    assert config.token() == "secret"
    assert config.schedule.interval == 45 and config.schedule.timezone == "Europe/Berlin"
    assert len(config.schedule.downtime) == 2


def test_git_config_defaults(tmp_path: Path) -> None:
    text = GOOD.replace("{type: margo-rest}", "{type: git}")
    config = load_config(write(tmp_path, text))
    assert config.api == "oct-2024"
    assert config.git_url == "http://127.0.0.1:8080/git/devices/edge-01.git"


@pytest.mark.parametrize(("driver", "default"), [("render", "repair"), ("compose", "repair"),
                                                 ("helm", "warn")])
def test_every_driver_takes_the_drift_policy_with_its_own_default(
        tmp_path: Path, driver: str, default: str) -> None:
    text = GOOD.replace("{type: render}", f"{{type: {driver}}}")
    assert load_config(write(tmp_path, text)).drift_detection == default
    for policy in ("off", "warn", "repair"):
        chosen = text.replace(f"{{type: {driver}}}",
                              f"{{type: {driver}, driftDetection: {policy}}}")
        assert load_config(write(tmp_path, chosen)).drift_detection == policy
    with pytest.raises(DocumentError) as caught:
        load_config(write(tmp_path, text.replace(f"{{type: {driver}}}",
                                                 f"{{type: {driver}, driftDetection: fix}}")))
    assert any("$.driver.driftDetection" in p.format() for p in caught.value.problems)


@pytest.mark.parametrize(("change", "where"), [
    (("{type: render}", "{type: podman}"), "$.driver.type"),
    (("interval: 45s", "interval: soon"), "$.schedule.interval"),
    (("06:00-22:00", "6 to 10"), "$.schedule.pollingWindows[0]"),
    (("Europe/Berlin", "Mars/Olympus"), "$.schedule.timezone"),
    (("{type: margo-rest}", "{type: git}\n  # \n"), None),
    (("clientId: site-a, ", ""), "$.server"),
    (("dataDir: data", "dataDir: data\nsurprise: 1"), "$"),
])
def test_bad_configs_are_located(tmp_path: Path, change: tuple[str, str],
                                 where: str | None) -> None:
    text = GOOD.replace(*change)
    if where is None:  # git source with an explicit rc.3 API cannot report status
        text = text.replace('clientId: site-a', 'api: rc.3, clientId: site-a')
        where = "$.server.api"
    with pytest.raises(DocumentError) as caught:
        load_config(write(tmp_path, text))
    formatted = [p.format() for p in caught.value.problems]
    assert any(f": {where}" in line and "device.yaml:" in line for line in formatted), formatted
    assert all(":0:0:" not in line for line in formatted), formatted


COMPOSE = GOOD.replace("driver: {type: render}", """\
driver: {type: compose, compose: bin/docker-compose, dockerHost: "unix:///run/edge.sock"}
registries:
  "127.0.0.1:5000": {username: deployer, passwordFile: secrets/registry}
  registry.example.com: {usernameFile: secrets/user, passwordFile: secrets/example}""")


def compose_home(tmp_path: Path, *, mode: int = 0o600) -> Path:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "docker-compose").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "docker-compose").chmod(0o755)
    (tmp_path / "secrets").mkdir()
    for name, text in (("registry", "pw-one\n"), ("example", "pw-two"), ("user", "robot\n")):
        (tmp_path / "secrets" / name).write_text(text)
        (tmp_path / "secrets" / name).chmod(mode)
    return write(tmp_path, COMPOSE)


def test_compose_cli_engine_and_registry_credentials(tmp_path: Path) -> None:
    config = load_config(compose_home(tmp_path))
    assert config.compose == str(tmp_path / "bin" / "docker-compose")
    assert config.docker_host == "unix:///run/edge.sock"
    local, example = config.registry_credentials
    assert (local.registry, local.username, local.password()) == (
        "127.0.0.1:5000", "deployer", "pw-one")
    assert (example.registry, example.username, example.password()) == (
        "registry.example.com", "robot", "pw-two")
    assert "pw-one" not in repr(config) and "pw-two" not in repr(config)
    assert load_config(write(tmp_path, GOOD.replace("{type: render}", "{type: compose}"))
                       ).compose == "auto"


@pytest.mark.parametrize(("change", "where", "words"), [
    (("compose: bin/docker-compose", "compose: bin/nothing"), "$.driver.compose",
     "not an executable file"),
    (('dockerHost: "unix:///run/edge.sock"', "dockerHost: /run/edge.sock"), "$.driver.dockerHost",
     "expected a string matching"),
    (("{type: compose,", "{type: render,"), "$.driver.compose",
     "only the compose driver takes this setting"),
    (("username: deployer, ", ""), "$.registries['127.0.0.1:5000']", ""),
    (('"127.0.0.1:5000":', '"not a host/x":'), "$.registries", ""),
    (("passwordFile: secrets/registry", "password: inline-secret"),
     "$.registries['127.0.0.1:5000']", ""),
])
def test_bad_compose_and_registry_settings_are_located(tmp_path: Path, change: tuple[str, str],
                                                       where: str, words: str) -> None:
    path = compose_home(tmp_path)
    path.write_text(COMPOSE.replace(*change))
    with pytest.raises(DocumentError) as caught:
        load_config(path)
    formatted = [p.format() for p in caught.value.problems]
    assert any(where in line and words in line and "device.yaml:" in line
               for line in formatted), formatted
    assert not any("inline-secret" in line for line in formatted), formatted


def test_a_password_file_others_can_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DocumentError) as caught:
        load_config(compose_home(tmp_path, mode=0o644))
    [problem, _other] = [p.format() for p in caught.value.problems]
    assert "$.registries['127.0.0.1:5000'].passwordFile" in problem
    assert "mode 0644" in problem and "chmod 600" in problem
    assert "pw-one" not in problem
