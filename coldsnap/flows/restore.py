"""restore: admit → stage → restore → hydrate → validate → receipt.

A refused or failed restore falls back to a cold start when the policy allows it: never worse than vanilla.
`prepare` (restore --prepare-only) runs admit and stage only and touches no workload."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from coldsnap.base.files import private_dir
from coldsnap.base.paths import settings
from coldsnap.base.procfs import alive, descendants
from coldsnap.capsule import CapsuleStore, LoadedCapsule, unpack_layer
from coldsnap.capsule.payload import materialize
from coldsnap.capsule.pinned import verify_weights
from coldsnap.contracts import ColdSnapError, ErrorCode, RestoreRequest, Validation
from coldsnap.contracts import capsule as mt
from coldsnap.criu import CriuDriver, CriuOptions, criu_stats
from coldsnap.engines import get_adapter
from coldsnap.flows.admission import admit
from coldsnap.flows.coldstart import start_cold
from coldsnap.flows.receipts import finish_receipt
from coldsnap.flows.spans import Timeline
from coldsnap.gpu import codestash
from coldsnap.gpu import steps as gpu_steps
from coldsnap.host.profile import host_profile
from coldsnap.net import create_network, destroy_network, netns_path
from coldsnap.workload import hostfiles
from coldsnap.workload.probe import ValidationProbe
from coldsnap.workload.process import kill_tree, uses_gpu
from coldsnap.workload.state import WorkloadState, run_dir, save_state

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class Staged:
    capsule: LoadedCapsule
    images: Path
    files: Path | None


# --- admit -------------------------------------------------------------------------------------------------------
def load_capsule(ref: str, allow_unpinned: bool) -> LoadedCapsule:
    store = CapsuleStore(settings().store)
    return store.load(store.resolve(ref, allow_unpinned=allow_unpinned))


def admission_for(capsule: LoadedCapsule, strictness: str):
    criu = CriuDriver()
    return admit(capsule.profile.host, host_profile(criu.version()), strictness, capsule.profile.distributed)


# --- stage -------------------------------------------------------------------------------------------------------
def stage(capsule: LoadedCapsule) -> Staged:
    """Verify every blob digest, check pinned weights, unpack CRIU images (cached per capsule digest), put back
    the CUDA code files the capsule's processes map."""
    store = CapsuleStore(settings().store)
    store.verify(capsule)
    profile = capsule.profile
    payload = capsule.manifest.get("annotations", {}).get(mt.ANNOTATION_PAYLOAD)
    if reloads_weights(capsule):
        if payload:
            materialize(store, payload, profile.model.weights)
        verify_weights(profile.model.weights)
    root = private_dir(settings().run / "staged") / capsule.digest.split(":")[1]
    done = root / ".complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        tmp = private_dir(root.with_name(root.name + f".tmp{os.getpid()}"))
        try:
            unpack_layer(store.blob_path(capsule.layer(mt.LAYER_CRIU).digest), tmp / "images")
            files_layer = capsule.layer(mt.LAYER_FILES)
            if files_layer:
                unpack_layer(store.blob_path(files_layer.digest), tmp / "files")
            (tmp / ".complete").write_text(capsule.digest)
            try:
                os.replace(tmp, root)
            except OSError:
                if not done.exists():  # not a concurrent stager that finished first
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    files = root / "files"
    staged = Staged(capsule=capsule, images=root / "images", files=files if files.exists() else None)
    _put_back_files(staged, only_code=True)  # big, and the same for every restore: here, off the restore's clock
    return staged


def reloads_weights(capsule: LoadedCapsule) -> bool:
    """Whether the restored engine reloads its weights from files (recovery's pinned files, or native weights that
    travel as a payload), rather than finding them in its restored memory."""
    payload = capsule.manifest.get("annotations", {}).get(mt.ANNOTATION_PAYLOAD)
    return bool(capsule.profile.model) and (bool(payload) or capsule.profile.weights_mode == "recovery")


def _put_back_files(staged: Staged, only_code: bool = False) -> None:
    """Files the process held open must look as they did at the dump (CRIU checks their size): the run dir's log,
    host /dev/shm state, CUDA code files (only those with only_code). Sparse, atomic, with their recorded mode."""
    for i, f in enumerate(staged.capsule.profile.files):
        if not only_code or codestash.is_code_file(f.path):
            hostfiles.put_back_file(staged.files / str(i) if staged.files else None, f)


