"""`make demo` end to end: the scripted scenario on real parts (registry, server, three
device processes), run with DEMO_EXIT=1 so it stops and reports whether every step
converged. Each step's own check is the demo's: the devices run exactly the expected
deployments, all installed, with the rendered output to prove it."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = [
    "Hello World installed on all three devices",
    "Vision Inference on the GPU cluster only",
    "every Kubernetes device renders hello-world 1.1.0",
    "the new greeting rendered everywhere",
    "Vision Inference removed after its 5 s grace period",
    "Vision Inference installed again",
    "Hello World removed from every device",
]


def demo_env(home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "DEMO_DIR": str(home), **extra,
            "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}


def readme_excerpt() -> list[str]:
    """The lines of the demo's output that README.md quotes."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```\n(== 2\. .*?)```", readme, re.S)
    assert block is not None, "README.md quotes no demo output"
    return block.group(1).splitlines()


def stopped_cleanly(home: Path) -> None:
    """Every device's last cycle converged, and the server logged nothing above INFO."""
    for log in sorted((home / "devices").glob("*/device.log")):
        cycles = [line for line in log.read_text().splitlines() if "converged;" in line]
        assert cycles and cycles[-1].startswith("converged;"), (log, log.read_text()[-2000:])
    server = (home / "server.log").read_text()
    assert not re.search(r" (WARNING|ERROR|CRITICAL) ", server), server


def scenario_converged(output: str, home: Path) -> None:
    """Every step of the scenario converged, and the output says what README.md quotes."""
    for expected in STEPS:
        assert f"converged: {expected}" in output, output
    assert "NOT CONVERGED" not in output and "Every step converged." in output
    # The Compose box ran real containers (the suite's machines can start a Docker engine).
    assert "compose driver, real containers on a private Docker engine" in output, output
    # margo explain says why the single-node box cannot run the GPU application, as the
    # README quotes it.
    assert "vision: not eligible" in output and "/peripherals ContainsAll" in output
    lines = output.splitlines()
    assert all(line in lines for line in readme_excerpt()), output
    # The GPU cluster's repository tells the story, one commit per change.
    story = [line.strip().split(" ", 2)[2] for line in output.split("repository tells it")[1]
             .split("== Where to look")[0].strip().splitlines()]
    # (An empty first commit when the device reported before the first intent was pushed.)
    story = [line for line in story if line != "initial desired state (nothing to deploy)"]
    assert story == ["add hello-everywhere", "add vision", "update hello-everywhere",
                     "reconfigure hello-everywhere", "remove vision", "add vision",
                     "remove hello-everywhere"], story
    # Everything lives under the demo directory.
    assert (home / "wfm" / "wfm.sqlite").exists()
    assert (home / "devices" / "edge-gpu-cluster" / "rendered" / ".ledger.json").exists()


def test_the_scenario_converges_at_every_step_and_ctrl_c_stops_every_part(
        tmp_path: Path) -> None:
    """`make demo` as a person runs it: the scenario, then serving until Ctrl-C. A
    terminal's Ctrl-C reaches the demo's whole process group: only the demo may act on it
    (its parts run in sessions of their own), stopping the devices before the server and
    the Compose box's Docker engine; a device never finds its engine gone mid-cycle. (One
    run for both: the scenario is the half minute of the test.)"""
    home = tmp_path / "demo"
    out = tmp_path / "demo.out"
    with open(out, "w") as sink:
        demo = subprocess.Popen(["bash", "examples/demo.sh"], cwd=ROOT, env=demo_env(home),
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while "Serving until interrupted" not in out.read_text():
            assert demo.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.5)
        scenario_converged(out.read_text(), home)
        engine = re.search(r"DOCKER_HOST=unix://(\S+)/docker.sock", out.read_text())
        assert engine is not None, out.read_text()
        time.sleep(2.5)  # mid-way through the devices' cycles (every second)
        os.killpg(demo.pid, signal.SIGINT)
        assert demo.wait(timeout=120) == 0, out.read_text()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGTERM)
            demo.wait(timeout=60)
    assert "Stopping." in out.read_text()
    stopped_cleanly(home)
    assert not Path(engine.group(1)).exists()  # the engine's socket folder went with it


def load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo_script", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class _Engine:
    """Stands for the demo's Docker engine, of which `summary` prints only the address."""

    host: str = "unix:///tmp/demo-docker/docker.sock"


def test_with_demo_exit_the_summary_names_nothing_that_stops_with_the_demo(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DEMO_EXIT=1 (CI's way to run it) prints no address of a server or engine that
    stops as the demo returns; serving prints both. (The summary alone: the whole
    scenario runs in the test above.)"""
    demo = load_demo().Demo(tmp_path, ExitStack())
    demo.base, demo.engine, demo.compose_port = "http://127.0.0.1:1", _Engine(), 2
    demo.summary(serving=False)
    exiting = capsys.readouterr().out
    assert "?token=" not in exiting and "DOCKER_HOST=" not in exiting, exiting
    assert "stop with the demo (DEMO_EXIT=1)" in exiting
    assert "its private Docker engine stops with the demo" in exiting
    demo.summary(serving=True)
    serving = capsys.readouterr().out
    assert "?token=" in serving and f"DOCKER_HOST={_Engine.host}" in serving, serving
