"""`make demo`: the whole loop on one machine, with real parts.

A local OCI registry (Debian's docker-registry) gets the example charts and Compose package;
`margo serve` hosts the fleet source (a Git repository the demo pushes to) and compiles it;
three devices run `margo device run`: a single-node Kubernetes box without GPU and a
three-node cluster with an NVIDIA GPU node (simulated: the `render` driver, the real Helm
engine writing manifests to disk), and a Compose box that runs real containers on a private
Docker engine (tools/docker, with a busybox image built here) when one can be started, and
otherwise says so and renders too. A scripted scenario then changes the fleet source one
commit at a time and waits until every device has converged, printing what each runs.

Everything lives under one directory (default `.demo/`, or `$DEMO_DIR`). At the end the demo
prints the dashboard URL and keeps serving until interrupted, then stops its parts in order;
with `DEMO_EXIT=1` it stops them right after the scenario instead (and says so rather than
print addresses that are about to go) and exits 0 only if every step converged as expected.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import yaml

from margo.archive import deterministic_targz
from reconciler.oci import OciClient
from tools.docker.dockerengine import DockerEngine, running_engine, why_unavailable
from tools.docker.testimages import greeter_image, push_image
from tools.polling import poll_until
from tools.processes import die_with_parent

ROOT = Path(__file__).resolve().parents[1]

EXAMPLES = ROOT / "examples"
EXAMPLE_REGISTRY = "127.0.0.1:5000"
MARGO = [sys.executable, "-m", "margo_cli.main"]
DEVICES = {
    # device id: (example capabilities, source, API generation)
    "edge-single": ("k8s-single-amd64", "margo-rest", "rc.3"),
    "edge-gpu-cluster": ("k8s-cluster-gpu", "margo-rest", "rc.3"),
    "edge-compose": ("compose-box-amd64", "git", "oct-2024"),
}
GPU_DEVICE = "edge-gpu-cluster"
#: How the demo starts its parts: in a session of their own, so a Ctrl-C reaches only the
#: demo, which then stops them in order (devices, server, Docker engine, registry) rather
#: than all at once (a device mid-cycle would find its engine gone); each gets SIGTERM if
#: the demo dies without stopping them.
BACKGROUND: dict[str, Any] = {"start_new_session": True, "preexec_fn": die_with_parent}
BOLD, DIM, RESET = ("\033[1m", "\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "", "")


def say(text: str = "") -> None:
    print(text, flush=True)


def step(text: str) -> None:
    say(f"\n{BOLD}== {text}{RESET}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(*args: str | Path, cwd: Path = ROOT, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          check=check, timeout=120, env=env)


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = 60) -> Any:
    return poll_until(what, predicate, timeout=timeout, interval=0.25)


# --- the parts ----------------------------------------------------------------------------


@contextmanager
def registry(home: Path) -> Iterator[str]:
    """A real OCI registry on loopback (CNCF distribution, from Debian)."""
    binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    port = free_port()
    home.mkdir(parents=True)
    config = home / "config.yml"
    config.write_text(yaml.safe_dump({
        "version": 0.1, "log": {"level": "error"},
        "storage": {"filesystem": {"rootdirectory": str(home / "storage")},
                    "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"}}))
    with open(home / "registry.log", "w") as log:
        process = subprocess.Popen([binary, "serve", str(config)], stdout=log,
                                   stderr=subprocess.STDOUT, **BACKGROUND)
    host = f"127.0.0.1:{port}"
    try:
        wait_until("the registry", lambda: _answers(f"http://{host}/v2/"), 20)
        yield host
    finally:
        process.terminate()
        process.wait(timeout=10)


def _answers(url: str, **kwargs: Any) -> bool:
    try:
        return httpx.get(url, timeout=1, **kwargs).status_code == 200
    except httpx.TransportError:
        return False


def publish(registry_host: str, scratch: Path, engine: DockerEngine | None,
            compose_port: int) -> None:
    """Every example chart (plus hello-world 1.1.0 for the update step) and the Hello
    World Compose package, pushed the way a vendor would. With a Docker engine, the image
    the package names is built here, pushed, and the package points at it, published on
    127.0.0.1:`compose_port`."""
    charts = sorted((EXAMPLES / "fleet" / "apps").glob("*/charts/*/Chart.yaml"))
    newer = scratch / "hello-world-1.1.0"
    shutil.copytree(EXAMPLES / "fleet/apps/com-example-hello-world/charts/hello-world", newer)
    text = (newer / "Chart.yaml").read_text()
    (newer / "Chart.yaml").write_text(text.replace("version: 1.0.0", "version: 1.1.0"))
    for chart_dir in [*(c.parent for c in charts), newer]:
        archive = helm.package(chart_dir, destination=scratch)
        helm.push(archive, f"oci://{registry_host}/charts", plain_http=True)
    compose = EXAMPLES / "fleet/apps/com-example-hello-world/compose"
    files = {str(p.relative_to(compose)): p.read_bytes()
             for p in sorted(compose.rglob("*")) if p.is_file()}
    if engine is not None:
        image = f"{registry_host}/demo/hello-world:1.0.0"
        greeter_image(engine, image)
        push_image(engine, image)
        for name, data in files.items():
            files[name] = (data.replace(b"registry.example.com/hello-world:1.0.0",
                                        image.encode())
                           .replace(b'"8080:8080"', f'"127.0.0.1:{compose_port}:8080"'.encode()))
    with OciClient() as oci:
        oci.push_artifact(f"oci://{registry_host}/compose/hello-world", "1.0.0",
                          deterministic_targz(files))


class FleetSource:
    """The platform engineer's Git repository: every scenario step is one commit, pushed
    to the server, which recompiles on the push."""

    def __init__(self, work: Path, registry_host: str) -> None:
        self.work = work
        shutil.copytree(EXAMPLES / "fleet" / "apps", work / "apps")
        (work / "deployments").mkdir()
        for description in work.glob("apps/*/margo.yaml"):
            description.write_text(description.read_text().replace(EXAMPLE_REGISTRY,
                                                                   registry_host))
        self.git("init", "-q", "-b", "main")
        self.commit("Applications: Hello World, Vision Inference, Line Monitor")

    def git(self, *args: str) -> str:
        env = {**os.environ, "GIT_AUTHOR_NAME": "Platform Team", "GIT_COMMITTER_NAME":
               "Platform Team", "GIT_AUTHOR_EMAIL": "platform@example.com",
               "GIT_COMMITTER_EMAIL": "platform@example.com"}
        return run("git", *args, cwd=self.work, env=env).stdout

    def commit(self, message: str) -> None:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)

    def push(self, url: str) -> None:
        self.git("push", "-q", url, "main")

    def write(self, relative: str, text: str) -> None:
        (self.work / relative).write_text(text)

    def edit(self, relative: str, old: str, new: str) -> None:
        path = self.work / relative
        text = path.read_text()
        if old not in text:
            raise RuntimeError(f"{relative}: {old!r} not found")
        path.write_text(text.replace(old, new))


HELLO_INTENT = """\
# Hello World on every device: Helm on Kubernetes, Compose on Compose boxes.
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata:
  name: hello-everywhere
