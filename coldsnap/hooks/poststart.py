"""poststart: a restored container is ready only once it has served a real completion equal to the one validated
at capture (coldsnap.flows.container_restore.validate_restored writes its receipt). One line to stderr; a failed
validation exits 1, and the runtime then fails the start."""

from __future__ import annotations

import sys

from coldsnap.flows.container_restore import validate_restored


def poststart(state: dict) -> int:
    outcome = validate_restored(state)
    if outcome is None:
        return 0  # not a container coldsnap-runtime restored
    print(f"coldsnap-hook: {outcome.message}", file=sys.stderr, flush=True)
    return 0 if outcome.ok else 1
