"""capture_container: capture a running runc container (started by runc, podman, docker or containerd) into a
criu-runc capsule. validate → release → quiesce → CUDA checkpoint → `runc checkpoint` → pack → receipt.

The container stops, as a process-mode capture's workload does, unless leave_running. Any failure leaves no
capsule (the store writes atomically) and, when the dump itself failed, the container running as it was.

Quiesce (policy.quiesce): "drain" (default) releases what need not travel and waits until no client is connected;
"none" captures with requests in flight: no release, no wait, and CRIU's network lock holds the container's
network namespace from the dump until a restore into it unlocks it (see container_options)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Literal

from coldsnap.base.files import private_dir
from coldsnap.base.journal import CudaTree, Dir, Journal, Released
from coldsnap.base.paths import settings
from coldsnap.base.progress import Progress, quiet
from coldsnap.capsule.assemble import capsule_profile
from coldsnap.contracts import (
    CapsuleProfile,
    CaptureRequest,
    ColdSnapError,
    ContainerLaunch,
    ContainerMount,
    Engine,
    EngineRelease,
    ErrorCode,
    Launch,
    Lifecycle,
    Model,
    Policy,
    Validation,
)
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.request import EngineName
from coldsnap.contracts.results import CaptureFacts
from coldsnap.criu import CriuDriver
from coldsnap.criu.runc import QUIESCE_MODES, checkpoint_container, container_options
from coldsnap.engines import get_adapter
from coldsnap.engines.base import engine_info
from coldsnap.flows.packing import CaptureResult, thin_and_pack
from coldsnap.flows.quiesce import open_connections, wait_no_connections
from coldsnap.flows.receipts import finish_receipt, receipt_on_failure
from coldsnap.flows.spans import Timeline
from coldsnap.gpu import steps as gpu_steps
from coldsnap.host.profile import host_profile
from coldsnap.oci.runtime import Runc
from coldsnap.oci.spec import coldsnap_annotations, load_spec, netns_path, root_path
from coldsnap.workload import hostfiles
from coldsnap.workload.layer import HeldLayer
from coldsnap.workload.target import Target, validate

DEFAULT_PORT = 8000


def container_state(runc: str, runc_root: str | Path, container_id: str) -> dict:
    r = Runc.at_root(runc, runc_root).state(container_id)
    if r.returncode != 0:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"container {container_id!r} under runc root {runc_root}: "
                            f"{(r.stderr or r.stdout).strip() or 'runc state failed'}")
    state = json.loads(r.stdout)
    if state.get("status") != "running":
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"container {container_id!r} is {state.get('status')}, "
                            "not running")
    return state


def container_launch(spec: dict, image: str | None, image_digest: str | None) -> ContainerLaunch:
    """How the container runs, from its config.json: what a container restoring its capsule must repeat."""
    proc = spec.get("process") or {}
    mounts = [ContainerMount(destination=os.path.normpath(str(m["destination"])), type=str(m.get("type") or "bind"),
                             source=m.get("source"), options=[str(o) for o in m.get("options") or []])
              for m in spec.get("mounts") or [] if isinstance(m, dict) and m.get("destination")]
    namespaces = (spec.get("linux") or {}).get("namespaces") or []
    types = sorted({str(ns.get("type")) for ns in namespaces if isinstance(ns, dict) and ns.get("type")})
    path = netns_path(spec)
    network: Literal["own", "path", "host"] = "host" if "network" not in types else ("path" if path else "own")
    shm = None
    for m in reversed(mounts):
        if m.destination == "/dev/shm":
            size = next((o.split("=", 1)[1] for o in m.options if o.startswith("size=")), None)
            if size is not None:
                shm = _bytes(size)
            elif m.source and os.path.isdir(m.source):  # bound from a tmpfs the engine made (podman, docker)
                st = os.statvfs(m.source)
                shm = st.f_blocks * st.f_frsize
            break
    return ContainerLaunch(image=image, image_digest=image_digest, args=[str(a) for a in proc.get("args") or []],
                           cwd=proc.get("cwd"), env_names=sorted({str(e).split("=", 1)[0] for e in proc.get("env")
                                                                  or []}),
                           mounts=mounts, namespaces=types, network=network, network_path=path, shm_size=shm)


def _bytes(size: str) -> int | None:
    """A tmpfs size option (65536k, 64m, 1g, bytes) in bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    try:
        return int(size[:-1]) * units[size[-1].lower()] if size[-1:].lower() in units else int(size)
    except ValueError:
        return None


