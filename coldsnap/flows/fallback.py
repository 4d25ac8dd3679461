"""Cold fallback: when a restore may give way to a normal cold start (never worse than vanilla). One rule for
process and container restores."""

from __future__ import annotations

from coldsnap.contracts import ColdSnapError, ErrorCode, Policy

# A sound capsule whose restore went wrong here: a cold start of its launch is what vanilla would have done.
RESTORE_FAILURES = frozenset({ErrorCode.INCOMPATIBLE, ErrorCode.CRIU_FAILED, ErrorCode.GPU_FAILED,
                              ErrorCode.VALIDATION_FAILED, ErrorCode.VALIDATION_TIMEOUT, ErrorCode.WORKLOAD_FAILED})


def may_fall_back(cause: ColdSnapError, policy: Policy, own_launch: bool) -> bool:
    """A malformed request never falls back (the caller's to fix, not to paper over), nor one whose policy says
    fallback_to_cold false. A container has a launch of its own (own_launch), so whatever else went wrong falls
    back; a process restore starts the capsule's own launch, so only a refusal or a failed restore does (not a
    capsule that is missing or corrupt)."""
    if cause.code == ErrorCode.INVALID_REQUEST or not policy.fallback_to_cold:
        return False
    return own_launch or cause.code in RESTORE_FAILURES
