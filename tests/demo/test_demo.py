"""`make demo` end to end: the scripted scenario on real parts (registry, server, three
device processes), run with DEMO_EXIT=1 so it stops and reports whether every step
converged. Each step's own check is the demo's: the devices run exactly the expected
deployments, all installed, with the rendered output to prove it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

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


def test_the_demo_scenario_converges_at_every_step(tmp_path: Path) -> None:
    home = tmp_path / "demo"
    done = subprocess.run(["bash", "examples/demo.sh"], cwd=ROOT,
                          env=demo_env(home, DEMO_EXIT="1"), capture_output=True, text=True,
                          timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
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
    # What it prints is there to look at: no address of a server that stops as it returns.
    assert "?token=" not in output and "DOCKER_HOST=" not in output, output
    assert "stop with the demo (DEMO_EXIT=1)" in output, output
    stopped_cleanly(home)


def test_ctrl_c_stops_the_demo_with_every_device_converged(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the demo's whole process group: only the demo may act on
    it (its parts run in sessions of their own), stopping the devices before the server
    and the Compose box's Docker engine; a device never finds its engine gone mid-cycle."""
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
