"""The first process of a real node (`python -m tools.kube.nodeinit SPEC.json`), run by
realnode.py as PID 1 of new mount and PID namespaces (`unshare --mount --pid --fork`).

It makes the node's private world, then runs containerd, the kubelet and kube-proxy in it:
- **mounts** (private to the node; gone when its last process ends): fresh tmpfs on
  `/run`, `/var/lib` and `/var/log`, where containerd, the CNI plugins and the kubelet keep
  paths they do not let us choose (network namespace mounts, CNI results, pod logs); and
  stand-ins for the kernel settings the kubelet writes (`vm.overcommit_memory`,
  `kernel.panic`, ...), which are machine-wide: files bind-mounted over their /proc/sys
  entries, holding the host's values, so the kubelet's writes land there;
- **network**: a network namespace of its own (`unshare(CLONE_NEWNET)` of the main
  thread; the relays still make their host-side sockets in the host's namespace, whose
  descriptor is kept: `relay.socket_in`): the API server's
  advertised address on its loopback, its node IP on a veth into the node set's fabric
  (`setup_network`), the pod bridge the CNI plugin makes, kube-proxy's rules; the API
  server's host loopback port is served inside on the same number, and a CONNECT socket
  lets the API server's egress proxy reach the kubelet and pods (relay.py);
- **cgroups**: the kubelet's `cgroupRoot` is created below this process's own memory
  cgroup (so node memory counts against whoever started it) in every v1 hierarchy, and
  removed, deepest first, after every process of the node has ended.

On SIGTERM it stops kube-proxy and the kubelet, kills everything else in its PID
namespace (containers and shims included), removes its cgroups and exits; the kernel then
drops its mounts and its network namespace with every interface and rule in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tools.kube.relay import forward, serve_connect, unshare_net

#: Kernel settings the kubelet sets at start (pkg/kubelet/cm, setupKernelTunables).
SYSCTL_STANDINS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
                   "kernel/panic_on_oops", "kernel/keys/root_maxkeys",
                   "kernel/keys/root_maxbytes")
PRIVATE_TMPFS = ("/run", "/var/lib", "/var/log")
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
#: Descriptors `run` hands on (the fabric's namespace, for nsenter).
PASS_FDS: tuple[int, ...] = ()


class Stop(Exception):
    """SIGTERM or SIGINT arrived."""


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} nodeinit: {text}", flush=True)


def run(*argv: str) -> None:
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          pass_fds=PASS_FDS)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def make_private_mounts(folder: Path, binds: dict[str, str]) -> None:
    """The tmpfs mounts, then `binds` (target: source folder), e.g. the kubelet's folder
    at /var/lib/kubelet: its Unix sockets need a short path, its data a disk."""
    for target in PRIVATE_TMPFS:
        run("mount", "-t", "tmpfs", "-o", "mode=755,size=2g", "tmpfs", target)
    for target, source in binds.items():
        Path(target).mkdir(parents=True, exist_ok=True)
        Path(source).mkdir(parents=True, exist_ok=True)
        run("mount", "--bind", source, target)
    standins = folder / "sysctl"
    standins.mkdir(exist_ok=True)
    for name in SYSCTL_STANDINS:
        live = Path("/proc/sys") / name
        copy = standins / name.replace("/", ".")
        copy.write_text(live.read_text())
        run("mount", "--bind", str(copy), str(live))


def cgroup_mounts() -> list[Path]:
    """Mount points of the cgroup hierarchies (v1, and the v2 one of a hybrid setup,
    where runc makes a folder for each container too)."""
    return [Path(line.split()[1]) for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[2] in ("cgroup", "cgroup2")]


def make_cgroup_root(root: str) -> list[Path]:
    """Create `root` in every hierarchy; return the folders created, outermost first, each
    given its parent's cpuset (an empty one takes no process)."""
    made: list[Path] = []
    for mount in cgroup_mounts():
        path = mount
        for part in Path(root).relative_to("/").parts:
            parent, path = path, path / part
            if not path.exists():
                path.mkdir()
                made.append(path)
                for name in ("cpuset.cpus", "cpuset.mems"):
                    if (path / name).exists():
                        (path / name).write_text((parent / name).read_text())
    return made


def remove_cgroups(made: list[Path]) -> None:
    """Remove everything below the folders created (the kubelet's and runc's), deepest
    first, then the folders themselves."""
    for top in reversed(made):
        if not top.exists():
            continue
        below = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                       reverse=True)
        for path in [*below, top]:
            with contextlib.suppress(OSError):
                path.rmdir()


