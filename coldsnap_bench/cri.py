"""A Kubernetes node without the kubelet, for `coldsnap bench --via cri` and the CRI tests: a private containerd
with its CRI plugin serving (packaging/containers/setup.sh start-containerd-cri: own root, state and socket,
Debian's CNI plugins on a bridge of its own, the runtime class "coldsnap" registered by `coldsnap runtime configure
--runtime containerd` alone), and a client that makes the calls a kubelet makes, in the kubelet's order, through
the upstream CRI v1 gRPC stubs (PyPI's container-runtime-interface-api)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap_bench.rootfs import oci_archive, pause_rootfs

NAMESPACE = "k8s.io"  # the containerd namespace of the CRI plugin
RUNC_ROOT = "/run/containerd/runc/k8s.io"  # the runc v2 shim's root for it
PAUSE_IMAGE = "localhost/coldsnap-pause:1"
HANDLER = "coldsnap"
SETUP = Path(__file__).resolve().parents[1] / "packaging" / "containers" / "setup.sh"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise ColdSnapError(ErrorCode.RUNTIME, f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Pod:
    id: str
    config: cri.PodSandboxConfig
    log_dir: Path


class Node:
    """containerd (CRI) under base/containerd, the pause image imported; kubelet-like calls on it. subnet_octet
    picks the pods' addresses (10.77.N.0/24) and the bridge's name (cscriN)."""

    def __init__(self, base: Path, subnet_octet: int | None = None, containerd: str | None = None):
        subnet_octet = subnet_octet if subnet_octet is not None else 20 + os.getpid() % 200
        self.base = base
        self.containerd = containerd or "containerd"  # the binary; its own ctr beside it
        self.ctr_binary = str(Path(containerd).with_name("ctr")) if containerd else "ctr"
        self.dir = base / "containerd"
        self.socket = self.dir / "containerd.sock"
        self.env = {"CRI_SUBNET": f"10.77.{subnet_octet}.0/24", "CRI_BRIDGE": f"cscri{subnet_octet}",
                    "PAUSE_IMAGE": PAUSE_IMAGE, "CONTAINERD_BIN": self.containerd}
        self.bridge = self.env["CRI_BRIDGE"]
        self.pods: list[str] = []
        self.memory_dirs: list[Path] = []
        self.channel = None

    # --- the node ---------------------------------------------------------------------------------------------
    def start(self, env: dict[str, str]) -> None:
        r = subprocess.run([str(SETUP), "start-containerd-cri", str(self.dir)], capture_output=True, text=True,
                           env={**env, **self.env})
        if r.returncode != 0:
            raise ColdSnapError(ErrorCode.ENVIRONMENT, f"containerd with CRI did not start: {r.stderr[-800:]}")
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        self.runtime = cri_grpc.RuntimeServiceStub(self.channel)
        self.images = cri_grpc.ImageServiceStub(self.channel)
        wait_for(lambda: self._ready(), 60, "the CRI plugin to report ready")
        self.import_image(*pause_rootfs(self.base / "pause"), name=PAUSE_IMAGE)

    def _ready(self) -> bool:
        try:
            status = self.runtime.Status(cri.StatusRequest(), timeout=5).status
        except grpc.RpcError:
            return False
        return all(c.status for c in status.conditions)

    def stop(self) -> None:
        for pod in list(self.pods):
            self.remove_pod(pod)
        if self.channel is not None:
            self.channel.close()
        subprocess.run([str(SETUP), "stop-containerd", str(self.dir)], capture_output=True)
        for path in self.memory_dirs:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        # what the private node leaves on the host: its bridge
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)

    def version(self) -> str:
        return self.runtime.Version(cri.VersionRequest(), timeout=10).runtime_version

    def ctr(self, *args: str) -> subprocess.CompletedProcess:
        r = subprocess.run([self.ctr_binary, "-a", str(self.socket), "-n", NAMESPACE, *args], capture_output=True,
                           text=True, timeout=300, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise ColdSnapError(ErrorCode.RUNTIME, f"ctr {' '.join(args[:2])}: {r.stderr.strip()[-800:]}")
        return r

    def import_image(self, rootfs: Path, cmd: list[str] | None = None, *, name: str) -> None:
        """An image on the node (as a pre-pulled one is): imported into the CRI plugin's namespace, then looked up
        the way the kubelet does before it creates a container (ImageStatus)."""
        archive = oci_archive(rootfs, self.base / f"{uuid.uuid4().hex[:8]}.tar", name, cmd)
        self.ctr("images", "import", str(archive))
        wait_for(lambda: self.images.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=name))).image.id,
                 30, f"the CRI plugin to see {name}")

    def memory_dir(self, name: str, size: str = "1g") -> Path:
        """A tmpfs on the host, as the kubelet makes for an emptyDir with medium Memory (a pod's bigger /dev/shm)."""
        path = self.base / "memory" / name
        path.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)], check=True)
        self.memory_dirs.append(path)
        return path

    # --- the kubelet's calls ----------------------------------------------------------------------------------
    def run_pod(self, name: str, annotations: dict[str, str] | None = None, handler: str = HANDLER) -> Pod:
        uid = uuid.uuid4().hex
        log_dir = self.dir / "pods" / f"default_{name}_{uid}"
        log_dir.mkdir(parents=True)
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace="default", attempt=0),
            hostname=name, log_directory=str(log_dir), annotations=dict(annotations or {}),
            labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": "default"},
            linux=cri.LinuxPodSandboxConfig(security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.POD, pid=cri.CONTAINER, ipc=cri.POD))))
        pod_id = self.runtime.RunPodSandbox(cri.RunPodSandboxRequest(config=config, runtime_handler=handler),
                                            timeout=120).pod_sandbox_id
        self.pods.append(pod_id)
        return Pod(pod_id, config, log_dir)

    def create(self, pod: Pod, name: str, image: str, command: list[str], mounts: list[dict],
               envs: dict[str, str] | None = None, workdir: str = "", attempt: int = 0) -> str:
        """CreateContainer as the kubelet sends it: the pod's sandbox config beside the container's; mounts are
        {host_path, container_path, readonly}."""
        self.images.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=image)))
        config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name, attempt=attempt), image=cri.ImageSpec(image=image),
            command=command, working_dir=workdir, log_path=f"{name}/{attempt}.log",
            envs=[cri.KeyValue(key=k, value=v) for k, v in (envs or {}).items()],
            mounts=[cri.Mount(**m) for m in mounts],
            labels={"io.kubernetes.container.name": name},
            linux=cri.LinuxContainerConfig(security_context=cri.LinuxContainerSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.POD, pid=cri.CONTAINER, ipc=cri.POD))))
        return self.runtime.CreateContainer(cri.CreateContainerRequest(
            pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config), timeout=60).container_id

    def start_container(self, cid: str, timeout: float = 900) -> float:
        """StartContainer; returns how long the call took (a restore happens inside it)."""
        t0 = time.monotonic()
        self.runtime.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=timeout)
        return time.monotonic() - t0

    def status(self, cid: str) -> cri.ContainerStatus:
        return self.runtime.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=30).status

    def exec_sync(self, cid: str, cmd: list[str], timeout: int = 30) -> cri.ExecSyncResponse:
        return self.runtime.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=timeout),
                                     timeout=timeout + 10)

    def pod_ip(self, pod: Pod) -> str:
        return self.runtime.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod.id),
                                             timeout=30).status.network.ip

    def pod_state(self, pod: Pod) -> int:
        return self.runtime.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod.id),
                                             timeout=30).status.state

    def stop_container(self, cid: str, timeout: int = 10) -> None:
        self.runtime.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=timeout), timeout=timeout + 60)

    def remove_container(self, cid: str) -> None:
        self.runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=60)

    def remove_pod(self, pod: Pod | str) -> None:
        pod_id = pod.id if isinstance(pod, Pod) else pod
        for call, request in ((self.runtime.StopPodSandbox, cri.StopPodSandboxRequest),
                              (self.runtime.RemovePodSandbox, cri.RemovePodSandboxRequest)):
            try:
                call(request(pod_sandbox_id=pod_id), timeout=120)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
        if pod_id in self.pods:
            self.pods.remove(pod_id)

    def sandbox_container(self, pod: Pod) -> str:
        """The id the pause container runs under (the sandbox's own id, in containerd 1.6)."""
        return pod.id

    def log_lines(self, pod: Pod, cid: str) -> list[str]:
        """The container's CRI log (what `kubectl logs` reads): its messages, CRI's timestamp/stream/tag dropped."""
        path = Path(self.status(cid).log_path)
        if not path.exists():
            return []
        return [line.split(" ", 3)[-1] for line in path.read_text(errors="replace").splitlines()]


def binds_to_mounts(binds: list[dict]) -> list[dict]:
    """OCI bind mounts (source, destination, options ending in ro/rw) as CRI mounts."""
    return [{"host_path": b["source"], "container_path": b["destination"], "readonly": b["options"][-1] == "ro"}
            for b in binds]


def spec_of(node: Node, cid: str) -> dict:
    """The OCI spec containerd wrote for a container (its bundle's config.json)."""
    path = node.dir / "state" / "io.containerd.runtime.v2.task" / NAMESPACE / cid / "config.json"
    return json.loads(path.read_text())