spec:
  application:
    id: com-example-hello-world
  namespace: hello
  parameters:
    greeting: "{greeting} from {{{{ device.id }}}}"
    replicas: "{{{{ [device.labels['k8s.margo-gitops.dev/nodes'] | default(1), 2] | min }}}}"
"""

VISION_INTENT = """\
# Defect detection wherever a GPU is; kept 5 s through a GPU flap, then removed.
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata:
  name: vision
spec:
  application:
    id: com-example-gpu-inference
  profile:
    type: helm
  namespace: vision
  parameters:
    confidence: 0.85
  gracePeriod: 5s
"""


class Demo:
    def __init__(self, home: Path, stack: ExitStack) -> None:
        self.home = home
        self.stack = stack
        self.ok = True
        self.processes: list[subprocess.Popen[bytes]] = []

    # --- setup ------------------------------------------------------------------------

    def start(self) -> None:
        step("Setting up: registry, fleet source, fleet server, three devices")
        self.registry = self.stack.enter_context(registry(self.home / "registry"))
        self.engine: DockerEngine | None = None
        self.engine_problem = why_unavailable()
        if self.engine_problem is None:
            try:
                self.engine = self.stack.enter_context(running_engine(self.home / "docker"))
            except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                self.engine_problem = f"the engine did not start: {exc}"
        self.compose_port = free_port()
        with tempfile.TemporaryDirectory() as scratch:
            publish(self.registry, Path(scratch), self.engine, self.compose_port)
        say(f"  OCI registry      http://{self.registry} (example charts, Compose package)")
        data = self.home / "wfm"
        token = json.loads(run(*MARGO, "clients", "add", "demo-site", "--data", data,
                               "--json").stdout)["token"]
        admin = self.home / "operator-token"
        admin.write_text("demo-operator-token\n")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.http = self.stack.enter_context(httpx.Client(
            base_url=self.base, timeout=10,
            headers={"Authorization": "Bearer demo-operator-token"}))
        self.spawn("server", [*MARGO, "serve", "--port", str(self.port), "--data", str(data),
                              "--host-source", "--admin-token-file", str(admin),
                              "--log-level", "warning"])
        wait_until("the fleet server", lambda: _answers(f"{self.base}/healthz"), 30)
        say(f"  fleet server      {self.base} (data in {data})")
        self.source = FleetSource(self.home / "fleet-source", self.registry)
        self.push_url = f"http://operator:demo-operator-token@127.0.0.1:{self.port}" \
                        "/git/source.git"
        self.source.push(self.push_url)
        say(f"  fleet source      {self.source.work} (pushed to {self.base}/git/source.git)")
        for device_id, (example, source, api) in DEVICES.items():
            self.start_device(device_id, example, source, api, token)

    def spawn(self, name: str, command: list[str]) -> None:
        log = open(self.home / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
        self.stack.callback(log.close)
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   **BACKGROUND)
        self.processes.append(process)

        def stop() -> None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
        self.stack.callback(stop)

    def caps_file(self, device_id: str) -> Path:
        return self.home / "devices" / device_id / "capabilities.json"

    def start_device(self, device_id: str, example: str, source: str, api: str,
                     token: str) -> None:
        home = self.home / "devices" / device_id
        home.mkdir(parents=True)
        (home / "token").write_text(token)
        doc = json.loads((EXAMPLES / "capabilities" / f"{example}.json").read_text())
        doc["properties"]["id"] = device_id
        self.caps_file(device_id).write_text(json.dumps(doc, indent=2))
        real = example.startswith("compose") and self.engine is not None
        driver: dict[str, Any] = {"type": "render", "outputDir": "rendered"}
        if real:
            assert self.engine is not None
            driver = {"type": "compose", "compose": self.engine.compose,
                      "dockerHost": self.engine.host}
        (home / "device.yaml").write_text(yaml.safe_dump({
            "device": {"id": device_id},
            "server": {"url": self.base, "api": api, "clientId": "demo-site",
                       "tokenFile": "token"},
            "source": {"type": source}, "driver": driver,
            "dataDir": "data", "capabilities": {"file": "capabilities.json"},
            "schedule": {"interval": "1s"}}, sort_keys=False))
        self.spawn(f"devices/{device_id}/device", [*MARGO, "device", "run", "--config",
                                                   str(home / "device.yaml"),
                                                   "--log-level", "warning"])
        kind = {"k8s-single-amd64": "1-node Kubernetes, no GPU",
                "k8s-cluster-gpu": "3-node Kubernetes, NVIDIA GPU",
                "compose-box-amd64": "Compose box"}[example]
        if real:
            how = (f"compose driver, real containers on a private Docker engine "
                   f"(http://127.0.0.1:{self.compose_port}/ once deployed)")
        elif example.startswith("compose"):
            how = f"render driver: NO Docker engine here ({self.engine_problem}), so rendered"
        else:
            how = "render driver"
        say(f"  device            {device_id:<17} {kind}; {source} source, {how}")

    # --- observing ----------------------------------------------------------------------

    def fleet_device(self, device_id: str) -> dict[str, Any] | None:
        response = self.http.get(f"/api/fleet/devices/{device_id}")
        return response.json() if response.status_code == 200 else None

    def runs(self, device_id: str) -> dict[str, tuple[str, list[tuple[str, str]]]]:
        """intent -> (overall state, [(component, state)]) as the server knows it."""
        device = self.fleet_device(device_id) or {"deployments": []}
        # Oct-2024 devices report capitalised states ("Installed"): one spelling on screen.
        return {d["intent"]: (d["state"].lower(),
                              [(c["name"], c["state"].lower()) for c in d["components"]])
                for d in device["deployments"]}

    def ledger(self, device_id: str) -> dict[str, Any]:
        path = self.home / "devices" / device_id / "rendered" / ".ledger.json"
        try:
            return dict(json.loads(path.read_text())["releases"])
        except (OSError, ValueError, KeyError):
            return {}

    def converged(self, expected: dict[str, set[str]]) -> bool:
        """Every device runs exactly the expected intents, all installed."""
        for device_id, intents in expected.items():
            runs = self.runs(device_id)
            if set(runs) != intents or any(state != "installed" for state, _ in runs.values()):
                return False
        return True

    def show(self) -> None:
        for device_id in DEVICES:
            runs = self.runs(device_id)
            text = "; ".join(
                f"{intent} {state} [" + ", ".join(f"{c}: {s}" for c, s in components) + "]"
                for intent, (state, components) in sorted(runs.items())) or "nothing"
            say(f"  {device_id:<17} {text}")

    def expect(self, what: str, expected: dict[str, set[str]],
               extra: Callable[[], bool] | None = None, timeout: float = 90) -> None:
        try:
            wait_until(what, lambda: self.converged(expected) and (extra is None or extra()),
                       timeout)
            self.show()
            say(f"  {DIM}converged: {what}{RESET}")
        except TimeoutError as exc:
            self.ok = False
            self.show()
            say(f"  NOT CONVERGED: {exc}")

    def change(self, message: str) -> None:
        self.source.commit(message)
        self.source.push(self.push_url)
        say(f"  {DIM}commit: {message}{RESET}")

    # --- the scenario -------------------------------------------------------------------

    def scenario(self) -> None:
        everyone = set(DEVICES)
        hello = {d: {"hello-everywhere"} for d in everyone}

        step("1. Deploy Hello World to every eligible device")
        self.source.write("deployments/hello-everywhere.yaml",
                          HELLO_INTENT.format(greeting="Hello"))
        self.change("Deploy Hello World everywhere")
        self.expect("Hello World installed on all three devices", hello)

        step("2. Deploy the GPU application: only the GPU cluster qualifies")
        self.source.write("deployments/vision.yaml", VISION_INTENT)
        self.change("Deploy Vision Inference wherever it fits")
        with_vision = {**hello, GPU_DEVICE: {"hello-everywhere", "vision"}}
        self.expect("Vision Inference on the GPU cluster only", with_vision)
        say("  Why not the others? (margo explain, on the source and the devices' reports)")
        snapshot = self.home / "capabilities"
        snapshot.mkdir(exist_ok=True)
        for device_id in DEVICES:
            shutil.copy(self.caps_file(device_id), snapshot / f"{device_id}.json")
        for device_id in ("edge-single", "edge-compose"):
            explained = run(*MARGO, "explain", "--device", device_id, "--intent", "vision",
                            "--source", self.source.work, "--capabilities", snapshot,
                            check=False)
            for line in (explained.stdout or explained.stderr).strip().splitlines()[:6]:
                say(f"    {line}")

        step("3. Update Hello World to chart 1.1.0")
        self.source.edit("apps/com-example-hello-world/margo.yaml", "revision: 1.0.0\n          "
                         "wait: true", "revision: 1.1.0\n          wait: true")
        self.change("Hello World: chart 1.1.0")
        self.expect("every Kubernetes device renders hello-world 1.1.0", with_vision,
                    lambda: all(self.chart_version(d, "hello") == "1.1.0"
                                for d in ("edge-single", GPU_DEVICE)))

        step("4. Reconfigure a parameter: the greeting")
        self.source.write("deployments/hello-everywhere.yaml",
                          HELLO_INTENT.format(greeting="Guten Tag"))
        self.change("Hello World: greet in German")
        self.expect("the new greeting rendered everywhere", with_vision,
                    lambda: all("Guten Tag" in self.rendered(d) for d in everyone))

        step("5. The GPU node disappears: the cluster re-reports, Vision Inference is removed")
        caps = json.loads(self.caps_file(GPU_DEVICE).read_text())
        saved = json.dumps(caps, indent=2)
        caps["properties"]["peripherals"] = []
        caps["labels"]["k8s.margo-gitops.dev/gpus"] = 0
        self.caps_file(GPU_DEVICE).write_text(json.dumps(caps, indent=2))
        self.expect("Vision Inference removed after its 5 s grace period", hello,
                    lambda: not any(k.startswith("vision/") for k in self.ledger(GPU_DEVICE)))

        step("6. The GPU node comes back")
        self.caps_file(GPU_DEVICE).write_text(saved)
        self.expect("Vision Inference installed again", with_vision)

        step("7. Delete Hello World")
        (self.source.work / "deployments/hello-everywhere.yaml").unlink()
        self.change("Remove Hello World")
        self.expect("Hello World removed from every device",
                    {d: set() for d in everyone} | {GPU_DEVICE: {"vision"}},
                    lambda: not any(k.startswith("hello/") for d in everyone
                                    for k in self.ledger(d)) and not self.containers())

    def containers(self) -> list[str]:
        """The Compose box's containers on the demo's engine (none without an engine)."""
        if self.engine is None:
            return []
        return self.engine.text("ps", "-a", "--format", "{{.Names}}").split()

    def chart_version(self, device_id: str, namespace: str) -> str | None:
        versions = {v["chart"]["version"] for k, v in self.ledger(device_id).items()
                    if k.startswith(f"{namespace}/") and v["status"] == "deployed"}
        return versions.pop() if len(versions) == 1 else None

    def rendered(self, device_id: str) -> str:
        """What the device runs for Hello World: the rendered files, or, on the Compose box
        with a Docker engine, the page its container answers with."""
        if device_id == "edge-compose" and self.engine is not None:
            try:
                return httpx.get(f"http://127.0.0.1:{self.compose_port}/", timeout=2).text
            except httpx.HTTPError:
                return ""
        out = self.home / "devices" / device_id / "rendered" / "hello"
        return "".join(p.read_text() for p in sorted(out.rglob("*"))
                       if p.is_file()) if out.exists() else ""

    def summary(self, serving: bool) -> None:
        """What to look at, and for how long: with `serving` (no DEMO_EXIT=1) the server,
        the registry and the Compose box's engine run until Ctrl-C; else they stop as the
        demo exits, and only what they left on disk stays."""
        step(f"The story, as {GPU_DEVICE}'s repository tells it")
        history = run("git", "--git-dir", self.home / "wfm/repos/fleet-state.git", "log",
                      "--reverse", "--format=%h %s", f"devices/{GPU_DEVICE}", check=False)
        for line in history.stdout.strip().splitlines():
            say(f"  {line}")
        step("Where to look" if serving else "Where to look (on disk; the servers stop now)")
        if serving:
            say(f"  dashboard         {self.base}/?token=demo-operator-token")
            say(f"  read API          curl -H 'Authorization: Bearer demo-operator-token' "
                f"{self.base}/api/fleet/devices")
        else:
            say("  dashboard, API    stop with the demo (DEMO_EXIT=1); `make demo` without it "
                "keeps serving them until Ctrl-C")
        say(f"  device repository git --git-dir {self.home}/wfm/repos/fleet-state.git log "
            f"--format='%h %s' devices/{GPU_DEVICE}")
        say(f"  rendered output   {self.home}/devices/<device>/rendered/")
        if self.engine is not None and serving:
            say(f"  Compose box       DOCKER_HOST={self.engine.host} docker ps (its engine; "
                f"http://127.0.0.1:{self.compose_port}/ while Hello World runs)")
        elif self.engine is not None:
            say("  Compose box       its private Docker engine stops with the demo, its "
                "containers removed")
        say(f"  logs              {self.home}/*.log, {self.home}/devices/*/device.log")
        say(f"  everything        {self.home}")


def main() -> int:
    home = Path(os.environ.get("DEMO_DIR", ROOT / ".demo")).resolve()
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    with ExitStack() as stack:
        demo = Demo(home, stack)
        try:
            demo.start()
            demo.scenario()
        except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
            demo.ok = False
            detail = getattr(exc, "stderr", "") or ""
            say(f"\nDEMO FAILED: {exc} {detail}")
        serving = os.environ.get("DEMO_EXIT") != "1"
        demo.summary(serving)
        say(f"\n{'Every step converged.' if demo.ok else 'Some steps did NOT converge.'}")
        if not serving:
            return 0 if demo.ok else 1
        say("Serving until interrupted (Ctrl-C)...")
        try:
            signal.pause()
        except KeyboardInterrupt:
            say("\nStopping.")
    return 0 if demo.ok else 1


if __name__ == "__main__":
    sys.exit(main())
