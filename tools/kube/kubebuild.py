"""Build the Kubernetes control plane (and the kubelet, kube-proxy and cluster DNS of real
nodes) from the official Go modules, once per machine.

No package carries a Kubernetes API server on these machines, but the Go module proxy
serves `k8s.io/kubernetes` and its staging modules, etcd and kwok. `go.mod` in this folder
pins them (one Kubernetes release, staging modules at their published versions, kwok
built against the same client libraries) and lists the upstream `main` packages as tools;
`cmd/etcd` only calls etcd's own entry point. `go.sum` makes every build fetch the same
bytes. `dns/` is a second module: CoreDNS (`github.com/coredns/coredns`, pinned there)
built with CoreDNS's own entry point and a chosen plugin list, the real nodes' cluster DNS.

The binaries are cached by a key over everything that decides them (both modules' go.mod
and go.sum, the etcd and CoreDNS mains, the Go version, the build flags), in
`$MARGO_KUBE_CACHE` or else
`${XDG_CACHE_HOME:-~/.cache}/margo-gitops/kube/<kubernetes version>-<key>/`. A first build
takes minutes on two cores; later ones find the folder and return at once. Builds are
serialised by a file lock, so parallel test runs build once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["BINARIES", "DNS_BINARY", "HERE", "binaries", "cache_root", "kubernetes_version"]

HERE = Path(__file__).resolve().parent
#: Binary name → the Go package it is built from.
BINARIES = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kwok": "sigs.k8s.io/kwok/cmd/kwok",
    "etcd": "./cmd/etcd",
    # Real nodes (realnode.py): the kubelet and kube-proxy of the same release.
    "kubelet": "k8s.io/kubernetes/cmd/kubelet",
    "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
}
#: Cluster DNS for real nodes: CoreDNS with the plugins a test cluster needs, from a module
#: of its own (dns/: its client libraries are not the control plane's versions).
DNS_BINARY = "coredns"
_INPUTS = ("go.mod", "go.sum", "cmd/etcd/main.go", "dns/go.mod", "dns/go.sum", "dns/main.go")
#: kwok's own stage definitions (in its module, under kustomize/stage/), concatenated into
#: `kwok-stages.yaml` next to the binaries: nodes become Ready and keep their leases fresh,
#: scheduled pods become Running and Ready at once, deleted pods go away, and a pod labelled
#: `pod-container-running-failed.stage.kwok.x-k8s.io: "true"` has its container fail after a
#: second (a crashing workload, for the tests that need one).
KWOK_STAGES = ("node/fast/node-initialize.yaml",
               "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
               "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml", "pod/fast/pod-delete.yaml",
               "pod/chaos/pod-container-running-failed.yaml")
STAGES_FILE = "kwok-stages.yaml"


def kubernetes_version() -> str:
    """The pinned `k8s.io/kubernetes` release, read from go.mod (the one place it is set)."""
    found = re.search(r"^\s*k8s\.io/kubernetes (v\d+\.\d+\.\d+)\b", (HERE / "go.mod").read_text(),
                      re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{HERE / 'go.mod'}: no k8s.io/kubernetes requirement")
    return found.group(1)


def _ldflags(version: str) -> str:
    """Stamp the release into the binaries, as Kubernetes' own build does: `/version`,
    Helm's `kubeVersion` checks and the version-skew rules all read it."""
    major, minor = version.lstrip("v").split(".")[:2]
    stamp = {"gitVersion": version, "gitMajor": major, "gitMinor": minor,
             "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z"}
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.{name}={value}" for name, value in stamp.items()]
    return " ".join(flags)


def _go() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists()
                                else None)
    if go is None:
        raise RuntimeError("building the Kubernetes control plane needs a Go toolchain "
                           "(`go` on PATH or /usr/local/go/bin/go)")
    return go


def cache_root() -> Path:
    if os.environ.get("MARGO_KUBE_CACHE"):
        return Path(os.environ["MARGO_KUBE_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "margo-gitops" / "kube"


def _key(go: str, version: str) -> str:
    digest = hashlib.sha256()
    for name in _INPUTS:
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    go_version = subprocess.run([go, "version"], capture_output=True, text=True,
                                check=True).stdout
    digest.update(go_version.encode() + _ldflags(version).encode())
    digest.update("\0".join(KWOK_STAGES).encode())
    return digest.hexdigest()[:12]


def _write_stages(go: str, env: dict[str, str], folder: Path) -> None:
    module = subprocess.run([go, "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/kwok"], cwd=HERE,
                            env=env, capture_output=True, text=True, check=True).stdout.strip()
    stages = [(Path(module) / "kustomize" / "stage" / name).read_text().strip()
              for name in KWOK_STAGES]
    (folder / STAGES_FILE).write_text("\n---\n".join(stages) + "\n")


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (*BINARIES, DNS_BINARY, STAGES_FILE))


def binaries(*, log=None) -> Path:
    """The folder holding the built binaries, building them first when the cache has none.
    `log` (default: stderr) hears about a build, which takes minutes."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    go, version = _go(), kubernetes_version()
    target = cache_root() / f"{version}-{_key(go, version)}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(target):
            return target  # another process built it while we waited
        say(f"building the Kubernetes control plane {version} from Go modules into {target} "
            "(once per machine; several minutes on two cores)")
        started = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly",
               "GOTOOLCHAIN": "local"}
        try:
            subprocess.run([go, "build", "-trimpath", "-ldflags", _ldflags(version), "-o",
                            str(work) + "/", *BINARIES.values()], cwd=HERE, env=env, check=True)
            subprocess.run([go, "build", "-trimpath", "-ldflags", "-s -w", "-o",
                            str(work / DNS_BINARY), "."], cwd=HERE / "dns", env=env, check=True)
            _write_stages(go, env, work)
            if target.exists():
                shutil.rmtree(target)
            work.chmod(0o755)
            work.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for stale in target.parent.glob("v*-*"):  # builds for other inputs: 360 MB each
            if stale != target and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        say(f"built the control plane in {time.monotonic() - started:.0f} s")
    return target


if __name__ == "__main__":
    print(binaries())
