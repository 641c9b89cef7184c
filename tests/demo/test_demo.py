"""`make demo` end to end: the scripted scenario on real parts (registry, server, three
device processes), run with DEMO_EXIT=1 so it stops and reports whether every step
converged. Each step's own check is the demo's: the devices run exactly the expected
deployments, all installed, with the rendered output to prove it."""

from __future__ import annotations

import os
import subprocess
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


def test_the_demo_scenario_converges_at_every_step(tmp_path: Path) -> None:
    home = tmp_path / "demo"
    env = {**os.environ, "DEMO_EXIT": "1", "DEMO_DIR": str(home),
           "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "examples/demo.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for expected in STEPS:
        assert f"converged: {expected}" in output, output
    assert "NOT CONVERGED" not in output and "Every step converged." in output
    # The Compose box ran real containers (the suite's machines can start a Docker engine).
    assert "compose driver, real containers on a private Docker engine" in output, output
    # margo explain says why the single-node box cannot run the GPU application.
    assert "vision: not eligible" in output and "/peripherals ContainsAll" in output
    # The GPU cluster's repository tells the story, one commit per change.
    story = [line.strip().split(" ", 2)[2] for line in output.split("repository tells it")[1]
             .split("== Where to look")[0].strip().splitlines()]
    assert story == ["add hello-everywhere", "add vision", "update hello-everywhere",
                     "reconfigure hello-everywhere", "remove vision", "add vision",
                     "remove hello-everywhere"], story
    # Everything lives under the demo directory.
    assert (home / "wfm" / "wfm.sqlite").exists()
    assert (home / "devices" / "edge-gpu-cluster" / "rendered" / ".ledger.json").exists()