def capture_container(container_id: str, runc_root: str | Path = "/run/runc", bundle: str | Path | None = None, *,
                      engine: EngineName = "reference", port: int | None = None, validation: Validation | None = None,
                      image_digest: str | None = None, image: str | None = None,
                      weights_mode: Literal["native", "recovery"] = "native",
                      kv_discard: bool = True, leave_running: bool = False, model: Model | None = None,
                      tag: str | None = None, runc: str = "runc",
                      quiesce: Literal["drain", "none"] = "drain",
                      progress: Progress = quiet) -> CaptureResult:
    """Capture the running container into a capsule (snapshot_driver criu-runc). weights_mode says how the
    engine in the container holds its weights (native: in the images; recovery: file-backed, reloaded).
    quiesce: "drain" (wait for no client connection) or "none" (capture with requests in flight). image: the image
    the container runs, as its engine names it (recorded for `coldsnap run-args`)."""
    if quiesce not in QUIESCE_MODES:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"quiesce must be one of {', '.join(QUIESCE_MODES)} "
                            f"(got {quiesce!r})")
    state = container_state(runc, runc_root, container_id)
    spec = load_spec(bundle or state["bundle"])
    ann = coldsnap_annotations(spec)
    try:
        val_ann = json.loads(ann.get(mt.ANNOTATION_VALIDATION) or "{}")
    except ValueError:
        val_ann = {}
    proc = spec.get("process") or {}
    request = CaptureRequest(
        operation="capture", engine=Engine(name=engine), model=model, tag=tag,
        launch=Launch(command=list(proc.get("args") or []) or None, workdir=proc.get("cwd"),
                      port=port or int(val_ann.get("port") or DEFAULT_PORT),
                      image_digest=image_digest or ann.get(mt.ANNOTATION_IMAGE_DIGEST) or None),
        policy=Policy(weights_mode=weights_mode, kv_discard=kv_discard and quiesce == "drain", quiesce=quiesce),
        validation=validation or Validation(), lifecycle=Lifecycle(leave_running=leave_running))
    if weights_mode not in ("native", "recovery"):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "weights_mode must be native or recovery for a container")
    launch = container_launch(spec, image, request.launch.image_digest)
    tl = Timeline()
    op_id = f"capture-{container_id[:24]}-{uuid.uuid4().hex[:8]}"
    with receipt_on_failure(request, op_id, "capture", tl):
        result, profile = _capture(request, container_id, runc_root, int(state["pid"]), val_ann.get("host"), runc,
                                   tl, progress, shm_source=hostfiles.bound_shm_source(spec), launch=launch,
                                   rootfs=root_path(spec, bundle or state["bundle"]),
                                   mount_points=[str(m.get("destination", "")) for m in spec.get("mounts") or []])
    receipt = finish_receipt(request, op_id, "capture", tl, "succeeded", result=result)
    return CaptureResult(capsule=result.capsule, profile=profile, receipt=receipt)


