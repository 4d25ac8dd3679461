"""poststart: says how the container's create went. coldsnap-runtime validated a restored container at its create
(a real completion equal to the one validated at capture; a restore that failed it fell back to a cold create then)
and wrote its receipt there. One line to stderr; a restored container without that validation exits 1, and the
runtime then fails the start."""

from __future__ import annotations

import sys

from coldsnap.flows.container_restore import validated_at_create


def poststart(state: dict) -> int:
    outcome = validated_at_create(state)
    if outcome is None:
        return 0  # not a container coldsnap-runtime restored
    print(f"coldsnap-hook: {outcome.message}", file=sys.stderr, flush=True)
    return 0 if outcome.ok else 1
