"""capture: start the workload, validate it with a real completion, quiesce, checkpoint GPU state, dump with CRIU,
and write a capsule. Any failure stops the workload and leaves no capsule, process or namespace behind."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from coldsnap.base.digests import pin_in_background
from coldsnap.base.files import private_dir
from coldsnap.base.journal import CudaTree, Dir, Journal, Released, ShmFiles, Validated
from coldsnap.base.paths import settings
from coldsnap.base.procfs import alive
from coldsnap.base.progress import Progress, quiet
from coldsnap.capsule.assemble import capsule_profile
from coldsnap.contracts import CapsuleProfile, CapturedFile, CaptureRequest, ColdSnapError, ErrorCode, Model
from coldsnap.contracts.results import CaptureFacts
from coldsnap.criu import CriuDriver, CriuOptions, criu_images_open_files, criu_stats
from coldsnap.engines import get_adapter
from coldsnap.engines.base import EngineAdapter, PreparedLaunch, engine_info
from coldsnap.engines.lease import hold as hold_lease
from coldsnap.flows.coldstart import ColdStart, last_words, start_cold
from coldsnap.flows.packing import CaptureResult, thin_and_pack
from coldsnap.flows.quiesce import wait_no_connections
from coldsnap.flows.receipts import finish_receipt, receipt_on_failure
from coldsnap.flows.spans import Timeline
from coldsnap.gpu import codestash
from coldsnap.gpu import steps as gpu_steps
from coldsnap.host.profile import host_profile
from coldsnap.net import destroy_network, netns_inode
from coldsnap.workload import hostfiles
from coldsnap.workload.claim import claimed
from coldsnap.workload.probe import ProbeResult
from coldsnap.workload.process import kill_tree
from coldsnap.workload.state import WorkloadState, run_dir, save_state

__all__ = ["CaptureResult", "capture"]


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
                                       template_capsule=template.capsule if template else None)
            if template:
                result.template = template.model_copy(update={"spans": [s.model_dump() for s in template_tl.spans]})
    receipt = finish_receipt(request, op_id, "capture", tl, "succeeded", result=result)
    return CaptureResult(capsule=result.capsule, profile=profile, receipt=receipt)


def _capture(request: CaptureRequest, tl: Timeline, progress: Progress, template: bool = False,
             template_capsule: str | None = None) -> tuple[CaptureFacts, CapsuleProfile]:
    """One capture of a process tree. template: the engine's pre-device template (criu-template): dumped as soon
    as it says it is ready, then resumed once into a serving engine for the completion its restores are held to.
    template_capsule: the digest of the template captured with this one, named in the capsule's annotations."""
    if request.policy.quiesce != "drain":
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "quiesce none (capture with connections in flight) is for "
                            "containers (capture --container): a process-mode restore recreates its network")
    name = request.lifecycle.name or f"{request.engine.name}-{uuid.uuid4().hex[:6]}"
    adapter = get_adapter(request.engine.name)
    launch = adapter.template_launch(request) if template else adapter.prepare(request)
    with claimed(name, "capture"), _Capturing(name, request, launch) as c:  # the claim: until a --leave-running
        # workload's state file is written, or it is gone
        _start(c, tl, progress, template)
        info, model = _describe(c, adapter, tl)
        if template:  # nothing to release, no connection, no device state: dump it as it is
            tag = request.tag if request.snapshot_driver == "template" or not request.tag else f"{request.tag}-template"
            return _dump_template(c, adapter, info, model, tag, tl, progress)
        return _dump_serving(c, adapter, info, model, template_capsule, tl, progress)


