"""sleep / wake: release a running workload's GPU memory in place and bring it back, validated. Receipts for both.

Two ways to sleep, the same as the two weight modes of a capture:
- engine (recovery): the engine releases its weights and KV cache itself (what vLLM's sleep level 2 does), then the
  little GPU state left is CUDA-checkpointed into host memory; wake restores that and the engine reloads its weights
  from the pinned safetensors at full speed (parallel reads, pinned buffers). Wake moves the weights once, from page
  cache, instead of every GPU byte through the driver's restore.
- cuda (native): the whole GPU state moves into the process's host memory and back (the driver's own rate).
"""

from __future__ import annotations

import time
import uuid

from coldsnap.base.procfs import alive
from coldsnap.contracts import ColdSnapError, EngineRelease, ErrorCode, Receipt, Validation, WorkloadRequest
from coldsnap.contracts.results import SleepFacts, WakeFacts
from coldsnap.engines import get_adapter
from coldsnap.flows.receipts import finish_receipt, receipt_on_failure
from coldsnap.flows.spans import Timeline
from coldsnap.gpu import steps as gpu_steps
from coldsnap.workload.probe import ValidationProbe
from coldsnap.workload.state import load_state, save_state


def _checked(name: str | None, sleeping: bool):
    if name is None:  # WorkloadRequest's own check makes this unreachable for a validated request
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "sleep and wake need a workload")
    ws = load_state(name)
    if not alive(ws.pid):
        raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, f"workload {name!r} (pid {ws.pid}) is not running")
    if (ws.state == "sleeping") != sleeping:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST,
                            f"workload {ws.name!r} is {'not' if sleeping else 'already'} sleeping")
    return ws


def _address(ws) -> tuple[str, int]:
    host, port = ws.url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def _sleep_mode(ws, requested: str) -> str:
    able = bool(ws.engine) and get_adapter(ws.engine).supports_recovery and ws.weights_mode == "recovery"
    if requested == "engine" and not able:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"workload {ws.name!r} cannot sleep through its engine "
                            f"(engine {ws.engine or 'unknown'}, weights {ws.weights_mode or 'unknown'}): its weights "
                            "must be pinned files it can reload (weights mode recovery); use sleep mode cuda")
    if requested == "auto":
        return "engine" if able else "cuda"
    return requested


def sleep(request: WorkloadRequest, progress=lambda m: None) -> Receipt:
    tl = Timeline()
    op_id = request.id or f"sleep-{uuid.uuid4().hex[:12]}"
    with receipt_on_failure(request, op_id, "sleep", tl):
        ws = _checked(request.workload, sleeping=False)
        mode = _sleep_mode(ws, request.sleep_mode)
        host, port = _address(ws)
        released = EngineRelease()
        if mode == "engine":
            with tl.span("engine-release"):
                released = get_adapter(ws.engine).before_capture(host, port, True, "recovery")
        try:
            with tl.span("gpu-checkpoint"):
                ckpt = gpu_steps.checkpoint_tree(ws.pid)
            if not ckpt.pids:
                raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"workload {ws.name!r} has no CUDA processes: sleep "
                                    "releases GPU memory, there is none to release")
        except ColdSnapError:
            if mode == "engine":  # leave it serving as it was
                get_adapter(ws.engine).after_restore(host, port, True, "recovery")
            raise
        ws.state, ws.cuda_pids, ws.sleep_mode = "sleeping", ckpt.pids, mode
        save_state(ws)
        progress(f"{ckpt.summary} ({mode} sleep)")
        return finish_receipt(request, op_id, "sleep", tl, "succeeded",
                              result=SleepFacts(workload=ws.name, mode=mode, cuda_processes=len(ckpt.pids),
                                                seconds=ckpt.seconds, engine_release=released.facts()))


def wake(request: WorkloadRequest, progress=lambda m: None, validation: Validation | None = None) -> Receipt:
    tl = Timeline()
    op_id = request.id or f"wake-{uuid.uuid4().hex[:12]}"
    with receipt_on_failure(request, op_id, "wake", tl):
        ws = _checked(request.workload, sleeping=True)
        t0 = time.monotonic()
        host, port = _address(ws)
        with tl.span("gpu-restore"):
            gpu_steps.resume_in_place(gpu_steps.GpuCheckpoint(pids=ws.cuda_pids))
        resumed = {}
        if ws.sleep_mode == "engine":
            with tl.span("engine-resume"):
                resumed = get_adapter(ws.engine).after_restore(host, port, True, "recovery")
        ws.state = "active"
        save_state(ws)
        with tl.span("validate"):
            res = ValidationProbe(host, int(port), validation or Validation()).complete()
        progress(f"awake and validated: first token {res.first_token_s - t0:.3f} s after wake began")
        return finish_receipt(request, op_id, "wake", tl, "succeeded",
                              result=WakeFacts(workload=ws.name, time_to_first_token_s=round(res.first_token_s - t0, 4),
                                               validated_text=res.text, mode=ws.sleep_mode or "cuda",
                                               engine_resume=resumed))
