"""poststart: says how the container's create went. coldsnap-runtime validated a restored container at its create
(a real completion equal to the one validated at capture; a restore that failed it fell back to a cold create then)
and wrote its receipt there. One line to stderr; a restored container without that validation exits 1, and the
runtime then fails the start. Standard library only: the shim's `start` runs it."""

from __future__ import annotations

import sys

from coldsnap.oci import records
from coldsnap.oci.records import Outcome


def poststart(state: dict) -> int:
    cid = state["id"]
    record = records.load(cid)
    if record is None:
        return 0  # not a container coldsnap-runtime handled
    if record.outcome == Outcome.FELL_BACK:
        ok, message = True, f"{cid} started cold: {record.reason} (receipt {record.receipt})"
    elif record.outcome == Outcome.RESTORED and record.validated:
        ok, message = True, record.summary or f"{cid} restored and validated (receipt {record.receipt})"
    else:
        ok, message = False, f"{cid} was not validated at its create: it cannot start as a restore"
    print(f"coldsnap-hook: {message}", file=sys.stderr, flush=True)
    return 0 if ok else 1
