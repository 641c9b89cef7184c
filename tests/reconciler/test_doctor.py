"""`margo device doctor`: cluster conformance checks against recorded clusters served by the
API emulator (kmock over real HTTP on loopback, kubeemu.py; clusters from clusterkit.py),
the real Helm engine, real file locks for the local device client, and the command line run
in process.

Synthetic parts (no recording exists), named where they are built: the health endpoints'
text (the format kube-apiserver's healthz handler writes), the device client's pod and
deployment, the collector DaemonSet's status (clusterkit.otel_daemonset) and the one edit
that makes a recorded kube-scheduler pod not Ready.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from kits.clusterkit import (
    DAEMONSETS,
    NODES,
    PODS,
    Cluster,
    gpu_three_node,
    k3s_single,
    make_pod,
    mixed_arch,
    otel_daemonset,
    recorded,
    serve,
)
from kits.kubeemu import Emulator, running_emulator, write_kubeconfig

from margo.cluster import LABEL_PREFIX
from margo_cli.main import main
from reconciler.datadir import LocalClient, probe_data_dir
from reconciler.kubernetes.client import KubeClient, default_kubeconfig
from reconciler.kubernetes.doctor import (
    CHECK_IDS,
    Check,
    DoctorReport,
    Observation,
    Read,
    check_scheduler,
    doctor,
    doctor_labels,
    kubelet_skew,
)
from reconciler.kubernetes.facts import ClusterFacts
from reconciler.kubernetes.provider import KubernetesProvider

DEPLOYMENTS = "apps/v1/deployments"
CONFORMANCE = f"{LABEL_PREFIX}conformance"
FAILURES = f"{LABEL_PREFIX}conformance-failures"

# Synthetic, in the format kube-apiserver's healthz handler writes for `?verbose`.
LIVEZ_OK = "[+]ping ok\n[+]log ok\n[+]etcd ok\n[+]poststarthook/generic-apiserver-start-informers ok\nlivez check passed\n"  # noqa: E501
READYZ_OK = "[+]ping ok\n[+]log ok\n[+]etcd ok\n[+]etcd-readiness ok\n[+]informer-sync ok\n[+]shutdown ok\nreadyz check passed\n"  # noqa: E501
READYZ_ETCD_DOWN = "[+]ping ok\n[+]log ok\n[-]etcd failed: reason withheld\n[-]etcd-readiness failed: reason withheld\n[+]informer-sync ok\n[+]shutdown ok\nreadyz check failed\n"  # noqa: E501


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[Emulator]:
    with running_emulator(tmp_path / "emulator") as running:
        yield running


def healthy(emulator: Emulator) -> Emulator:
    emulator.set_text("/livez", 200, LIVEZ_OK)
    emulator.set_text("/readyz", 200, READYZ_OK)
    return emulator


def wfm_pod(*, ready: bool, node: str = "primary-node") -> dict[str, Any]:
    """Synthetic: the device client's pod, labelled as its chart labels it."""
    pod = make_pod("margo-device-7d9f-abcde", node, namespace="margo")
    pod["metadata"]["labels"] = {"app.kubernetes.io/name": "margo-device"}
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return pod


def wfm_deployment(ready_replicas: int) -> dict[str, Any]:
    """Synthetic: the device client's Deployment with a status."""
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "margo-device", "namespace": "margo",
                         "labels": {"app.kubernetes.io/name": "margo-device"}},
            "spec": {"replicas": 1}, "status": {"replicas": 1, "readyReplicas": ready_replicas}}


def healthy_k3s() -> Cluster:
    """The recorded single-node k3s cluster, plus a collector Ready on its one node and the
    device client's pod."""
    return (k3s_single().add(DAEMONSETS, otel_daemonset(desired=1, ready=1))
            .add(PODS, wfm_pod(ready=True)))


def kind_cluster() -> Cluster:
    """The recorded 3-node kind v1.20 cluster (`kind-worker` is NotReady as recorded) with
    the kube-system pods of a recorded kind v1.34 control plane: kind's real kube-scheduler
    and kube-controller-manager static pods (the v1.20 recording has no pods)."""
    cluster = Cluster(version=recorded("kind-v1.20-version.json"))
    cluster.add(NODES, *recorded("kind-v1.20-3-node-nodelist-taints.json")["items"])
    cluster.add(PODS, *recorded("kind-v1.34-kube-system-podlist.json")["items"])
    return cluster