def setup_network(spec: dict[str, Any]) -> int:
    """Enter a new network namespace, join the nodes' fabric and configure addresses and
    routes; return the namespace's descriptor.

    The fabric is a network namespace of the node set's own (realnode.py) holding a
    bridge: each node's `eth0` is a veth whose other end is on that bridge, created from
    inside the fabric so that no interface ever appears on the host. The fabric routes
    each node's pod range to that node; nodes route everything not their own to it, so
    pods reach pods and Services on every node, and nothing else."""
    unshare_net()
    fabric = f"--net=/proc/self/fd/{spec['fabricFd']}"
    run("ip", "link", "set", "lo", "up")
    run("ip", "addr", "add", f"{spec['apiAddress']}/32", "dev", "lo")
    end = f"f{spec['index']}"
    # `netns 1`: this process, PID 1 of the node's PID namespace, which nsenter shares.
    run("nsenter", fabric, "ip", "link", "add", end, "type", "veth", "peer", "name", "eth0",
        "netns", "1")
    run("nsenter", fabric, "ip", "link", "set", end, "master", "fabric", "up")
    run("nsenter", fabric, "ip", "route", "replace", spec["podCIDR"], "via", spec["nodeIP"])
    run("ip", "addr", "add", f"{spec['nodeIP']}/{spec['fabricPrefix']}", "dev", "eth0")
    run("ip", "link", "set", "eth0", "up")
    run("ip", "route", "add", "default", "via", spec["fabricAddress"])
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY)


def start_relays(spec: dict[str, Any], host_ns: int, node_ns: int) -> None:
    """Host loopback ports served in the node, and the node's CONNECT socket for the API
    server's egress proxy, on an event loop thread."""
    listeners = []
    for port in spec["hostPorts"]:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))  # this thread is in the node's namespace
        listener.listen(128)
        listeners.append((listener, port))
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def serve() -> None:
        for listener, port in listeners:
            await forward(listener, host_ns, port)
        await serve_connect(Path(spec["connectSocket"]), node_ns)
        ready.set()

    def main() -> None:
        loop.run_until_complete(serve())
        loop.run_forever()

    threading.Thread(target=main, name="relays", daemon=True).start()
    if not ready.wait(10):
        raise RuntimeError("the relays did not start")


def spawn(name: str, argv: list[str], folder: Path) -> subprocess.Popen[bytes]:
    log = open(folder / "logs" / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root"}
    say(f"starting {name}")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def wait_for_containerd(spec: dict[str, Any], process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"containerd exited with {process.returncode}")
        if Path(CONTAINERD_SOCKET).exists() and subprocess.run(
                [spec["ctr"], "-a", CONTAINERD_SOCKET, "version"], capture_output=True,
                timeout=10).returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("containerd did not answer within 60 s")
        time.sleep(0.05)


def import_images(spec: dict[str, Any]) -> None:
    """Every image the node is given, into the CRI plugin's namespace."""
    for archive in spec["images"]:
        run(spec["ctr"], "-a", CONTAINERD_SOCKET, "-n", "k8s.io", "images", "import", archive)


def stop_children(children: dict[str, subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """kube-proxy and the kubelet first, then containerd, each SIGTERM then SIGKILL."""
    for name in ("kube-proxy", "kubelet", "containerd"):
        process = children.get(name)
        if process is None or process.poll() is not None:
            continue
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def kill_everything_else() -> None:
    """As PID 1 of the namespace: SIGKILL every other process in it (shims, containers)
    and reap them."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def supervise(children: dict[str, subprocess.Popen[bytes]]) -> None:
    """Reap every process that ends in the namespace (orphans come to PID 1) until SIGTERM;
    a node component that exits ends the node."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            time.sleep(0.5)
            continue
        for name, process in children.items():
            if process.pid == pid:
                process.returncode = os.waitstatus_to_exitcode(status)
                raise RuntimeError(f"{name} exited with {process.returncode}")


def main(spec_path: str) -> int:
    global PASS_FDS
    spec = json.loads(Path(spec_path).read_text())
    PASS_FDS = (spec["fabricFd"],)
    folder = Path(spec["folder"])
    (folder / "logs").mkdir(exist_ok=True)

    def stop(*_: object) -> None:
        raise Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    children: dict[str, subprocess.Popen[bytes]] = {}
    made: list[Path] = []
    code = 0
    try:
        host_ns = os.open("/proc/self/ns/net", os.O_RDONLY)
        make_private_mounts(folder, spec.get("binds", {}))
        made = make_cgroup_root(spec["cgroupRoot"])
        node_ns = setup_network(spec)
        start_relays(spec, host_ns, node_ns)
        children["containerd"] = spawn("containerd", spec["containerd"], folder)
        wait_for_containerd(spec, children["containerd"])
        import_images(spec)
        children["kubelet"] = spawn("kubelet", spec["kubelet"], folder)
        if spec.get("kubeProxy"):
            children["kube-proxy"] = spawn("kube-proxy", spec["kubeProxy"], folder)
        say("node processes started")
        supervise(children)
    except Stop:
        say("stopping")
    except Exception as error:  # said, and the node ends
        say(f"failed: {error}")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_children(children)
        kill_everything_else()
        remove_cgroups(made)
        say("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
