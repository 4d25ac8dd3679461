"""Kubernetes' path, for real: a private containerd 1.6 with its CRI plugin, the runtime class "coldsnap"
registered by `coldsnap runtime configure --runtime containerd` alone (BinaryName = coldsnap-runc, io.coldsnap.*
pod annotations let through), CNI from Debian's plugins (a bridge, pod IPs), and the calls a kubelet makes through
the upstream CRI v1 stubs (coldsnap_bench.cri). A pod of the reference engine is captured with `coldsnap capture
--container` against the CRI plugin's runc root; a new pod annotated with the capsule restores inside
StartContainer, validated before the call returns; the pause container and unannotated pods pass through; a refused
capsule starts cold, or fails the call when the pod's policy says no fallback; a restarted container is restored
afresh. vLLM (CPU) comes back the same way with the same completions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from containers_fixture import (
    ENGINE_ARGS,
    ENGINE_PORT,
    completions_in,
    engine_launch,
    ensure,
    healthy_at,
    launch_binds,
    make_rootfs,
    needs_root,
    private_coldsnap,
    shared_binds,
)

from coldsnap.base.paths import settings
from coldsnap.contracts import capsule as mt

pytestmark = [pytest.mark.root, pytest.mark.slow]
grpc = pytest.importorskip("grpc", reason="the CRI client needs grpcio (the bench extra: pip install -e '.[bench]')")
cri_bench = pytest.importorskip("coldsnap_bench.cri", reason="the CRI client needs container-runtime-interface-api "
                                "(the bench extra)")
IMAGE = "localhost/coldsnap-cri-test:1"
COLDSNAP = Path(sys.prefix) / "bin" / "coldsnap"


CONTAINERD2 = Path("/var/lib/coldsnap/containerd2")  # packaging/containers/containerd2.sh: Debian sid's 2.x
CONTAINERD2_SH = Path(__file__).resolve().parents[1] / "packaging" / "containers" / "containerd2.sh"


class Lab:
    def __init__(self, base: Path, containerd: str | None):
        self.base = base
        self.node = cri_bench.Node(base, containerd=containerd)
        self.models = base / "models"
        self.models.mkdir()

    def mounts(self) -> list[dict]:
        return [*cri_bench.binds_to_mounts(shared_binds()),
                {"host_path": str(self.models), "container_path": "/models", "readonly": False}]

    def engine_pod(self, name: str, annotations: dict[str, str] | None = None, attempt: int = 0,
                   pod=None) -> tuple[object, str, float]:
        """(pod, container id, StartContainer seconds) of the reference engine in a (new) pod."""
        pod = pod or self.node.run_pod(name, annotations)
        cid = self.node.create(pod, "engine", IMAGE, ENGINE_ARGS, self.mounts(), {"PYTHONDONTWRITEBYTECODE": "1"},
                               attempt=attempt)
        return pod, cid, self.node.start_container(cid)


@pytest.fixture(scope="module", params=["1.6", "2.1"], ids=["containerd-1.6", "containerd-2.1"])
def lab(request, tmp_path_factory):
    """A node on Debian's containerd 1.6 (the host's package), or on Debian sid's 2.1 unpacked into a prefix."""
    needs_root()
    ensure("containerd")
    containerd = None
    if request.param == "2.1":
        r = subprocess.run([str(CONTAINERD2_SH), str(CONTAINERD2)], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"containerd2.sh: {r.stderr[-800:]}"
        containerd = str(CONTAINERD2 / "bin" / "containerd")
    base = tmp_path_factory.mktemp(f"cri-{request.param}")
    lab = Lab(base, containerd)
    with private_coldsnap(base) as mp:
        mp.setenv("COLDSNAP_POLICY_FILE", str(base / "policy.json"))  # absent (the defaults) unless a test writes it
        try:
            lab.node.start(dict(os.environ))
            assert lab.node.version().startswith(("v" + request.param, request.param)), lab.node.version()
            lab.node.import_image(make_rootfs(base / "rootfs"), name=IMAGE)
            yield lab
        finally:
            lab.node.stop()


def completion_at(address: str, port: int = ENGINE_PORT) -> str:
    import urllib.request

    body = json.dumps({"prompt": "ColdSnap says", "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{address}:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def receipt_of(cid: str) -> dict | None:
    path = settings().receipts / f"{cid}.json"
    return json.loads(path.read_text()) if path.exists() else None


def shim_record(cid: str) -> Path:
    return settings().run / "shim" / f"{cid}.json"


def wait_healthy(lab: Lab, pod, cid: str, timeout: float = 120) -> str:
    ip = lab.node.pod_ip(pod)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if healthy_at(ip):
            return ip
        if lab.node.status(cid).state == cri_bench.cri.CONTAINER_EXITED:
            break
        time.sleep(0.2)
    raise AssertionError(f"the engine at {ip} never answered; its log: {lab.node.log_lines(pod, cid)[-10:]}")


@pytest.fixture(scope="module")
def captured(lab):
    """A cold pod (runtime class coldsnap, no annotation), captured by `coldsnap capture --container` against the
    CRI plugin's runc root, as a node agent would."""
    pod, cid, _ = lab.engine_pod("cold")
    ip = wait_healthy(lab, pod, cid)
    text = completion_at(ip)
    r = subprocess.run([str(COLDSNAP), "capture", "--container", cid, "--runc-root", cri_bench.RUNC_ROOT,
                        "--tag", "cri-test", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-1500:]
    capsule = json.loads(r.stdout)["result"]["capsule"]
    passed = {"sandbox": receipt_of(pod.id), "container": receipt_of(cid)}
    lab.node.remove_pod(pod)
    return {"capsule": capsule, "text": text, "passed_through": passed}


def test_an_unannotated_pod_and_its_pause_container_pass_through(captured):
    # No receipt, no record: the shim never looked further than the annotation.
    assert captured["passed_through"] == {"sandbox": None, "container": None}


def test_an_annotated_pod_restores_inside_start_container_validated(lab, captured):
    pod, cid, start_s = lab.engine_pod("restored", {mt.ANNOTATION_CAPSULE: captured["capsule"]})
    # StartContainer returned: the container was restored and validated by then (at its create).
    status = lab.node.status(cid)
    assert status.state == cri_bench.cri.CONTAINER_RUNNING
    rec = receipt_of(cid)
    assert rec and rec["state"] == "succeeded", rec
    assert [s["name"] for s in rec["spans"]] == ["admit", "stage", "criu-restore", "hydrate", "validate"]
    assert rec["result"]["validated_text"] == captured["text"]
    # The pod's address and port, as the pod network gave them: the restored server listens there.
    ip = lab.node.pod_ip(pod)
    assert healthy_at(ip) and completion_at(ip) == captured["text"]
    # In the pod's network and IPC namespaces, the pause container's (the pod IP's).
    pid, pause = (int(json.loads((Path(cri_bench.RUNC_ROOT) / c / "state.json").read_text())["init_process_pid"])
                  for c in (cid, pod.id))
    for ns in ("net", "ipc"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/{pause}/ns/{ns}"), ns
    # The pause container was started as it is (it carries the pod's annotation too).
    assert receipt_of(pod.id) is None and not shim_record(pod.id).exists()
    # ExecSync into the restored container; its log (kubectl logs) shows the restored process's output.
    r = lab.node.exec_sync(cid, ["/bin/sh", "-c", "tr '\\0' ' ' </proc/1/cmdline"])
    assert r.exit_code == 0 and "coldsnap_reference.server" in r.stdout.decode()
    logs = lab.node.log_lines(pod, cid)
    assert any('"event": "resumed"' in line for line in logs), logs[-5:]
    print(f"\n[measured] CRI StartContainer of a restore: {start_s:.3f} s "
          f"(receipt: first token {rec['result']['time_to_first_token_s']} s after the restore began)")

    # The kubelet restarts a container that stopped: a new container in the same pod, attempt 1. It is restored
    # afresh (its own receipt), never handed the old one's state.
    lab.node.stop_container(cid, timeout=2)
    assert lab.node.status(cid).state == cri_bench.cri.CONTAINER_EXITED
    _, again, _ = lab.engine_pod("restored", attempt=1, pod=pod)
    assert again != cid
    rec2 = receipt_of(again)
    assert rec2 and rec2["state"] == "succeeded" and rec2["operation_id"] != rec["operation_id"], rec2
    assert completion_at(ip) == captured["text"]
    lab.node.remove_container(cid)
    assert not shim_record(cid).exists()  # delete forgot it
    lab.node.remove_pod(pod)
    assert not shim_record(again).exists()


def _corrupt_capsule(capsule: str) -> str:
    """The capsule with its CRIU layer named but absent from the store (a partial copy)."""
    from coldsnap.capsule import CapsuleStore

    store = CapsuleStore(settings().store)
    cap = store.load(capsule)
    layer = cap.layer(mt.LAYER_CRIU)
    missing = layer.__class__(layer.media_type, "sha256:" + "d" * 64, layer.size)
    return store.write_capsule(cap.profile, [missing if d is layer else d for d in cap.layers], {})


def test_a_refused_capsule_starts_the_pod_cold(lab, captured):
    pod, cid, _ = lab.engine_pod("fallback", {mt.ANNOTATION_CAPSULE: _corrupt_capsule(captured["capsule"])})
    rec = receipt_of(cid)
    assert rec["state"] == "fell-back" and rec["result"]["fallback_reason"].startswith("capsule-corrupt"), rec
    ip = wait_healthy(lab, pod, cid)
    assert completion_at(ip) == captured["text"]
    lab.node.remove_pod(pod)


def test_no_fallback_fails_start_container_with_a_reason(lab, captured):
    bad = _corrupt_capsule(captured["capsule"])
    pod = lab.node.run_pod("strict", {mt.ANNOTATION_CAPSULE: bad,
                                      mt.ANNOTATION_POLICY: json.dumps({"fallback_to_cold": False})})
    with pytest.raises(grpc.RpcError) as err:
        lab.engine_pod("strict", pod=pod)
    # What `kubectl describe pod` shows under Events: the runtime's own words, ColdSnap's reason in them.
    details = err.value.details()
    assert "coldsnap-runtime: capsule-corrupt" in details, details
    print(f"\n[observed] StartContainer error: {details}")
    cid = next(c.id for c in lab.node.runtime.ListContainers(cri_bench.cri.ListContainersRequest()).containers
               if c.pod_sandbox_id == pod.id)
    assert lab.node.status(cid).state != cri_bench.cri.CONTAINER_RUNNING
    assert receipt_of(cid)["state"] == "failed"
    assert not (Path(cri_bench.RUNC_ROOT) / cid).exists()  # nothing half-restored left behind
    lab.node.remove_pod(pod)


def test_a_pod_outside_the_namespaces_a_policy_names_is_refused(lab, captured):
    """The restore policy's container rule, read from the annotations containerd sets (a pod cannot): a pod in
    namespace default may not restore a capsule the policy gives to team-a only."""
    policy = lab.base / "policy.json"
    policy.write_text(json.dumps({"format": 1, "containers": [
        {"match": captured["capsule"], "namespaces": ["team-a"], "image_digest": "any"}]}))
    try:
        pod = lab.node.run_pod("other-team", {mt.ANNOTATION_CAPSULE: captured["capsule"],
                                              mt.ANNOTATION_POLICY: json.dumps({"fallback_to_cold": False})})
        with pytest.raises(grpc.RpcError) as err:
            lab.engine_pod("other-team", pod=pod)
        assert "coldsnap-runtime: untrusted" in err.value.details() and "team-a" in err.value.details()
        assert "this container is in default" in err.value.details(), err.value.details()
        lab.node.remove_pod(pod)
    finally:
        policy.unlink()


@pytest.mark.parametrize("lab", ["2.1"], indirect=True, ids=["containerd-2.1"])  # the one current Kubernetes uses
def test_a_vllm_pod_is_restored_with_the_same_completions(lab):
    """vLLM (CPU) in a pod: its adapter's container launch as CRI mounts (the engine venv and the model read-only,
    emptyDirs for /tmp and $HOME, a Memory emptyDir for /dev/shm), captured, then restored in a new pod."""
    launch = engine_launch("vllm")
    model = launch.model_id
    mounts = cri_bench.binds_to_mounts(launch_binds(launch))

    def start(name: str, annotations: dict | None = None):
        pod = lab.node.run_pod(name, annotations)
        scratch = [{"host_path": str(d), "container_path": dest, "readonly": False} for d, dest in (
            (lab.node.memory_dir(f"{name}-shm"), "/dev/shm"), (lab.base / f"{name}-tmp", "/tmp"),
            (lab.base / f"{name}-home", "/root"))]
        for m in scratch[1:]:
            Path(m["host_path"]).mkdir(mode=0o1777)
        cid = lab.node.create(pod, "vllm", IMAGE, launch.argv, [*scratch, *mounts],
                              {**launch.env, "HOME": "/root"}, workdir=launch.cwd or "")
        return pod, cid, lab.node.start_container(cid)

    pod, cid, _ = start("vllm-cold")
    wait_healthy(lab, pod, cid, timeout=600)
    pid = int(json.loads((Path(cri_bench.RUNC_ROOT) / cid / "state.json").read_text())["init_process_pid"])
    before = completions_in(pid, model)
    assert len(set(before)) > 1, before
    r = subprocess.run([str(COLDSNAP), "capture", "--container", cid, "--runc-root", cri_bench.RUNC_ROOT,
                        "--engine", "vllm", "--tag", "cri-vllm", "--json"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-1500:]
    capsule = json.loads(r.stdout)["result"]["capsule"]
    lab.node.remove_pod(pod)

    pod, cid, start_s = start("vllm-restored", {mt.ANNOTATION_CAPSULE: capsule})
    rec = receipt_of(cid)
    assert rec and rec["state"] == "succeeded", (rec or {}).get("error") or (rec or {}).get("result")
    pid = int(json.loads((Path(cri_bench.RUNC_ROOT) / cid / "state.json").read_text())["init_process_pid"])
    assert completions_in(pid, model) == before
    assert healthy_at(lab.node.pod_ip(pod))
    print(f"\n[measured] vLLM CRI StartContainer of a restore: {start_s:.3f} s")
    lab.node.remove_pod(pod)