def run_doctor(emulator: Emulator, **options: Any) -> DoctorReport:
    with KubeClient.from_kubeconfig(emulator.kubeconfig) as client:
        return doctor(client, **options)


def statuses(report: DoctorReport) -> dict[str, str]:
    return {c.id: c.status for c in report.checks}


def node_statuses(check: Check) -> dict[str, str]:
    return {n.name: n.status for n in check.nodes}


def dead_server(tmp_path: Path) -> Path:
    """A kubeconfig for a loopback port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return write_kubeconfig(tmp_path / "dead-kubeconfig", f"http://127.0.0.1:{port}")


# --- whole clusters -------------------------------------------------------------------------

def test_healthy_k3s_single_node_passes_every_check(emulator: Emulator) -> None:
    serve(healthy(emulator), healthy_k3s())
    report = run_doctor(emulator)
    assert [c.id for c in report.checks] == list(CHECK_IDS)
    assert statuses(report) == dict.fromkeys(CHECK_IDS, "pass")
    assert report.verdict == "pass" and report.failures == []
    assert report.platform == "k3s" and report.kubernetes_version == "v1.31.2+k3s1"
    assert "inside its server process" in report.check("scheduler").message
    assert "inside its server process" in report.check("controller-manager").message
    assert str(helm_python.helm_sdk_version()) in report.check("helm-engine").message
    assert report.check("wfm-client").message == \
        "device client pod Ready: margo/margo-device-7d9f-abcde"
    assert report.check("apiserver").message == "/livez and /readyz answer ok"
    assert node_statuses(report.check("container-runtime")) == {"primary-node": "pass"}
    assert report.check("container-runtime").nodes[0].message == "containerd://1.7.22-k3s1"
    assert doctor_labels(report) == {CONFORMANCE: "pass", FAILURES: []}


def test_k3s_without_collector_fails_and_says_what_it_cannot_see(emulator: Emulator) -> None:
    serve(healthy(emulator), k3s_single())  # the recorded svclb DaemonSet is no collector
    report = run_doctor(emulator)
    assert report.check("otel-collector").status == "fail"
    assert "on all 1 schedulable node(s)" in report.check("otel-collector").message
    wfm = report.check("wfm-client")
    assert wfm.status == "unknown" and "run with --config on its host" in wfm.message
    assert report.verdict == "fail"
    assert doctor_labels(report) == {CONFORMANCE: "fail", FAILURES: ["otel-collector"]}


def test_kind_cluster_with_a_notready_worker_fails(emulator: Emulator) -> None:
    serve(healthy(emulator), kind_cluster())
    report = run_doctor(emulator)
    ready = report.check("kubelet-ready")
    assert (ready.scope, ready.status) == ("worker", "fail")
    assert node_statuses(ready) == {"kind-control-plane": "pass", "kind-worker": "fail",
                                    "kind-worker2": "pass"}
    assert ready.message == "1 of 3 node(s): kind-worker (NotReady)"
    assert report.check("scheduler").status == "pass"
    assert report.check("scheduler").message == \
        "kube-scheduler Ready: kube-system/kube-scheduler-v1.34-control-plane"
    assert report.check("controller-manager").status == "pass"
    assert report.check("container-runtime").status == "pass"
    assert report.check("version-skew").status == "pass"
    assert report.platform is None
    assert report.verdict == "fail"
    assert report.failures == ["otel-collector", "kubelet-ready"]


def test_a_control_plane_pod_that_is_not_ready_fails_or_warns(emulator: Emulator) -> None:
    cluster = kind_cluster()
    pods = cluster.objects[PODS]
    scheduler = next(p for p in pods if p["metadata"]["name"].startswith("kube-scheduler"))
    for condition in scheduler["status"]["conditions"]:  # the one edit: not Ready
        if condition["type"] == "Ready":
            condition["status"] = "False"
    serve(healthy(emulator), cluster)
    check = run_doctor(emulator).check("scheduler")
    assert check.status == "fail" and "not Ready" in check.message

    standby = copy.deepcopy(recorded("kind-v1.34-kube-system-podlist.json")["items"])
    second = next(p for p in standby if p["metadata"]["name"].startswith("kube-scheduler"))
    second["metadata"]["name"] = "kube-scheduler-v1.34-control-plane2"
    emulator.load(PODS, second)  # HA: a Ready second scheduler keeps scheduling going
    check = run_doctor(emulator).check("scheduler")
    assert check.status == "warn"
    assert "(Ready: kube-system/kube-scheduler-v1.34-control-plane2)" in check.message


def test_version_skew_too_large_fails(emulator: Emulator) -> None:
    serve(healthy(emulator), mixed_arch())  # k3d v1.24 server, AKS v1.18 kubelet
    skew = run_doctor(emulator).check("version-skew")
    assert (skew.scope, skew.status) == ("cluster", "fail")
    assert node_statuses(skew) == {"k3d-mycluster-server-0": "pass",
                                   "aks-agentpool-30520393-vmss000000": "fail"}
    assert "v1.18.19 is 6 minor versions older (at most 2 allowed)" in skew.message
    assert report_runtime_of(emulator, "aks-agentpool-30520393-vmss000000") == \
        ("pass", "docker://19.3.14")


def report_runtime_of(emulator: Emulator, node: str) -> tuple[str, str]:
    check = run_doctor(emulator, helm_version=None).check("container-runtime")
    found = next(n for n in check.nodes if n.name == node)
    return found.status, found.message


def test_a_kubelet_newer_than_the_api_server_fails(emulator: Emulator) -> None:
    serve(healthy(emulator), gpu_three_node())  # kind v1.20 server, a v1.29.11 GPU worker
    skew = run_doctor(emulator, helm_version=None).check("version-skew")
    assert skew.status == "fail"
    assert "ip-172-31-21-92 (kubelet v1.29.11 is newer than the API server)" in skew.message


@pytest.mark.parametrize(("server", "kubelet", "status"), [
    ("v1.31.2+k3s1", "v1.31.2+k3s1", "pass"),
    ("v1.31.2", "v1.31.9", "pass"),          # a newer patch of the same minor is fine
    ("v1.28.0", "v1.25.16", "pass"),         # three minors older since 1.28
    ("v1.28.0", "v1.24.17", "fail"),
    ("v1.27.3-eks-a5565ad", "v1.25.9", "pass"),  # two before 1.28
    ("v1.27.3", "v1.24.0", "fail"),
    ("v1.30.0", "v1.31.0", "fail"),          # never newer
    ("v1.30.0", "v2.30.0", "fail"),
    ("v1.30.0", "", "unknown"),
    ("v1.30.0", "unstable", "unknown"),
])
def test_kubelet_skew_follows_the_kubernetes_policy(server: str, kubelet: str,
                                                   status: str) -> None:
    assert kubelet_skew(server, kubelet)[0] == status


def test_unknown_runtimes_warn_and_missing_ones_fail(emulator: Emulator) -> None:
    nodes = recorded("kind-v1.20-3-node-nodelist-taints.json")["items"]
    nodes[1]["status"]["nodeInfo"]["containerRuntimeVersion"] = "remote://1.0"  # edited
    nodes[2]["status"]["nodeInfo"]["containerRuntimeVersion"] = ""  # edited
    cluster = Cluster(version=recorded("kind-v1.20-version.json")).add(NODES, *nodes)
    serve(healthy(emulator), cluster)
    check = run_doctor(emulator, helm_version=None).check("container-runtime")
    assert check.status == "fail"
    assert node_statuses(check) == {"kind-control-plane": "pass", "kind-worker": "warn",
                                    "kind-worker2": "fail"}


# --- what cannot be seen is unknown ---------------------------------------------------------

def test_forbidden_reads_are_unknown_never_a_pass(emulator: Emulator) -> None:
    serve(healthy(emulator), healthy_k3s())
    emulator.forbid(NODES, PODS, DAEMONSETS, DEPLOYMENTS, "/livez", "/readyz")
    report = run_doctor(emulator)
    found = statuses(report)
    assert found.pop("helm-engine") == "pass"
    assert found == dict.fromkeys(found, "unknown")
    assert report.verdict == "warn" and doctor_labels(report)[FAILURES] == []
    for check_id in ("wfm-client", "scheduler", "controller-manager", "kubelet-ready",
                     "container-runtime", "version-skew"):
        assert "forbidden" in report.check(check_id).message, check_id
    assert report.check("apiserver").message == \
        "cannot tell: /livez forbidden; /readyz forbidden"
    # What this host knows still counts: the client is this process.
    mine = run_doctor(emulator, local_client=LocalClient.this_process())
    assert mine.check("wfm-client").status == "pass"


def test_without_health_endpoints_the_api_server_is_unknown(emulator: Emulator) -> None:
    serve(emulator, healthy_k3s())  # kmock answers 404 for /livez, /readyz, /healthz
    report = run_doctor(emulator, helm_version=None)
    assert report.check("apiserver").status == "unknown"
    assert report.check("helm-engine").status == "unknown"  # not checked is not a pass
    # k3s embeds the scheduler: without a healthy API server nothing vouches for it.
    assert report.check("scheduler").status == "unknown"
    emulator.set_text("/healthz", 200, "ok")  # an old server: only /healthz
    report = run_doctor(emulator, helm_version=None)
    assert report.check("apiserver").status == "pass"
    assert report.check("apiserver").message == "/healthz answer ok"


def test_a_failing_readyz_fails_and_names_its_failed_checks(emulator: Emulator) -> None:
    serve(healthy(emulator), healthy_k3s())
    emulator.set_text("/readyz", 500, READYZ_ETCD_DOWN)
    report = run_doctor(emulator)
    assert report.check("apiserver").status == "fail"
    assert report.check("apiserver").message == \
        "/readyz answered 500 (failed: etcd, etcd-readiness)"
    assert report.check("scheduler").status == "unknown"
    assert report.failures == ["apiserver"]


def test_a_missing_helm_engine_fails(emulator: Emulator) -> None:
    def missing() -> str:
        raise ImportError("libhelm_c.so: cannot open shared object file")
    serve(healthy(emulator), healthy_k3s())
    check = run_doctor(emulator, helm_version=missing).check("helm-engine")
    assert check.status == "fail" and "libhelm_c.so" in check.message


# --- the WFM client -------------------------------------------------------------------------

def test_wfm_client_from_pods_deployments_and_this_host(emulator: Emulator,
                                                        tmp_path: Path) -> None:
    serve(healthy(emulator), k3s_single().add(PODS, wfm_pod(ready=False)))
    check = run_doctor(emulator, helm_version=None).check("wfm-client")
    assert check.status == "fail" and "none Ready: margo/margo-device-7d9f-abcde" in \
        check.message

    emulator.remove(PODS, "margo-device-7d9f-abcde", "margo")
    stopped = probe_data_dir(tmp_path / "data")
    check = run_doctor(emulator, helm_version=None, local_client=stopped).check("wfm-client")
    assert check.status == "fail" and "no device client has run with" in check.message

    emulator.forbid(PODS)  # pods hidden: the Deployment's status stands in
    emulator.load(DEPLOYMENTS, wfm_deployment(ready_replicas=1))
    check = run_doctor(emulator, helm_version=None).check("wfm-client")
    assert check.status == "pass" and "margo/margo-device" in check.message
    emulator.load(DEPLOYMENTS, wfm_deployment(ready_replicas=0))
    assert run_doctor(emulator, helm_version=None).check("wfm-client").status == "fail"


def hold_lock(data_dir: Path) -> int:
    """Hold the data directory's lock exactly as a running `margo device` does."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_probe_data_dir_sees_a_running_client_and_changes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert probe_data_dir(data).running is False
    assert not data.exists()  # read-only: nothing created
    fd = hold_lock(data)
    try:
        assert probe_data_dir(data) == LocalClient(True, f"a device client holds "
                                                         f"{data / '.lock'}")
    finally:
        os.close(fd)
    assert probe_data_dir(data).running is False
    # The probe released its own lock: a client can still take the lock afterwards.
    os.close(hold_lock(data))


