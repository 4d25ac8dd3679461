"""`start` of a container the shim restored: it is already running (CRIU brought it back as it was) and was
validated at create, so runc is not asked; the shim runs the spec's poststart hooks as runc would (coldsnap-hook
reports there) and answers. A failed poststart hook stops the container and fails the start, as it does under runc."""

from __future__ import annotations

import json

from coldsnap.base.journal import same_process
from coldsnap.base.procfs import alive
from coldsnap.oci import records, runclog
from coldsnap.oci.argv import RuncArgv
from coldsnap.oci.hooks import run_stage
from coldsnap.oci.records import Outcome, ShimRecord
from coldsnap.oci.runtime import Runc
from coldsnap.oci.spec import annotations_of, load_spec


def oci_state(record: ShimRecord, spec: dict) -> str:
    return json.dumps({"ociVersion": spec.get("ociVersion", "1.0.2"), "id": record.id, "status": "running",
                       "pid": record.pid, "bundle": record.bundle, "annotations": annotations_of(spec)})


def start_restored(runc: str, parsed: RuncArgv, record: ShimRecord) -> int:
    cid = parsed.id
    if record.outcome == Outcome.RESTORING:  # its create died before the restore was done
        if record.owner and same_process(record.owner.pid, record.owner.start):
            return runclog.fail(parsed, f"coldsnap-runtime: container {cid} is still being restored")
        Runc.for_call(runc, parsed).delete_force(cid)
        records.forget(cid)
        return runclog.fail(parsed, f"coldsnap-runtime: the restore of container {cid} was interrupted before it "
                            "was validated; the container was deleted (create it again)")
    if record.started:
        return runclog.fail(parsed, "cannot start an already running container")
    if record.pid is None or not alive(record.pid):
        return runclog.fail(parsed, f"coldsnap-runtime: the restored process {record.pid} of container {cid} "
                            "has exited")
    try:
        spec = load_spec(record.bundle)
    except (OSError, ValueError) as e:
        return runclog.fail(parsed, f"coldsnap-runtime: cannot read {record.bundle}/config.json: {e}")
    error = run_stage(spec, "poststart", oci_state(record, spec))
    if error:
        Runc.for_call(runc, parsed).kill(cid)
        return runclog.fail(parsed, f"coldsnap-runtime: {error}")
    record = records.load(cid) or record  # the hook may have added to it
    record.started = True
    records.save(cid, record)
    return 0