def _capture(request: CaptureRequest, cid: str, runc_root, pid: int, host: str | None, runc: str, tl: Timeline,
             progress: Progress, shm_source: str | None = None, launch: ContainerLaunch | None = None,
             rootfs: str | None = None, mount_points: list[str] | None = None) -> tuple[CaptureFacts, CapsuleProfile]:
    criu = CriuDriver()
    adapter = get_adapter(request.engine.name)
    target = Target(pid=pid, port=request.launch.port, host=host)
    weights_mode, kv_discard = request.policy.weights_mode, request.policy.kv_discard
    in_flight = request.policy.quiesce == "none"
    # Journaled: a capture killed after it released the engine leaves the container serving once someone looks.
    journal = Journal.begin("container-capture", container=cid)
    tmp = settings().run / "capture" / uuid.uuid4().hex
    journal.add(Dir(str(tmp)))
    images, work = private_dir(tmp) / "images", private_dir(tmp / "work")
    held_shm = held_layer = None
    try:
        progress(f"validating container {cid} at {target.describe()}")
        with tl.span("validate"):
            first = validate(target, request.validation, None)
            validate(target, request.validation, first.text)  # determinism: restores are held to this text
        info = target.call(engine_info)
        served = _served_weights(info, pid)  # while the container is there to look into
        gpu_memory = gpu_steps.memory_held(pid)  # while it serves: the room a restore needs
        options = container_options(request.lifecycle.leave_running, request.policy.quiesce)
        gpu = gpu_steps.GpuCheckpoint()
        connections = 0
        released = EngineRelease()
        release = journal.add(Released(container_pid=pid, host=host, port=request.launch.port,
                                       engine=request.engine.name, weights_mode=weights_mode))
        cuda = journal.add(CudaTree(pid))
        if not in_flight:  # in flight, requests still need their KV cache (and weights): nothing is released
            with tl.span("release"):
                released = target.call(adapter.before_capture, kv_discard, weights_mode)
            kv_discard = kv_discard or bool(released)  # what was released is what a restore must resume
        try:
            if in_flight:
                connections = open_connections(pid, request.launch.port)
                progress(f"capturing with {connections} client connection(s) in flight")
            else:
                with tl.span("quiesce"):
                    wait_no_connections(pid, request.launch.port)
            checkpointed = gpu_steps.memory_held(pid) if gpu_memory else {}  # what the driver is about to save
            with tl.span("gpu-checkpoint"):
                gpu = gpu_steps.checkpoint_tree(pid)
            progress(gpu.summary)
            held_shm = hostfiles.HeldShm(shm_source)  # a bound /dev/shm: its files outlive the container for us
            held_layer = HeldLayer(rootfs, mount_points or [])  # and what it wrote into its root filesystem
            progress("checkpointing with runc + CRIU")
            with tl.span("criu-dump"):
                argv = checkpoint_container(runc, runc_root, cid, images, work, options)
        except ColdSnapError:
            _resume(target, adapter, gpu, kv_discard, weights_mode)  # no dump: the container serves on as it was
            raise
        if not request.lifecycle.leave_running:  # the dump took the container away: nothing left to resume
            journal.drop(release)
            journal.drop(cuda)
        # The bound /dev/shm files the dump refers to, copied at their dump-time bytes before anything resumes.
        files, sources = held_shm.captured(images)
        layer_files, layer_sources = held_layer.captured()
        files, sources = files + layer_files, {**sources, **layer_sources}
        for i, f in enumerate(files):
            sources[f.path] = hostfiles.snapshot_file(sources[f.path], f, private_dir(tmp / "files") / str(i))
        held_shm.close()
        held_layer.close()
        if layer_files:
            progress(f"carrying {len(layer_files)} file(s) the container wrote into its root filesystem "
                     f"({sum(f.size for f in layer_files) / 2**20:.1f} MiB)")
        if request.lifecycle.leave_running:
            with tl.span("resume"):
                _resume(target, adapter, gpu, kv_discard, weights_mode)
                journal.drop(release)
                journal.drop(cuda)
                validate(target, request.validation, first.text)
        model = adapter.saved_model(released) or request.model
        if model is None and weights_mode == "recovery" and served is not None:
            with tl.span("pin-weights"):
                model = adapter.describe_model(served)
        profile = capsule_profile(
            "criu-runc", request, host_profile(criu.version()), first.text, criu_options=options.cli_flags(),
            engine_version=info.get("version"), model=model,
            weights_mode=weights_mode,
            kv_discarded=kv_discard, launch=request.launch, network=None, cuda_pids=len(gpu.pids),
            gpus_used=gpu.gpu_uuids, gpu_memory=gpu_memory, files=files,
            image_digest=request.launch.image_digest, container=launch)
        facts = thin_and_pack(
            images, files, profile, request.tag, released, tl, progress, sources=sources, journal=journal,
            container=cid, left_running=request.lifecycle.leave_running, quiesce=request.policy.quiesce,
            connections_in_flight=connections, validated_text=first.text, weights_mode=weights_mode,
            cuda_processes=len(gpu.pids), gpu_memory_checkpointed=checkpointed if gpu.pids else None,
            criu_options=options.cli_flags(), runc_checkpoint=argv)
        return facts, profile
    finally:
        for held in (held_shm, held_layer):
            if held is not None:
                held.close()
        shutil.rmtree(tmp, ignore_errors=True)
        journal.close()


def _served_weights(info: dict, pid: int) -> str | None:
    """The weights file the engine reports, when the container sees it at its host path (bound at the same path, as
    the adapters' container launches bind it): a recovery capture pins it, so that a restore checks it and
    prefetches it onto the GPU. A file only the container sees is not pinned; its restore reloads it as it finds it.
    Asked before the dump, while /proc/PID/root is the container's."""
    path = (info.get("weights") or {}).get("path")
    if not isinstance(path, str) or not os.path.isabs(path):
        return None
    try:
        return path if os.path.samefile(path, f"/proc/{pid}/root{path}") else None
    except OSError:
        return None


def _resume(target: Target, adapter, gpu, kv_discard: bool, weights_mode: str) -> None:
    gpu_steps.resume_in_place(gpu)
    target.call(adapter.after_capture_left_running, kv_discard, weights_mode)
