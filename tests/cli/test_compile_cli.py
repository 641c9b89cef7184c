"""`margo compile / plan / explain` as a user runs them, on the example fleet."""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pygit2
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def margo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "margo_cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=timeout)


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[Path, Path, Path]:
    source, caps = tmp_path / "fleet", tmp_path / "caps"
    shutil.copytree(EXAMPLES / "fleet", source)
    shutil.copytree(EXAMPLES / "capabilities", caps)
    return source, caps, tmp_path / "repos"


def inputs(fleet: tuple[Path, Path, Path]) -> list[str]:
    source, caps, repos = fleet
    return ["--source", str(source), "--capabilities", str(caps), "--repos", str(repos)]


def test_compile_from_the_repository_root_as_documented(tmp_path: Path) -> None:
    result = margo("compile", "--source", "examples/fleet", "--capabilities",
                   "examples/capabilities", "--repos", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"devices": 6, "deployments": 13, "commits": 6,
                                         "unchanged": 0, "errors": []}
    again = json.loads(margo("compile", "--source", "examples/fleet", "--capabilities",
                             "examples/capabilities", "--repos", str(tmp_path),
                             "--json").stdout)
    assert (again["commits"], again["unchanged"]) == (0, 6)


def test_errors_exit_one_but_other_devices_are_committed(fleet: tuple[Path, Path, Path]) -> None:
    source, _caps, _ = fleet
    (source / "deployments" / "broken.yaml").write_text("kind: DeploymentIntent\n")
    result = margo("compile", *inputs(fleet), "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["commits"] == 6
    assert {e["message"] for e in report["errors"]} == {
        "missing required field 'apiVersion'", "missing required field 'metadata'",
        "missing required field 'spec'"}
    assert all(e["file"].endswith("deployments/broken.yaml") and e["line"] == 1
               for e in report["errors"])
    human = margo("compile", *inputs(fleet))
    assert human.returncode == 1 and "broken.yaml:1:1" in human.stderr


def test_plan_and_explain(fleet: tuple[Path, Path, Path]) -> None:
    source, _caps, _ = fleet
    assert margo("compile", *inputs(fleet)).returncode == 0
    intent = source / "deployments" / "hello-everywhere.yaml"
    intent.write_text(intent.read_text().replace("namespace: hello", "namespace: greetings"))
    plan = margo("plan", *inputs(fleet), "--json")
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)["devices"]
    assert len(planned) == 6
    assert planned[0]["changes"] == [{"file": "hello-everywhere.yaml",
                                      "intent": "hello-everywhere", "action": "update",
                                      "reasons": ["intent edited"]}]
    human = margo("plan", *inputs(fleet))
    assert "  update      hello-everywhere.yaml (intent edited)" in human.stdout
    explain = margo("explain", *inputs(fleet), "--device", "compose-box-arm64")
    assert explain.returncode == 0, explain.stderr
    assert "vision-plant-a: not targeted" in explain.stdout
    assert "line-monitor: not targeted" in explain.stdout
    as_json = json.loads(margo("explain", *inputs(fleet), "--device", "k8s-single-arm64",
                               "--intent", "vision-plant-a", "--json").stdout)
    [entry] = as_json["intents"]
    assert entry["status"] == "not targeted"
    assert entry["targeting"][0]["actual"] == "plant-b"
    missing = margo("explain", *inputs(fleet), "--device", "nope")
    assert missing.returncode == 2 and "no device 'nope'" in missing.stderr


def test_explain_shows_near_misses(fleet: tuple[Path, Path, Path]) -> None:
    source, _caps, _ = fleet
    intent = source / "deployments" / "vision-plant-a.yaml"
    intent.write_text(intent.read_text().replace("values: [plant-a]",
                                                 "values: [plant-a, plant-b]"))
    result = margo("explain", *inputs(fleet), "--device", "k8s-single-arm64",
                   "--intent", "vision-plant-a")
    assert "not eligible" in result.stdout
    assert "needs 8Gi memory, has 7.5Gi" in result.stdout
    assert "architecture in ['amd64']" in result.stdout