# --- the whole restore -------------------------------------------------------------------------------------------
def restore(request: RestoreRequest, progress: Progress = _quiet) -> dict:
    tl = Timeline()
    op = "prepare" if request.operation == "prepare" else "restore"
    op_id = request.id or f"{op}-{uuid.uuid4().hex[:12]}"
    try:
        with tl.span("admit"):
            capsule = load_capsule(request.capsule, request.policy.allow_unpinned)
            verdict = admission_for(capsule, request.policy.compatibility)
        for w in verdict.warnings:
            progress(f"note: {w} (relaxed compatibility)")
        if not verdict.admitted:
            refusal = ColdSnapError(ErrorCode.INCOMPATIBLE, f"capsule refused on this host: {verdict.sentence()}")
            return _fallback_or_raise(request, capsule, tl, op_id, refusal, "refused", progress)
        with tl.span("stage"):
            staged = stage(capsule)
        progress(f"staged {capsule.digest[:19]}… (all digests verified)")
        if op == "prepare":
            return finish_receipt(request, op_id, op, tl, "succeeded",
                                  result={"capsule": capsule.digest, "staged": str(staged.images.parent),
                                          "admission": "admitted"})
        try:
            result = _restore_staged(request, staged, tl, progress)
        except ColdSnapError as e:
            if e.code in (ErrorCode.CRIU_FAILED, ErrorCode.GPU_FAILED, ErrorCode.VALIDATION_FAILED,
                          ErrorCode.VALIDATION_TIMEOUT, ErrorCode.WORKLOAD_FAILED):
                return _fallback_or_raise(request, capsule, tl, op_id, e, "failed", progress)
            raise
        return finish_receipt(request, op_id, op, tl, "succeeded", result=result)
    except ColdSnapError as e:
        if getattr(e, "receipt", None) is None:
            finish_receipt(request, op_id, op, tl, "refused" if e.code == ErrorCode.INCOMPATIBLE else "failed",
                           error=e)
        raise


def _restore_staged(request: RestoreRequest, staged: Staged, tl: Timeline, progress: Progress) -> dict:
    profile = staged.capsule.profile
    plan = profile.network
    name = plan.netns.removeprefix("coldsnap-")
    validation = _validation(request, profile)
    criu = CriuDriver()
    adapter = get_adapter(profile.engine.name)
    pid = None
    ok = False
    t0 = time.monotonic()  # the restore clock: staging is excluded, as for a vanilla start
    # The weights go onto the GPU meanwhile, when they can (a process of its own; the engine takes them at resume).
    prefetch_started = gpu_steps.start_prefetch_soon(
        profile, adapter.supports_prefetch and reloads_weights(staged.capsule), request.gpu_map,
        private_dir(settings().run / "prefetch"))
    prefetched = None
    try:
        with tl.span("network"):
            create_network(plan)
            _put_back_files(staged)
        progress("restoring with CRIU")
        work = private_dir(settings().run / "restore-work" / uuid.uuid4().hex)
        with tl.span("criu-restore"):
            options = CriuOptions()
            pid = criu.restore(staged.images, work, options, netns_path(plan.netns))
        criu_account = criu_stats(work, "restore")
        with tl.span("hydrate"):
            gpu = gpu_steps.restore_restored_tree(pid, gpu_pairs=list(request.gpu_map.items()) or None)
            prefetch = prefetch_started()
            engine = adapter.after_restore(plan.workload_address, plan.port, profile.kv_discarded,
                                           profile.weights_mode, prefetched=prefetch.for_engine())
        probe = ValidationProbe(plan.workload_address, plan.port, validation)
        with tl.span("validate"):
            probe.wait_ready(alive=lambda: alive(pid), timeout=validation.ready_timeout_s)
            res = probe.complete(expected=profile.expected_text)
        ttft = res.first_token_s - t0
        prefetched = gpu_steps.finish_prefetch(prefetch_started())
        ranks = _ranks_restored(profile, plan, pid)
        progress(f"restored and validated: first token {ttft:.3f} s after restore began"
                 + (f"; {ranks['restored']}/{ranks['expected']} ranks" if ranks else ""))
        wdir = run_dir(name)
        save_state(WorkloadState(name=name, pid=pid, network=plan.model_dump(), origin="restored",
                                 capsule=staged.capsule.digest, run_dir=str(wdir),
                                 log=profile.files[0].path if profile.files else "",
                                 url=f"http://{plan.workload_address}:{plan.port}", cuda_pids=gpu.pids,
                                 engine=profile.engine.name, weights_mode=profile.weights_mode))
        ok = True
        shutil.rmtree(work, ignore_errors=True)
        return {"capsule": staged.capsule.digest, "workload": name, "pid": pid,
                "url": f"http://{plan.workload_address}:{plan.port}",
                "time_to_first_token_s": round(ttft, 4), "validated_text": res.text,
                "cuda_processes": len(gpu.pids), "criu_options": options.cli_flags(),
                "hydrate": {"cuda_restore_s": gpu.seconds, **({"cuda_restore_per_pid_s": gpu.per_pid}
                                                              if len(gpu.pids) > 1 else {}),
                            "engine_resume": engine, "prefetch": prefetched},
                "criu_stats": criu_account,
                "weights_mode": profile.weights_mode, **({"ranks": ranks} if ranks else {})}
    finally:
        if prefetched is None:  # failed before the first token: reap the prefetchers whatever they did
            gpu_steps.finish_prefetch(prefetch_started())
        if not ok:
            if pid is not None:
                kill_tree(pid)
            destroy_network(plan)


