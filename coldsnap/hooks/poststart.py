"""poststart: a restored container is ready only once it has served a real completion equal to the one
validated at capture. Writes the container's receipt (succeeded / failed) with the shim's timing spans plus
validation, and the time to first token measured from the moment the restore began."""

from __future__ import annotations

import sys
import time

from coldsnap.contracts import ColdSnapError, RestoreRequest, Validation
from coldsnap.oci import records as shim_state
from coldsnap.shim.record import timeline_from_dict, write_receipt
from coldsnap.workload.target import Target, validate


def _say(msg: str) -> None:
    print(f"coldsnap-hook: {msg}", file=sys.stderr, flush=True)


def poststart(state: dict) -> int:
    cid = state["id"]
    record = shim_state.load(cid)
    if record is None:
        return 0  # not a container coldsnap-runtime handled
    if record.get("outcome") == "fell-back":
        _say(f"{cid} started cold: {record.get('reason')} (receipt {record.get('receipt')})")
        return 0
    if record.get("validated"):
        return 0
    pid = int(state.get("pid") or record["pid"])
    request = RestoreRequest.model_validate(record["request"])
    tl = timeline_from_dict(record["timeline"])
    target = Target(pid=pid, port=int(record["port"]), host=record.get("host"))
    try:
        start = time.monotonic()
        try:
            res = validate(target, Validation.model_validate(record["validation"]), record["expected_text"])
        finally:
            tl.add("validate", start, time.monotonic())
    except ColdSnapError as e:
        receipt = write_receipt(request, cid, tl, "failed", result={"container": cid, "capsule": record["capsule"]},
                                error=e)
        _say(f"{cid} restored from {record['capsule'][:19]}… but failed validation against {target.describe()}: "
             f"{e} (receipt {receipt['_path']})")
        return 1
    ttft = res.first_token_s - record["t0"]
    receipt = write_receipt(request, cid, tl, "succeeded", result={
        "container": cid, "capsule": record["capsule"], "pid": pid, "address": target.describe(),
        "time_to_first_token_s": round(ttft, 4), "validated_text": res.text,
        "cuda_processes": record.get("cuda_processes", 0), "criu_options": record.get("criu_options", []),
        "runc_restore": record.get("runc_restore", []), "weights_mode": record.get("weights_mode")})
    record.update(validated=True, receipt=receipt["_path"])
    shim_state.save(cid, record)
    _say(f"{cid} restored from {record['capsule'][:19]}… and validated: first token {ttft:.3f} s after the "
         f"restore began (receipt {receipt['_path']})")
    return 0
