"""Compatibility profile (a capsule's config blob) and capabilities."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coldsnap.contracts.base import FORMAT_VERSION, Strict
from coldsnap.contracts.request import Engine, Launch, Model, Validation

SnapshotDriver = Literal["criu-process", "criu-runc", "criu-template"]

class GpuInfo(Strict):
    index: int
    name: str
    uuid: str
    memory_mib: int
    compute_capability: str


class HostProfile(Strict):
    """What a restore depends on. Compared field by field at admission."""

    arch: str
    cpu_model: str
    cpu_flags: list[str] = Field(description="Flags a restored process may have probed (a subset must be present).")
    kernel: str
    criu_version: str
    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: list[GpuInfo] = Field(default_factory=list)
    gpu_links: list[str] = Field(default_factory=list, description="How each pair of GPUs is connected, e.g. "
                                 "'0-1:NV18' (18 NVLinks) or '0-1:SYS' (NVML's common-ancestor level).")


class Distributed(Strict):
    """A workload of several ranks (one process each) captured as one unit."""

    world_size: int
    backend: str = Field(description="torch.distributed backend: nccl (one GPU per rank) or gloo (CPU).")
    devices: list[str] = Field(description="The device of each rank, by rank.")
    settings: dict[str, str] = Field(default_factory=dict, description="The environment that made the tree safe to "
                                     "capture (NCCL transports, interfaces): every rank started under it.")


class NetworkPlan(Strict):
    """Addresses fixed at capture; recreated exactly at restore (sockets remember them)."""

    netns: str
    host_veth: str
    workload_veth: str
    host_address: str
    workload_address: str
    prefix_len: int = 30
    port: int


class CapturedFile(Strict):
    """A file the restored process holds open and expects to find as it was at the dump."""

    path: str
    size: int
    mode: int
    layer: bool = Field(default=False, description="A file the container wrote into its own root filesystem (path "
                        "as the container sees it): put back into the new container's root before the restore.")


class ContainerMount(Strict):
    destination: str
    type: str = "bind"
    source: str | None = None
    options: list[str] = Field(default_factory=list)


class ContainerLaunch(Strict):
    """The container a criu-runc capsule was captured from, as its config.json (and the host) said: what a restoring
    container must repeat (coldsnap run-args prints it as podman, docker or ctr options)."""

    image: str | None = Field(default=None, description="The image the container ran, as its engine names it.")
    image_digest: str | None = None
    args: list[str] = Field(default_factory=list)
    cwd: str | None = None
    env_names: list[str] = Field(default_factory=list, description="Names only: values can be secrets.")
    mounts: list[ContainerMount] = Field(default_factory=list)
    namespaces: list[str] = Field(default_factory=list, description="The namespace types the container had.")
    network: Literal["own", "path", "host"] = Field(
        default="own", description="own: a network namespace the runtime made; path: one named by path (a pod's, "
        "podman's or docker's network); host: the host's.")
    network_path: str | None = None
    shm_size: int | None = Field(default=None, description="Bytes of the container's /dev/shm, when it had one.")


class CapsuleProfile(Strict):
    format: Literal[1] = FORMAT_VERSION
    kind: Literal["coldsnap.capsule.profile"] = "coldsnap.capsule.profile"
    created: str
    snapshot_driver: SnapshotDriver = Field(description=(
        "criu-process: a process-mode workload with its device state (the CUDA checkpoint API on a GPU); criu-runc: "
        "a container, through runc; criu-template: a process-mode engine captured before it touched its device, "
        "which rebuilds its device state at restore (no CUDA checkpoint needed, portable across GPU models)"))
    host: HostProfile
    engine: Engine
    engine_version: str | None = None
    model: Model | None = None
    weights_mode: Literal["native", "recovery"]
    kv_discarded: bool
    launch: Launch
    validation: Validation
    expected_text: str = Field(description="The validated completion at capture; restores must reproduce it.")
    network: NetworkPlan | None = Field(default=None, description="Process mode: the netns plan. Containers: None.")
    workload_name: str | None = Field(default=None, description="Process mode: the captured workload's name, the "
                                      "default name of a restore.")
    files: list[CapturedFile] = Field(default_factory=list)
    cuda_pids: int = 0
    gpus_used: list[str] = Field(default_factory=list, description="UUIDs of the GPUs the CUDA processes used, "
                                 "by GPU index (what a restore prefetches the weights onto, through --gpu-map).")
    gpu_memory: dict[str, int] = Field(default_factory=dict, description="GPU UUID (at capture) → bytes the "
                                       "workload held there while it served: the room a restore needs free.")
    distributed: Distributed | None = None
    prefetch_plans: dict[str, list[list[int]]] = Field(
        default_factory=dict, description="GPU UUID (at capture) → the pieces [offset, width, rows, pitch] of the "
        "weights file's data section the rank on that GPU holds: what a restore prefetches onto it (tensor parallel; "
        "none: the whole file).")
    criu_options: list[str] = Field(default_factory=list, description="The CRIU options used, replayable by hand.")
    image_digest: str | None = None
    container: ContainerLaunch | None = Field(default=None, description="Containers: how the container ran.")
    engine_lease: str | None = Field(default=None, description="The lease file the released engine watches "
                                     "(coldsnap.engines.lease): a restore holds it until it resumed the engine.")


class Qualification(Strict):
    claim: str = Field(description="What was measured to work, with its figures.")
    evidence: str = Field(description="The result file the claim is read from (bench/results/…).")


class Capabilities(Strict):
    format: Literal[1] = FORMAT_VERSION
    kind: Literal["coldsnap.capabilities"] = "coldsnap.capabilities"
    coldsnap_version: str
    request_formats: list[int]
    receipt_formats: list[int]
    capsule_formats: list[int]
    operations: list[str]
    engines: list[str]
    snapshot_drivers: list[str]
    weights_modes: list[str]
    results: str = Field(description="Where the result files were read from.")
    qualified: list[Qualification] = Field(description="What was measured to work, each claim read from its result "
                                           "file; empty where no result files are installed.")
