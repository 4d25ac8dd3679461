"""capture: start the workload, validate it with a real completion, quiesce, checkpoint GPU state, dump with CRIU,
and write a capsule. Any failure stops the workload and leaves no capsule, process or namespace behind."""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.base.digests import pin_in_background
from coldsnap.base.files import private_dir
from coldsnap.base.journal import Blob, CudaTree, Dir, Journal, Released, ShmFiles, Validated
from coldsnap.base.paths import settings
from coldsnap.base.procfs import alive
from coldsnap.base.progress import Progress, quiet
from coldsnap.capsule import CapsuleStore, pack_dir, trust
from coldsnap.capsule.gc import discard
from coldsnap.capsule.payload import write_payload
from coldsnap.contracts import (
    CapsuleProfile,
    CapturedFile,
    CaptureRequest,
    ColdSnapError,
    EngineRelease,
    ErrorCode,
    Model,
    Receipt,
)
from coldsnap.contracts import capsule as mt
from coldsnap.criu import CriuDriver, CriuOptions, criu_images_open_files, criu_stats, drop_zero_pages
from coldsnap.engines import get_adapter
from coldsnap.engines.lease import hold as hold_lease
from coldsnap.flows.coldstart import last_words, start_cold
from coldsnap.flows.quiesce import wait_no_connections
from coldsnap.flows.receipts import finish_receipt, receipt_on_failure
from coldsnap.flows.resources import out_of_room
from coldsnap.flows.spans import Timeline
from coldsnap.gpu import codestash
from coldsnap.gpu import steps as gpu_steps
from coldsnap.host.profile import host_profile
from coldsnap.net import destroy_network, netns_inode
from coldsnap.workload import hostfiles
from coldsnap.workload.claim import claimed
from coldsnap.workload.process import kill_tree
from coldsnap.workload.state import WorkloadState, run_dir, save_state


@dataclass
class CaptureResult:
    capsule: str
    profile: CapsuleProfile
    receipt: Receipt



def capture(request: CaptureRequest, progress: Progress = quiet) -> CaptureResult:
    """--snapshot-driver full (the default): the serving workload with its device state. template: the engine
    before it touches its device. both: the template first, then the full capsule, which names it."""
    tl = Timeline()
    op_id = request.id or f"capture-{uuid.uuid4().hex[:12]}"
    with receipt_on_failure(request, op_id, "capture", tl):
        if request.snapshot_driver == "template" and request.lifecycle.leave_running:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "a template capture stops its workload (it serves once, "
                                "to learn the text restores are held to); with --snapshot-driver both, "
                                "--leave-running keeps the full capture's workload")
        adapter = get_adapter(request.engine.name)
        if request.snapshot_driver != "full" and not adapter.supports_template:
            adapter.template_launch(request)  # says why, before anything starts
        template = None
        if request.snapshot_driver != "full":
            progress("capturing the pre-device template")
            template_tl = tl if request.snapshot_driver == "template" else Timeline()
            once = request.model_copy(update={"lifecycle": request.lifecycle.model_copy(
                update={"leave_running": False})})  # the template serves once, to learn its text, then stops
            template, profile = _capture(once, template_tl, progress, template=True)
            result = template
        if request.snapshot_driver != "template":
            result, profile = _capture(request, tl, progress,
                                       template_capsule=template["capsule"] if template else None)
            if template:
                result["template"] = {**template, "spans": [s.model_dump() for s in template_tl.spans]}
    receipt = finish_receipt(request, op_id, "capture", tl, "succeeded", result=result)
    return CaptureResult(capsule=result["capsule"], profile=profile, receipt=receipt)


def _capture(request: CaptureRequest, tl: Timeline, progress: Progress, template: bool = False,
             template_capsule: str | None = None) -> tuple[dict, CapsuleProfile]:
    """One capture of a process tree. template: the engine's pre-device template (criu-template): dumped as soon
    as it says it is ready, then resumed once into a serving engine for the completion its restores are held to.
    template_capsule: the digest of the template captured with this one, named in the capsule's annotations."""
    name = request.lifecycle.name or f"{request.engine.name}-{uuid.uuid4().hex[:6]}"
    with claimed(name, "capture"):  # until a --leave-running workload's state file is written, or it is gone
        return _capture_named(name, request, tl, progress, template, template_capsule)