class _Capturing:
    """What one process capture has made so far. Everything is journaled before it exists: a capture killed at any
    point is undone by whoever looks next (coldsnap.flows.recovery), and a --leave-running workload is resumed, not
    lost. On the way out (any way), whatever the capture made goes, unless the workload was kept serving."""

    def __init__(self, name: str, request: CaptureRequest, launch: PreparedLaunch):
        self.name, self.request, self.launch = name, request, launch
        cfg = settings()
        self.journal = Journal.begin("capture", workload=name, leave_running=request.lifecycle.leave_running,
                                     engine=request.engine.name, weights_mode=launch.weights_mode)
        self.work = cfg.run / "capture" / uuid.uuid4().hex
        self.journal.add(Dir(str(self.work)))
        self.images = private_dir(self.work) / "images"
        self.wdir_entry = self.journal.add(Dir(str(cfg.run / "workloads" / name), workload_dir=True))
        self.wdir = run_dir(name)
        self.lease = hold_lease(self.wdir / "engine.lease")  # the engine resumes itself if this capture dies
        self.criu = CriuDriver()
        self.cold: ColdStart | None = None
        self.kept = False  # a --leave-running workload serves on: nothing of it is undone
        self.shm_names: list[str] = []
        self.extra: list[CapturedFile] = []
        self.pinned_ahead: Callable[[], None] = lambda: None
        self.gpu_memory: dict[str, int] = {}

    def __enter__(self) -> _Capturing:
        return self

    def __exit__(self, kind, e, tb) -> None:
        try:
            if isinstance(e, ColdSnapError) and self.cold is not None and e.code == ErrorCode.WORKLOAD_FAILED \
                    and _dies(self.cold.state.pid):
                # its log goes with its run directory below: say now why it died
                why = last_words(self.cold.state.log)
                raise ColdSnapError(e.code, f"{e.message}; the engine died" + (f" ({why})" if why else "")) from None
        finally:
            self._undo()

    def _undo(self) -> None:
        self.lease.release()
        if not self.kept:
            if self.cold is not None:
                kill_tree(self.cold.state.pid)
                destroy_network(self.cold.state.plan)
                # the dumped tree's, orphaned now; CUDA code files are shared by content and stay
                for path in set(self.shm_names) | {f.path for f in self.extra if not codestash.is_code_file(f.path)}:
                    Path(path).unlink(missing_ok=True)
            shutil.rmtree(self.wdir, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)
        self.journal.close()

    @property
    def started(self) -> ColdStart:
        assert self.cold is not None, "the workload is started before anything reads it"
        return self.cold

    @property
    def served(self) -> ProbeResult:
        """The completion a serving workload gave at its cold start: what its restores are held to."""
        assert self.started.first is not None, "a serving workload (not a template) has served"
        return self.started.first

    def launch_record(self):
        return self.request.launch.model_copy(update={"command": self.launch.argv, "env": self.launch.env,
                                                      "workdir": self.launch.cwd})


def _dies(pid: int, within: float = 2.0) -> bool:
    """Whether the engine is dead or dying: a killed process resets its connections while the kernel tears it down,
    so a request can fail a moment before /proc says it is gone."""
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def _start(c: _Capturing, tl: Timeline, progress: Progress, template: bool) -> None:
    """Start the engine cold on a network of its own; a serving one is validated twice (its restores are held to
    that text)."""
    request, launch = c.request, c.launch
    progress(f"starting the {request.engine.name} engine cold "
             + ("as a pre-device template" if template else f"(weights mode {launch.weights_mode})"))
    c.pinned_ahead = pin_in_background(launch.pin_ahead)  # one sha256 stream per file: under the cold start
    with tl.span("cold-start"):
        c.cold = start_cold(c.name, request.launch.port, launch.argv, launch.env, launch.cwd, request.validation,
                            journal=c.journal, template=template)
    plan = c.cold.state.plan
    c.journal.about["plan"] = plan.model_dump()
    progress(f"network {plan.netns}: {plan.workload_address}:{plan.port} (host side {plan.host_address})")
    if template:
        progress(f"template ready after {c.cold.ready - c.cold.started:.1f} s (nothing to validate before the device)")
        return
    progress(f"ready after {c.cold.ready - c.cold.started:.1f} s; validated: {c.served.text!r}")
    with tl.span("validate"):
        c.cold.probe.complete(expected=c.served.text)  # determinism: a restore will be held to this text
    c.journal.add(Validated())  # from here a --leave-running workload is kept whatever happens to the capture