def _ranks_restored(profile, plan, root_pid: int) -> dict | None:
    """A distributed workload: every rank must be back, in the restored tree. (The validated completion already
    needed every rank's collectives; this names a missing one instead of a hang.)"""
    if profile.distributed is None:
        return None
    from coldsnap.flows.capture import engine_info
    from coldsnap.workload.process import inner_pid

    # The ranks report their PIDs as they see them (inside the workload's PID namespace on CPU).
    tree = {inner_pid(p) for p in (root_pid, *descendants(root_pid)) if alive(p)}
    reported = (engine_info(plan.workload_address, plan.port).get("tensor_parallel") or {}).get("ranks") or []
    restored = sum(1 for r in reported if r.get("pid") in tree)
    expected = profile.distributed.world_size
    if restored != expected:
        raise ColdSnapError(ErrorCode.VALIDATION_FAILED, f"{restored}/{expected} ranks restored")
    return {"restored": restored, "expected": expected}


def _validation(request: RestoreRequest, profile) -> Validation:
    return request.validation or profile.validation


# --- cold fallback -----------------------------------------------------------------------------------------------
def _fallback_or_raise(request: RestoreRequest, capsule: LoadedCapsule, tl: Timeline, op_id: str,
                       cause: ColdSnapError, why: str, progress: Progress) -> dict:
    op = "prepare" if request.operation == "prepare" else "restore"
    if op == "prepare" or not request.policy.fallback_to_cold:
        finish_receipt(request, op_id, op, tl, "refused" if why == "refused" else "failed", error=cause)
        raise cause
    progress(f"{cause.message}; falling back to a cold start")
    with tl.span("cold-start"):
        result = cold_start(capsule.profile, request, progress)
    result.update({"fallback_reason": f"{cause.code.value}: {cause.message}", "capsule": capsule.digest})
    return finish_receipt(request, op_id, op, tl, "fell-back", result=result)


def cold_start(profile, request: RestoreRequest, progress: Progress) -> dict:
    """Start the captured workload's launch cold, in the same network plan, and validate it."""
    plan = profile.network
    name = plan.netns.removeprefix("coldsnap-")
    cold = start_cold(name, plan, profile.launch.command, profile.launch.env, profile.launch.workdir,
                      _validation(request, profile), expected=profile.expected_text,
                      gpu=uses_gpu(profile.launch.devices))
    cold.state.engine, cold.state.weights_mode = profile.engine.name, profile.weights_mode
    save_state(cold.state)
    progress(f"cold start validated: first token {cold.time_to_first_token:.2f} s after start")
    return {"workload": name, "pid": cold.state.pid, "url": cold.state.url,
            "time_to_first_token_s": round(cold.time_to_first_token, 4), "validated_text": cold.first.text,
            "started": "cold"}
