"""`create` (or `run -d`) of a bundle annotated with io.coldsnap.capsule: the container restore flow decides
(coldsnap.flows.container_restore); the shim answers as runc would, or hands over to runc for a cold start."""

from __future__ import annotations

from coldsnap.flows.container_restore import restore_at_create
from coldsnap.oci import runclog
from coldsnap.oci.argv import RuncArgv
from coldsnap.oci.runtime import exec_runc
from coldsnap.shim.start import start_restored


def create(runc: str, parsed: RuncArgv, spec: dict) -> int:
    outcome = restore_at_create(runc, parsed, spec)
    if outcome.action == "fail":
        return runclog.fail(parsed, outcome.message)
    if outcome.action == "cold":  # runc created it cold (or said why not, in its own words)
        return outcome.exit_code
    if outcome.action == "exec":
        runclog.log(parsed, "warning", outcome.message)
        exec_runc(runc, parsed.argv)
        return 127  # not reached
    if parsed.command == "run" and outcome.record is not None:  # run --detach = create + start
        return start_restored(runc, parsed, outcome.record)
    return 0
