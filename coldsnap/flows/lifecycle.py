"""sleep / wake: release a running workload's GPU memory in place (CUDA checkpoint: device memory moves into the
process's host memory, the process stays) and bring it back, validated. Receipts for both."""

from __future__ import annotations

import time
import uuid

from .. import gpu_support
from ..contracts import ColdSnapError, ErrorCode, Validation, WorkloadRequest
from ..probe import ValidationProbe
from ..spans import Timeline
from ..workload import alive, load_state, save_state
from .receipts import finish_receipt


def _checked(name: str):
    ws = load_state(name)
    if not alive(ws.pid):
        raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, f"workload {name!r} (pid {ws.pid}) is not running")
    return ws


def sleep(request: WorkloadRequest, progress=lambda m: None) -> dict:
    tl = Timeline()
    op_id = request.id or f"sleep-{uuid.uuid4().hex[:12]}"
    try:
        ws = _checked(request.workload)
        if ws.state == "sleeping":
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"workload {ws.name!r} is already sleeping")
        with tl.span("gpu-checkpoint"):
            ckpt = gpu_support.checkpoint_tree(ws.pid)
        if not ckpt.pids:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"workload {ws.name!r} has no CUDA processes: sleep "
                                "releases GPU memory, there is none to release")
        ws.state, ws.cuda_pids = "sleeping", ckpt.pids
        save_state(ws)
        progress(ckpt.summary)
        return finish_receipt(request, op_id, "sleep", tl, "succeeded",
                              result={"workload": ws.name, "cuda_processes": len(ckpt.pids), "seconds": ckpt.seconds})
    except ColdSnapError as e:
        if getattr(e, "receipt", None) is None:
            finish_receipt(request, op_id, "sleep", tl, "failed", error=e)
        raise


def wake(request: WorkloadRequest, progress=lambda m: None, validation: Validation | None = None) -> dict:
    tl = Timeline()
    op_id = request.id or f"wake-{uuid.uuid4().hex[:12]}"
    try:
        ws = _checked(request.workload)
        if ws.state != "sleeping":
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"workload {ws.name!r} is not sleeping")
        t0 = time.monotonic()
        with tl.span("gpu-restore"):
            gpu_support.restore_tree(gpu_support.GpuCheckpoint(pids=ws.cuda_pids))
        ws.state = "active"
        save_state(ws)
        host, port = ws.url.split("//", 1)[1].rsplit(":", 1)
        with tl.span("validate"):
            res = ValidationProbe(host, int(port), validation or Validation()).complete()
        progress(f"awake and validated: first token {res.first_token_s - t0:.3f} s after wake began")
        return finish_receipt(request, op_id, "wake", tl, "succeeded",
                              result={"workload": ws.name, "time_to_first_token_s": round(res.first_token_s - t0, 4),
                                      "validated_text": res.text})
    except ColdSnapError as e:
        if getattr(e, "receipt", None) is None:
            finish_receipt(request, op_id, "wake", tl, "failed", error=e)
        raise