def _capture_named(name: str, request: CaptureRequest, tl: Timeline, progress: Progress, template: bool,
                   template_capsule: str | None) -> tuple[dict, CapsuleProfile]:
    cfg = settings()
    if request.policy.quiesce != "drain":
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "quiesce none (capture with connections in flight) is for "
                            "containers (capture --container): a process-mode restore recreates its network")
    criu = CriuDriver()
    adapter = get_adapter(request.engine.name)
    launch = adapter.template_launch(request) if template else adapter.prepare(request)
    leave_running = request.lifecycle.leave_running
    # Everything this capture makes is journaled before it exists: a capture killed at any point is undone by
    # whoever looks next (coldsnap.flows.recovery), and a --leave-running workload is resumed, not lost.
    journal = Journal.begin("capture", workload=name, leave_running=leave_running, engine=request.engine.name,
                            weights_mode=launch.weights_mode)
    work = cfg.run / "capture" / uuid.uuid4().hex
    journal.add(Dir(str(work)))
    images = private_dir(work) / "images"
    wdir_entry = journal.add(Dir(str(cfg.run / "workloads" / name), workload_dir=True))
    wdir = run_dir(name)
    lease = hold_lease(wdir / "engine.lease")  # the engine resumes itself if this capture dies (engines.lease)
    cold = None
    workload_kept = False
    shm_names: list[str] = []
    extra: list[CapturedFile] = []
    try:
        progress(f"starting the {request.engine.name} engine cold "
                 + ("as a pre-device template" if template else f"(weights mode {launch.weights_mode})"))
        pinned_ahead = pin_in_background(launch.pin_ahead)  # one sha256 stream per file: under the cold start
        with tl.span("cold-start"):
            cold = start_cold(name, request.launch.port, launch.argv, launch.env, launch.cwd, request.validation,
                              journal=journal, template=template)
        pid, probe, first, plan = cold.state.pid, cold.probe, cold.first, cold.state.plan
        journal.about["plan"] = plan.model_dump()
        progress(f"network {plan.netns}: {plan.workload_address}:{plan.port} (host side {plan.host_address})")
        log = Path(cold.state.log)
        if template:
            progress(f"template ready after {cold.ready - cold.started:.1f} s (nothing to validate before the device)")
        else:
            progress(f"ready after {cold.ready - cold.started:.1f} s; validated: {first.text!r}")
            with tl.span("validate"):
                probe.complete(expected=first.text)  # determinism: a restore will be held to this text
            journal.add(Validated())  # from here a --leave-running workload is kept whatever happens to the capture

        model = request.model or launch.model
        info = engine_info(plan.workload_address, plan.port)
        gpu_memory = gpu_steps.memory_held(pid)  # while it serves: the room a restore needs
        describe = launch.describe_model
        if describe is None and hasattr(adapter, "describe_model") and info.get("weights", {}).get("path"):
            describe = lambda: adapter.describe_model(info["weights"]["path"])  # noqa: E731 - the file it serves
        if model is None and describe is not None:
            with tl.span("pin-weights"):  # each file's sha256 is one stream (its OCI digest): remembered after
                pinned_ahead()  # what the cold start left of it
                model = describe()

        if template:  # nothing to release, no connection, no device state: dump it as it is
            tag = request.tag if request.snapshot_driver == "template" or not request.tag else f"{request.tag}-template"
            return _dump_template(request, tl, progress, criu, adapter, launch, cold, info, model, images, wdir, tag,
                                  journal)
        released_entry = journal.add(Released(host=plan.workload_address, port=plan.port,
                                              engine=request.engine.name, weights_mode=launch.weights_mode))
        with tl.span("release"):
            # native: the weights leave the dump as a file of their own, where the engine can save them (a
            # container's engine would save inside the container's filesystem, so container capture does not ask
            # for that, nor for its CUDA code as files)
            released = adapter.before_capture(plan.workload_address, plan.port, request.policy.kv_discard,
                                              launch.weights_mode, save_weights=True, code_dir=_code_dir(),
                                              lease=lease.path)
        model = saved_weights_model(adapter, released) or model
        with tl.span("quiesce"):
            wait_no_connections(pid, plan.port)
        # Host /dev/shm names the tree uses (a semaphore's real name among them): removed with the dumped tree.
        shm_names = hostfiles.tree_shm_files(pid)
        journal.add(ShmFiles(shm_names, with_workload=True))

        cuda_entry = journal.add(CudaTree(pid))
        with tl.span("gpu-checkpoint"):
            gpu = gpu_steps.checkpoint_tree(pid)
        progress(gpu.summary)
        ranks = (info.get("tensor_parallel") or {}).get("size", 1)
        if ranks > 1:
            progress(f"{ranks} tensor-parallel ranks in one tree: one dump")

        options = CriuOptions(leave_running=leave_running, host_mounts=True)
        progress("dumping with CRIU")
        dump_stats, extra, extra_src = _dump(criu, pid, images, options, plan, tl)

        if leave_running:
            with tl.span("resume"):
                gpu_steps.resume_in_place(gpu)
                journal.drop(cuda_entry)
                adapter.after_capture_left_running(plan.workload_address, plan.port, bool(released),
                                                   launch.weights_mode)
                journal.drop(released_entry)
                probe.complete(expected=first.text)
            # From here the workload serves as it did before the capture, whatever happens to the capsule.
            save_state(WorkloadState(name=name, pid=pid, network=plan.model_dump(), origin="cold",
                                     run_dir=str(wdir), log=str(log),
                                     url=f"http://{plan.workload_address}:{plan.port}",
                                     engine=request.engine.name, weights_mode=launch.weights_mode))
            workload_kept = True
            for entry in (*cold.journaled, wdir_entry):
                journal.drop(entry)
        files = _captured_files(images, wdir) + extra
        profile = capsule_profile(
            "criu-process", request, criu, info, first.text, model=model, weights_mode=launch.weights_mode,
            kv_discarded=bool(released), cuda_pids=len(gpu.pids), gpus_used=gpu.gpu_uuids, options=options,
            gpu_memory=gpu_memory,
            launch=request.launch.model_copy(update={"command": launch.argv, "env": launch.env,
                                                     "workdir": launch.cwd}),
            engine_version=info.get("version") or launch.engine_version,
            network=plan, workload_name=name, files=files, distributed=adapter.distributed(info),
            engine_lease=lease.path if released else None,
            prefetch_plans=released.prefetch_plans)
        packed = thin_and_pack(images, files, profile, request.tag, released, tl, progress, extra_src,
                               journal=journal, template_capsule=template_capsule)
        return {
            **packed,
            "tag": request.tag,
            "snapshot_driver": "criu-process",
            "workload": name,
            "pid": pid,
            "left_running": leave_running,
            "cold_start_to_ready_s": round(cold.ready - cold.started, 3),
            "cold_time_to_first_token_s": round(cold.time_to_first_token, 3),
            "validated_text": first.text,
            "weights_mode": launch.weights_mode,
            "cuda_processes": len(gpu.pids),
            "criu_options": options.cli_flags(),
            "criu_stats": dump_stats,
            **({"release": released.facts()} if released else {}),
        }, profile
    except ColdSnapError as e:
        if cold is not None and e.code == ErrorCode.WORKLOAD_FAILED and not alive(cold.state.pid):
            # its log goes with its run directory below: say now why it died
            why = last_words(cold.state.log)
            raise ColdSnapError(e.code, f"{e.message}; the engine died" + (f" ({why})" if why else "")) from None
        raise
    finally:
        lease.release()
        if not workload_kept:
            if cold is not None:
                kill_tree(cold.state.pid)
                destroy_network(cold.state.plan)
                # the dumped tree's, orphaned now; CUDA code files are shared by content and stay
                for path in set(shm_names) | {f.path for f in extra if not codestash.is_code_file(f.path)}:
                    Path(path).unlink(missing_ok=True)
            shutil.rmtree(wdir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        journal.close()


def _dump(criu: CriuDriver, pid: int, images: Path, options: CriuOptions, plan, tl: Timeline):
    """The CRIU dump (a span of its own), its stats, and the state outside the images (host /dev/shm files) with
    their dump-time bytes snapshotted before anything resumes: (stats, extra files, {path: snapshot})."""
    with tl.span("criu-dump"):
        criu.dump(pid, images, options, netns_inode(plan.netns))
    extra = hostfiles.extra_files(images)
    extra_src = {f.path: hostfiles.snapshot_file(f.path, f, private_dir(images.parent / "extra") / str(i))
                 for i, f in enumerate(extra)}
    return criu_stats(images, "dump"), extra, extra_src


def _dump_template(request: CaptureRequest, tl: Timeline, progress: Progress, criu: CriuDriver, adapter, launch,
                   cold, info: dict, model: Model | None, images: Path, wdir: Path, tag: str | None,
                   journal: Journal) -> tuple[dict, CapsuleProfile]:
    """criu-template: dump the template as it is, left running; then resume it once into a serving engine (the
    device work a restore will do) for the completion its restores are held to. The caller stops it."""
    pid, plan, probe = cold.state.pid, cold.state.plan, cold.probe
    options = CriuOptions(leave_running=True, host_mounts=True)
    progress("dumping the template with CRIU")
    dump_stats, extra, extra_src = _dump(criu, pid, images, options, plan, tl)
    with tl.span("validate"):
        adapter.after_restore(plan.workload_address, plan.port, True, "recovery")
        probe.wait_ready(alive=lambda: alive(pid))
        first = probe.complete()
        probe.complete(expected=first.text)  # determinism: a restore will be held to this text
    progress(f"the template, resumed once, served: {first.text!r}")
    files = _captured_files(images, wdir) + extra
    profile = capsule_profile(
        "criu-template", request, criu, info, first.text, options=options,
        engine_version=info.get("version") or launch.engine_version, model=model, weights_mode="recovery",
        kv_discarded=True, launch=request.launch.model_copy(update={"command": launch.argv, "env": launch.env,
                                                                    "workdir": launch.cwd}),
        network=plan, workload_name=cold.state.name, files=files)
    packed = thin_and_pack(images, files, profile, tag, None, tl, progress, extra_src, journal=journal)
    return {**packed, "tag": tag, "workload": cold.state.name, "snapshot_driver": "criu-template",
            "template_ready_s": round(cold.ready - cold.started, 3), "validated_text": first.text,
            "weights_mode": "recovery", "criu_options": options.cli_flags(), "criu_stats": dump_stats}, profile


def engine_info(host: str, port: int) -> dict:
    import http.client

    try:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/coldsnap/info", headers={"Connection": "close"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return json.loads(data) if resp.status == 200 else {}
    except (OSError, ValueError):
        return {}


def _code_dir() -> str | None:
    """Where engines put the CUDA device code they hold in anonymous memory (coldsnap.gpu.codestash); None with
    COLDSNAP_CODE_STASH=0. On by default since restores of stashed capsules validated on the GPU machines (tensor
    parallel 2: 420 MB less to dump; one GPU: 92 MB)."""
    if not settings().code_stash:
        return None
    return str(private_dir(settings().code))


def _captured_files(images: Path, wdir: Path) -> list[CapturedFile]:
    """Files in the workload's run dir that the tree holds open: restore needs them back at their dump-time size."""
    out = []
    for f in criu_images_open_files(images):
        if f["path"].startswith(str(wdir) + "/"):
            out.append(CapturedFile(path=f["path"], size=f["size"], mode=0o600))
    return out


def capsule_profile(driver: str, request: CaptureRequest, criu: CriuDriver, info: dict, expected_text: str, *,
                    options: CriuOptions, engine_version: str | None, **fields) -> CapsuleProfile:
    """The profile of a capsule, process or container: what both captures record alike, plus their own fields."""
    return CapsuleProfile(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        snapshot_driver=driver,
        host=host_profile(criu.version()),
        engine=request.engine,
        engine_version=engine_version,
        validation=request.validation.model_copy(update={"expected_text": expected_text}),
        expected_text=expected_text,
        criu_options=options.cli_flags(),
        **fields,
    )


def thin_and_pack(images: Path, files: list[CapturedFile], profile: CapsuleProfile, tag: str | None,
                  released: EngineRelease, tl: Timeline, progress: Progress,
                  sources: dict[str, str] | None = None, journal: Journal | None = None,
                  template_capsule: str | None = None) -> dict:
    """Drop the dump's zero pages, pack the capsule; returns what the receipt says of it. Its layers are written in
    a scratch directory of the store (journaled: a pack killed midway leaves nothing once someone looks), and the
    blobs it writes or reuses are protected from gc while the capture lives."""
    with tl.span("thin"):
        thinned = drop_zero_pages(images)
    progress(thinned.summary)
    store = CapsuleStore(settings().store).init()
    scratch = store.root / "tmp" / f"pack-{uuid.uuid4().hex}"
    entry = journal.add(Dir(str(scratch))) if journal else None
    try:
        with tl.span("pack"):
            progress("packing the capsule")
            weights_apart = weights_travel_apart(profile, released)
            digest = write_capsule(store, private_dir(scratch), files, images, profile, tag, sources,
                                   payload=weights_apart, journal=journal, template_capsule=template_capsule)
    except BaseException as e:
        discard(store, store.written, journal)  # what this capture wrote and nothing else uses: room for the next try
        if isinstance(e, OSError):
            raise out_of_room(e, scratch, images) from None
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if entry:
            journal.drop(entry)
    size = sum(int(layer["size"]) for layer in json.loads(
        CapsuleStore(settings().store).blob_path(digest).read_text())["layers"])
    signed_by = trust.adopt_capture(store, digest)  # signed with this host's key: how a restore knows it
    progress(f"capsule {digest} ({size / 2**20:.1f} MiB), signed by this host's key {signed_by[:12]}…")
    return {"capsule": digest, "capsule_bytes": size, "zero_pages": thinned.as_dict(), "weights_apart": weights_apart,
            "signed_by": signed_by}


def saved_weights_model(adapter, released: EngineRelease) -> Model | None:
    """The model as the engine saved its in-memory weights at release (native mode, engines that can): that file,
    not the one it loaded, is what a restore reloads."""
    saved = released.saved_weights
    return adapter.describe_model(saved) if saved else None


def weights_travel_apart(profile: CapsuleProfile, released: EngineRelease) -> bool:
    """Whether the weights go as a payload beside the images: pinned files (recovery) or the engine's own save of
    its native weights. Otherwise (native weights kept in memory) they are in the images."""
    return profile.weights_mode == "recovery" or bool(released.saved_weights)


def write_capsule(store: CapsuleStore, scratch: Path, files: list[CapturedFile], images: Path,
                  profile: CapsuleProfile, tag: str | None, sources: dict[str, str] | None = None,
                  payload: bool = False, journal: Journal | None = None, template_capsule: str | None = None) -> str:
    """The capsule's layers packed in scratch (a directory of the store's file system the caller removes), moved
    into the store as blobs, then its manifest indexed."""
    def keep(desc):
        if journal:  # gc spares a blob an in-flight capture wrote or reuses, until it is indexed
            journal.add(Blob(desc.digest))
        return desc

    layers = []
    criu_tar = scratch / "criu.tar.zst"
    pack_dir(images, criu_tar, skip=("dump.log",))
    layers.append(keep(store.put_file(criu_tar, mt.LAYER_CRIU, {mt.ANNOTATION_TITLE: "criu-images"}, move=True)))
    if files:
        staging = private_dir(scratch / "files")
        for i, f in enumerate(files):
            # Only the bytes that existed at the dump: restore truncates to this size anyway.
            # sparse: shm queues are hundreds of MB of holes
            hostfiles.copy_sparse((sources or {}).get(f.path, f.path), staging / str(i), f.size)
        files_tar = scratch / "files.tar.zst"
        pack_dir(staging, files_tar)
        layers.append(keep(store.put_file(files_tar, mt.LAYER_FILES, {mt.ANNOTATION_TITLE: "captured-files"},
                                          move=True)))
    weights_manifest = {"mode": profile.weights_mode,
                        "files": [w.model_dump() for w in (profile.model.weights if profile.model else [])]}
    layers.append(keep(store.put_bytes(json.dumps(weights_manifest, sort_keys=True).encode(),
                                       mt.LAYER_WEIGHTS_MANIFEST, {mt.ANNOTATION_TITLE: "weights-manifest"})))
    annotations = {mt.ANNOTATION_ENGINE: profile.engine.name}
    # Names only, never values: so that whoever restores the capsule can see that a token travelled in its memory.
    env_names = profile.container.env_names if profile.container else sorted(profile.launch.env)
    if env_names:
        annotations[mt.ANNOTATION_ENV_NAMES] = ",".join(env_names)
    if payload and profile.model and profile.model.weights:
        # The weight files as a content-addressed payload artifact beside the images: restores on a host that lacks
        # them pull it once, and capsules of the same weights share it.
        annotations[mt.ANNOTATION_PAYLOAD] = write_payload(store, profile.model.weights, keep=keep, scratch=scratch)
    if profile.model:
        annotations[mt.ANNOTATION_MODEL] = f"{profile.model.id}@{profile.model.revision}"
    if template_capsule:
        annotations[mt.ANNOTATION_TEMPLATE] = template_capsule
    return store.write_capsule(profile, layers, annotations, tag)