def _describe(c: _Capturing, adapter: EngineAdapter, tl: Timeline) -> tuple[dict, Model | None]:
    """What the engine says of itself, and the model it serves, pinned (hashed while it started)."""
    plan = c.started.state.plan
    info = engine_info(plan.workload_address, plan.port)
    c.gpu_memory = gpu_steps.memory_held(c.started.state.pid)  # while it serves: the room a restore needs
    model = c.request.model or c.launch.model
    describe: Callable[[], Model | None] | None = c.launch.describe_model
    weights_path = (info.get("weights") or {}).get("path")
    if describe is None and weights_path:
        describe = lambda: adapter.describe_model(weights_path)  # noqa: E731 - the file it serves
    if model is None and describe is not None:
        with tl.span("pin-weights"):  # each file's sha256 is one stream (its OCI digest): remembered after
            c.pinned_ahead()  # what the cold start left of it
            model = describe()
    return info, model


def _dump_serving(c: _Capturing, adapter: EngineAdapter, info: dict, model: Model | None,
                  template_capsule: str | None, tl: Timeline, progress: Progress) -> tuple[CaptureFacts,
                                                                                             CapsuleProfile]:
    """criu-process: release what need not travel, quiesce, checkpoint the device, dump; resume a --leave-running
    workload; pack."""
    request, launch, cold, journal = c.request, c.launch, c.started, c.journal
    pid, plan = cold.state.pid, cold.state.plan
    leave_running = request.lifecycle.leave_running
    released_entry = journal.add(Released(host=plan.workload_address, port=plan.port,
                                          engine=request.engine.name, weights_mode=launch.weights_mode))
    with tl.span("release"):
        # native: the weights leave the dump as a file of their own, where the engine can save them (a container's
        # engine would save inside the container's filesystem, so container capture does not ask for that, nor for
        # its CUDA code as files)
        released = adapter.before_capture(plan.workload_address, plan.port, request.policy.kv_discard,
                                          launch.weights_mode, save_weights=True, code_dir=_code_dir(),
                                          lease=c.lease.path)
    model = adapter.saved_model(released) or model
    with tl.span("quiesce"):
        wait_no_connections(pid, plan.port)
    # Host /dev/shm names the tree uses (a semaphore's real name among them): removed with the dumped tree.
    c.shm_names = hostfiles.tree_shm_files(pid)
    journal.add(ShmFiles(c.shm_names, with_workload=True))

    cuda_entry = journal.add(CudaTree(pid))
    checkpointed = gpu_steps.memory_held(pid) if c.gpu_memory else {}  # what the driver is about to save
    with tl.span("gpu-checkpoint"):
        gpu = gpu_steps.checkpoint_tree(pid)
    progress(gpu.summary)
    ranks = (info.get("tensor_parallel") or {}).get("size", 1)
    if ranks > 1:
        progress(f"{ranks} tensor-parallel ranks in one tree: one dump")

    options = CriuOptions(leave_running=leave_running, host_mounts=True)
    progress("dumping with CRIU")
    dump_stats, c.extra, extra_src = _dump(c, options, tl)

    if leave_running:
        with tl.span("resume"):
            gpu_steps.resume_in_place(gpu)
            journal.drop(cuda_entry)
            adapter.after_capture_left_running(plan.workload_address, plan.port, bool(released),
                                               launch.weights_mode)
            journal.drop(released_entry)
            cold.probe.complete(expected=c.served.text)
        _keep_serving(c)  # from here the workload serves as it did before, whatever happens to the capsule
    files = _captured_files(c.images, c.wdir) + c.extra
    profile = capsule_profile(
        "criu-process", request, host_profile(c.criu.version()), c.served.text,
        criu_options=options.cli_flags(), engine_version=info.get("version") or launch.engine_version,
        model=model, weights_mode=launch.weights_mode, kv_discarded=bool(released), cuda_pids=len(gpu.pids),
        gpus_used=gpu.gpu_uuids, gpu_memory=c.gpu_memory, launch=c.launch_record(), network=plan,
        workload_name=c.name, files=files, distributed=adapter.distributed(info),
        engine_lease=c.lease.path if released else None, prefetch_plans=released.prefetch_plans)
    facts = thin_and_pack(
        c.images, files, profile, request.tag, released, tl, progress, sources=extra_src, journal=journal,
        template_capsule=template_capsule, snapshot_driver="criu-process", workload=c.name, pid=pid,
        left_running=leave_running, cold_start_to_ready_s=round(cold.ready - cold.started, 3),
        cold_time_to_first_token_s=round(cold.time_to_first_token, 3), validated_text=c.served.text,
        weights_mode=launch.weights_mode, cuda_processes=len(gpu.pids), criu_options=options.cli_flags(),
        gpu_memory_checkpointed=checkpointed if gpu.pids else None, criu_stats=dump_stats,
        release=released.facts() if released else None)
    return facts, profile


