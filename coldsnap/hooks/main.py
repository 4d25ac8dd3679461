"""`coldsnap-hook createRuntime|poststart|poststop`: OCI hooks, the container state JSON on stdin
({ociVersion, id, status, pid, bundle, annotations}); each stage's module says what it does. Containers the shim
did not handle pass through every stage untouched (exit 0)."""

from __future__ import annotations

import sys

from coldsnap.base.paths import settings

STAGES = ("createRuntime", "createContainer", "startContainer", "prestart", "poststart", "poststop")
MAX_STATE_BYTES = 1 << 20


def read_state(raw: bytes) -> dict:
    """The OCI state document on stdin, strictly (a runtime writes it; anything else is refused in one line)."""
    from coldsnap.contracts import ColdSnapError, ErrorCode
    from coldsnap.contracts.parse import strict_json

    state = strict_json(raw, "the container state on stdin", max_bytes=MAX_STATE_BYTES)
    if not isinstance(state, dict) or not isinstance(state.get("id"), str) or not state["id"]:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "the container state on stdin has no id")
    if state.get("pid") is not None and (type(state["pid"]) is not int or state["pid"] < 0):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "the container state on stdin: pid must be an integer")
    if state.get("bundle") is not None and not isinstance(state["bundle"], str):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "the container state on stdin: bundle must be a string")
    return state


def run_stage(stage: str, state: dict) -> int:
    from coldsnap.oci.argv import valid_container_id

    if not valid_container_id(state["id"]):
        return 0  # an id runc refuses is no container of ours: nothing to do, nothing touched
    if stage == "poststart":
        from coldsnap.hooks.poststart import poststart

        return poststart(state)
    if stage == "createRuntime":
        from coldsnap.hooks.createruntime import create_runtime

        return create_runtime(state)
    if stage == "poststop":
        from coldsnap.hooks.poststop import poststop

        return poststop(state)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] not in STAGES:
        print(f"usage: coldsnap-hook {{{'|'.join(STAGES)}}} < container-state.json", file=sys.stderr)
        return 2
    from coldsnap.oci.runtime import apply_config_env

    apply_config_env()  # hooks from oci-hooks.d run with an empty environment, like the runtime
    try:
        return run_stage(args[0], read_state(sys.stdin.buffer.read(MAX_STATE_BYTES + 1)))
    except Exception as e:  # noqa: BLE001 - whatever raised: one line and a stable code, never a traceback
        from coldsnap.contracts import EXIT_CODES, ColdSnapError, ErrorCode
        from coldsnap.contracts.parse import short

        if settings().debug:
            raise
        err = e if isinstance(e, ColdSnapError) else ColdSnapError(ErrorCode.INTERNAL,
                                                                    f"{type(e).__name__}: {short(str(e), 200)}")
        print(f"coldsnap-hook: {args[0]}: {err}", file=sys.stderr, flush=True)
        return EXIT_CODES[err.code]


if __name__ == "__main__":
    sys.exit(main())