def test_plan_diff_shows_the_yaml_each_device_would_get(fleet: tuple[Path, Path, Path]) -> None:
    """`margo plan --diff`: a unified diff per changed file, against the branch as it is;
    a removed intent's file diffs to /dev/null; nothing is written."""
    source, _caps, repos = fleet
    assert margo("compile", *inputs(fleet)).returncode == 0
    refs_before = (repos / "fleet-state.git" / "packed-refs").read_bytes()
    intent = source / "deployments" / "hello-everywhere.yaml"
    intent.write_text(intent.read_text().replace("namespace: hello", "namespace: greetings"))
    (source / "deployments" / "line-monitor.yaml").unlink()
    human = margo("plan", *inputs(fleet), "--diff")
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    at = lines.index("    --- a/devices/compose-box-amd64/hello-everywhere.yaml")
    assert lines[at + 1] == "    +++ b/devices/compose-box-amd64/hello-everywhere.yaml"
    hunk = lines[at + 2:at + 12]
    assert "    -  namespace: hello" in hunk and "    +  namespace: greetings" in hunk
    assert any(line.endswith("+++ /dev/null") for line in lines)
    as_json = json.loads(margo("plan", *inputs(fleet), "--diff", "--json").stdout)
    diff = next(d for d in as_json["devices"] if d["device"] == "compose-box-amd64")["diff"]
    assert "-  namespace: hello" in diff and "+  namespace: greetings" in diff
    assert (repos / "fleet-state.git" / "packed-refs").read_bytes() == refs_before
    assert "diff" not in json.loads(margo("plan", *inputs(fleet), "--json").stdout)[
        "devices"][0]


def test_explain_fleet_wide_by_intent_and_by_application(
        fleet: tuple[Path, Path, Path]) -> None:
    """`--intent NAME` / `--app ID` without `--device`: every device's verdict, the failing
    clauses under it, and counts per verdict; the devices it does not target are counted,
    and listed with --all; --status lists only the verdicts named."""
    source, _caps, _ = fleet
    intent = source / "deployments" / "vision-plant-a.yaml"
    intent.write_text(intent.read_text().replace("values: [plant-a]",
                                                 "values: [plant-a, plant-b]"))
    as_json = json.loads(margo("explain", *inputs(fleet), "--intent", "vision-plant-a",
                               "--json", "--all").stdout)
    verdicts = {d["device"]: d["intents"][0]["status"] for d in as_json["devices"]}
    assert len(verdicts) == 6
    assert verdicts["k8s-single-arm64"] == "not eligible"
    assert as_json["counts"] == dict(sorted(collections.Counter(verdicts.values()).items()))
    untargeted = sorted(d for d, status in verdicts.items() if status == "not targeted")
    assert untargeted
    listed = json.loads(margo("explain", *inputs(fleet), "--intent", "vision-plant-a",
                              "--json").stdout)
    assert listed["counts"] == as_json["counts"]
    assert listed["hidden"] == len(untargeted)
    assert [d["device"] for d in listed["devices"]] == sorted(set(verdicts) - set(untargeted))
    human = margo("explain", *inputs(fleet), "--intent", "vision-plant-a")
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert lines[0].startswith("intent vision-plant-a: ")
    assert lines[-1] == f"  ({len(untargeted)} not targeted not listed; --all lists them)"
    assert not any(line.endswith(": not targeted") for line in lines)
    at = lines.index("  k8s-single-arm64: not eligible")
    assert any("needs 8Gi memory, has 7.5Gi" in line for line in lines[at + 1:at + 4])
    only = margo("explain", *inputs(fleet), "--intent", "vision-plant-a", "--status",
                 "not-targeted")
    assert [line.split(":")[0].strip() for line in only.stdout.splitlines()[1:]
            if not line.startswith("    ") and not line.startswith("  (")] == untargeted
    bad = margo("explain", *inputs(fleet), "--intent", "vision-plant-a", "--status", "ok")
    assert bad.returncode == 2 and "not-targeted" in bad.stderr
    by_app = json.loads(margo("explain", *inputs(fleet), "--app", "com-example-hello-world",
                              "--json").stdout)
    assert {i["intent"] for d in by_app["devices"] for i in d["intents"]} == {
        "hello-everywhere"}
    nothing = margo("explain", *inputs(fleet))
    assert nothing.returncode == 2 and "--device" in nothing.stderr
    unknown = margo("explain", *inputs(fleet), "--intent", "nope")
    assert unknown.returncode == 2 and "no intent 'nope'" in unknown.stderr