def _keep_serving(c: _Capturing) -> None:
    """A --leave-running workload, resumed and validated: its state file owns it now, not the capture."""
    cold = c.started
    save_state(WorkloadState(name=c.name, pid=cold.state.pid, network=cold.state.plan.model_dump(), origin="cold",
                             run_dir=str(c.wdir), log=cold.state.log,
                             url=f"http://{cold.state.plan.workload_address}:{cold.state.plan.port}",
                             engine=c.request.engine.name, weights_mode=c.launch.weights_mode))
    c.kept = True
    for entry in (*cold.journaled, c.wdir_entry):
        c.journal.drop(entry)


def _dump(c: _Capturing, options: CriuOptions, tl: Timeline) -> tuple[dict, list[CapturedFile], dict[str, str]]:
    """The CRIU dump (a span of its own), its stats, and the state outside the images (host /dev/shm files) with
    their dump-time bytes snapshotted before anything resumes: (stats, extra files, {path: snapshot})."""
    plan = c.started.state.plan
    with tl.span("criu-dump"):
        c.criu.dump(c.started.state.pid, c.images, options, netns_inode(plan.netns))
    extra = hostfiles.extra_files(c.images)
    extra_src = {f.path: hostfiles.snapshot_file(f.path, f, private_dir(c.images.parent / "extra") / str(i))
                 for i, f in enumerate(extra)}
    return criu_stats(c.images, "dump"), extra, extra_src


def _dump_template(c: _Capturing, adapter: EngineAdapter, info: dict, model: Model | None, tag: str | None,
                   tl: Timeline, progress: Progress) -> tuple[CaptureFacts, CapsuleProfile]:
    """criu-template: dump the template as it is, left running; then resume it once into a serving engine (the
    device work a restore will do) for the completion its restores are held to. The way out stops it."""
    cold = c.started
    pid, plan, probe = cold.state.pid, cold.state.plan, cold.probe
    options = CriuOptions(leave_running=True, host_mounts=True)
    progress("dumping the template with CRIU")
    dump_stats, c.extra, extra_src = _dump(c, options, tl)
    with tl.span("validate"):
        adapter.after_restore(plan.workload_address, plan.port, True, "recovery")
        probe.wait_ready(alive=lambda: alive(pid))
        first = probe.complete()
        probe.complete(expected=first.text)  # determinism: a restore will be held to this text
    progress(f"the template, resumed once, served: {first.text!r}")
    files = _captured_files(c.images, c.wdir) + c.extra
    profile = capsule_profile(
        "criu-template", c.request, host_profile(c.criu.version()), first.text, criu_options=options.cli_flags(),
        engine_version=info.get("version") or c.launch.engine_version, model=model, weights_mode="recovery",
        kv_discarded=True, launch=c.launch_record(), network=plan, workload_name=c.name, files=files)
    facts = thin_and_pack(
        c.images, files, profile, tag, None, tl, progress, sources=extra_src, journal=c.journal,
        workload=c.name, snapshot_driver="criu-template", template_ready_s=round(cold.ready - cold.started, 3),
        validated_text=first.text, weights_mode="recovery", criu_options=options.cli_flags(), criu_stats=dump_stats)
    return facts, profile


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