# --- the command ----------------------------------------------------------------------------

def device_config(home: Path, kubeconfig: Path | None, driver: str = "render") -> Path:
    home.mkdir(parents=True, exist_ok=True)
    (home / "token").write_text("t")
    doc: dict[str, Any] = {
        "device": {"id": "edge-cluster"},
        "server": {"url": "http://127.0.0.1:1", "clientId": "c", "tokenFile": "token"},
        "source": {"type": "margo-rest"}, "driver": {"type": driver}, "dataDir": "data"}
    if kubeconfig is not None:
        doc["capabilities"] = {"kubernetes": {"kubeconfig": str(kubeconfig)}}
    (home / "device.yaml").write_text(yaml.safe_dump(doc))
    return home / "device.yaml"


def test_cli_json_for_machines(emulator: Emulator, capsys: pytest.CaptureFixture[str]) -> None:
    serve(healthy(emulator), healthy_k3s())
    assert main(["device", "doctor", "--kubeconfig", str(emulator.kubeconfig), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"verdict", "checks"} and out["verdict"] == "pass"
    assert [c["id"] for c in out["checks"]] == list(CHECK_IDS)
    assert out["checks"][0] == {"id": "wfm-client", "scope": "leader", "status": "pass",
                                "message": "device client pod Ready: "
                                           "margo/margo-device-7d9f-abcde"}
    assert out["checks"][6]["nodes"] == [{"name": "primary-node", "status": "pass",
                                          "message": "Ready"}]


def test_cli_table_for_people_exits_1_on_failure(emulator: Emulator,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    serve(healthy(emulator), kind_cluster())
    assert main(["device", "doctor", "--kubeconfig", str(emulator.kubeconfig),
                 "--context", "emulator"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"cluster {emulator.url}: Kubernetes v1.20.0"
    assert lines[1].split() == ["SCOPE", "CHECK", "STATUS", "MESSAGE"]
    assert lines[8].split()[:3] == ["worker", "kubelet-ready", "fail"]
    assert lines[-1] == ("verdict: fail (6 pass, 0 warn, 2 fail, 1 unknown; failed: "
                         "otel-collector, kubelet-ready)")


def test_cli_unreachable_api_server_exits_2(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["device", "doctor", "--kubeconfig", str(dead_server(tmp_path))]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "no cluster reachable at http://127.0.0.1:" in captured.err


def test_cli_unusable_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["device", "doctor"]) == 2
    assert "no cluster given" in capsys.readouterr().err
    assert main(["device", "doctor", "--kubeconfig", str(tmp_path / "missing")]) == 2
    assert "cannot use the cluster's credentials" in capsys.readouterr().err
    compose = device_config(tmp_path / "compose", None, driver="compose")
    # A device that is no cluster is checked on this host (test_telemetry.py): without a
    # collector configured, that check fails.
    assert main(["device", "doctor", "--config", str(compose)]) == 1
    assert "no collector is configured" in capsys.readouterr().out
    assert main(["device", "doctor", "--config", str(compose), "--context", "x"]) == 2
    assert "--context goes with --kubeconfig" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse: one source at most
        main(["device", "doctor", "--config", str(compose), "--kubeconfig", "k"])
    assert usage.value.code == 2


def test_cli_with_config_sees_the_local_client(emulator: Emulator, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    serve(healthy(emulator), k3s_single().add(DAEMONSETS, otel_daemonset(desired=1, ready=1)))
    config = device_config(tmp_path / "device", emulator.kubeconfig)
    assert main(["device", "doctor", "--config", str(config), "--json"]) == 1
    wfm = json.loads(capsys.readouterr().out)["checks"][0]
    assert wfm["status"] == "fail" and "no device client has run with" in wfm["message"]
    fd = hold_lock(tmp_path / "device" / "data")
    try:
        assert main(["device", "doctor", "--config", str(config), "--json"]) == 0
    finally:
        os.close(fd)
    wfm = json.loads(capsys.readouterr().out)["checks"][0]
    assert wfm["status"] == "pass" and wfm["message"].startswith("a device client holds")


def test_cli_finds_the_kubeconfig_as_kubectl_does(emulator: Emulator, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    serve(healthy(emulator), healthy_k3s())
    missing = tmp_path / "nope"
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(missing), str(emulator.kubeconfig)]))
    assert default_kubeconfig() == emulator.kubeconfig
    assert main(["device", "doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "pass"
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text("{}")
    assert default_kubeconfig({"KUBECONFIG": str(missing)}, home) == home / ".kube" / "config"
    assert default_kubeconfig({}, tmp_path) is None


# --- capability labels through the provider -------------------------------------------------

def test_provider_reports_the_verdict_as_labels_only_when_asked(emulator: Emulator) -> None:
    serve(healthy(emulator), k3s_single().add(DAEMONSETS, otel_daemonset(desired=1, ready=1)))
    plain = KubernetesProvider("edge-cluster", kubeconfig=emulator.kubeconfig).observe()
    assert CONFORMANCE not in plain["labels"] and FAILURES not in plain["labels"]
    checked = KubernetesProvider("edge-cluster", kubeconfig=emulator.kubeconfig, doctor=True,
                                 labels={CONFORMANCE: "pass", "site": "a"}).observe()
    # The provider runs in the device client, so the WFM client check passes; discovered
    # labels win over the operator's.
    assert checked["labels"][CONFORMANCE] == "pass"
    assert checked["labels"][FAILURES] == [] and checked["labels"]["site"] == "a"
    emulator.set_text("/livez", 503, "[-]etcd failed: reason withheld\nlivez check failed\n")
    failing = KubernetesProvider("edge-cluster", kubeconfig=emulator.kubeconfig,
                                 doctor=True).observe()
    assert failing["labels"][CONFORMANCE] == "fail"
    assert failing["labels"][FAILURES] == ["apiserver"]


def _lease(name: str, holder: str | None, renewed: str | None,
           duration: int = 15) -> dict[str, Any]:
    spec: dict[str, Any] = {"leaseDurationSeconds": duration}
    if holder is not None:
        spec["holderIdentity"] = holder
    if renewed is not None:
        spec["renewTime"] = renewed
    return {"metadata": {"name": name, "namespace": "kube-system"}, "spec": spec}


@pytest.mark.parametrize(("lease", "status", "words"), [
    (_lease("kube-scheduler", "cp_1", "2026-12-01T10:00:00.000000Z"), "pass", "renewed 5 s ago"),
    (_lease("kube-scheduler", "cp_1", "2026-12-01T09:59:00.000000Z"), "fail",
     "last renewed 65 s ago, more than its 15 s duration"),
    (_lease("kube-scheduler", None, None), "fail", "has no holder"),
    (_lease("other", "x", "2026-12-01T10:00:00Z"), "unknown", "may run outside the cluster"),
])
def test_a_component_without_pods_is_judged_by_its_lease(lease: dict[str, Any], status: str,
                                                         words: str) -> None:
    """Leases as the real control plane writes them (tests/reconciler/test_kube_real.py sees
    live ones); the clock is the observation's, so a stopped holder can be shown."""
    found = Observation(facts=ClusterFacts(git_version="v1.36.3"), system_pods=Read([]),
                        leases=Read([lease]),
                        observed_at=datetime(2026, 12, 1, 10, 0, 5, tzinfo=UTC))
    check = check_scheduler(found)
    assert check.status == status
    assert words in check.message


def test_the_encryption_key_check_tells_missing_damaged_and_usable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`encryption-key` (issue 32): none yet warns, a damaged or exposed file fails naming
    it (never quoting it), a usable one passes with its recipient and the previous one."""
    from margo_cli.doctor_command import key_check
    from reconciler.encryption_key import rotate_key

    path = tmp_path / "keys" / "encryption.age"
    missing = key_check(path)
    assert missing.status == "warn" and "does not exist yet" in missing.message
    _, first = rotate_key(path)
    assert key_check(path).status == "pass" and first in key_check(path).message
    _, second = rotate_key(path)
    rotated = key_check(path).message
    assert second in rotated and f"previous {first}" in rotated
    secret = path.read_text()
    path.write_text("AGE-SECRET-KEY-1NOTAKEY\n")
    damaged = key_check(path)
    assert damaged.status == "fail" and str(path) in damaged.message
    assert "NOTAKEY" not in damaged.message
    path.write_text(secret)
    path.chmod(0o644)
    assert key_check(path).status == "fail"