def test_compile_from_a_git_ref(fleet: tuple[Path, Path, Path], tmp_path: Path) -> None:
    source, caps, repos = fleet
    repo = pygit2.init_repository(str(source))
    repo.index.add_all()
    repo.index.write()
    signature = pygit2.Signature("Platform", "platform@example.com", 1_800_000_000, 0)
    tree = repo.index.write_tree()
    repo.create_commit("HEAD", signature, signature, "fleet", tree, [])
    (source / "deployments" / "line-monitor.yaml").unlink()  # not committed: ignored at a ref
    result = margo("compile", "--source", str(source), "--ref", "HEAD", "--capabilities",
                   str(caps), "--repos", str(repos), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["deployments"] == 13
    history = margo("compile", "--source", str(source), "--ref", "no-such-ref",
                    "--capabilities", str(caps), "--repos", str(repos))
    assert history.returncode == 2 and "cannot resolve 'no-such-ref'" in history.stderr


def test_watch_recompiles_after_a_change(fleet: tuple[Path, Path, Path]) -> None:
    _source, caps, _ = fleet
    with subprocess.Popen(
            [sys.executable, "-m", "margo_cli.main", "compile", *inputs(fleet), "--watch"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as process:
        try:
            assert process.stdout is not None
            lines = []
            while "watching" not in "".join(lines):
                lines.append(process.stdout.readline())
            time.sleep(0.3)
            caps_file = caps / "compose-box-amd64.json"
            doc = json.loads(caps_file.read_text())
            doc["labels"]["example.com/site"] = "plant-z"
            caps_file.write_text(json.dumps(doc))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                line = process.stdout.readline()
                lines.append(line)
                if "1 commits" in line:
                    break
            assert any("compose-box-amd64: reconfigure hello-everywhere" in line
                       for line in lines), lines
        finally:
            process.terminate()
            process.wait(timeout=10)


def test_each_watch_compile_hands_what_it_froze_back_to_the_collector(
        fleet: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """A compile freezes what it built (`compiler.gcpause`); the watch loop, which
    compiles for as long as it runs, must unfreeze after each compile, as the server does,
    or the cycles of every compile stay in memory."""
    import gc

    from margo_cli.compile_command import _compile_once, _recompile
    from margo_cli.main import build_parser

    args = build_parser().parse_args(["compile", *inputs(fleet)])
    gc.unfreeze()
    _compile_once(args, dry_run=False)
    assert gc.get_freeze_count() > 0  # what the watch loop must give back
    (fleet[1] / "compose-box-amd64.json").unlink()
    _recompile(args)
    assert gc.get_freeze_count() == 0
    assert "commits" in capsys.readouterr().out
    gc.unfreeze()


def test_plan_and_explain_say_what_waits_for_capacity(tmp_path: Path) -> None:
    """The issue's case, as a user meets it: a device of 1 core and 512Mi and three intents
    that each need exactly that."""
    from kits.fleetkit import Fleet, app, device, intent

    fleet = Fleet(tmp_path)
    fleet.apps["com-example-app"] = app(
        constraints={"capacityRequirements": {"cpu": {"cores": 1}, "memory": "512Mi"}},
        compose=False, parameters={})
    fleet.intents.update({n: intent(n) for n in ("w-one", "w-two", "w-three")})
    fleet.devices["box"] = device("box", cores=1, memory="512Mi")
    fleet.write()
    paths = ["--source", str(fleet.source), "--capabilities", str(fleet.caps),
             "--repos", str(fleet.repos)]
    plan = margo("plan", *paths)
    assert plan.returncode == 0, plan.stderr
    assert "  add         w-one.yaml (intent added)" in plan.stdout
    assert ("  note        w-two: waits for capacity: needs 1 core; the device has 1, of "
            "which 1 is assigned to w-one") in plan.stdout
    assert margo("compile", *paths).returncode == 0
    # Nothing changed: the plan still says what waits, and explain gives the numbers.
    again = margo("plan", *paths)
    assert "  note        w-three, w-two: wait for capacity (margo explain --device box " \
           "says why)" in again.stdout
    explain = json.loads(margo("explain", *paths, "--device", "box", "--json").stdout)
    states = {e["intent"]: (e["status"], [f["message"] for f in e["capacity"]])
              for e in explain["intents"]}
    assert states["w-one"] == ("eligible", [])
    assert states["w-two"][0] == "waiting for capacity"
    assert states["w-two"][1][0] == ("needs 1 core; the device has 1, of which 1 is "
                                     "assigned to w-one")
