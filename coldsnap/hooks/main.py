"""`coldsnap-hook createRuntime|poststart|poststop`: OCI hooks, the container state JSON on stdin
({ociVersion, id, status, pid, bundle, annotations}).

  poststart   a container the shim restored is validated with a real completion before it is reported
              ready; the receipt goes to <receipts>/<container-id>.json and one line to stderr. A failed
              validation exits 1 with the reason (the runtime then fails the start).
  poststop    forget the shim's record of the container.
  createRuntime  in a network namespace runc makes itself, bring `lo` up before CRIU restores loopback
              connections (runc runs it at CRIU's setup-namespaces during a restore).
Containers the shim did not handle pass through every stage untouched (exit 0)."""

from __future__ import annotations

import json
import sys

STAGES = ("createRuntime", "createContainer", "startContainer", "prestart", "poststart", "poststop")


def read_state(text: str) -> dict:
    state = json.loads(text)
    if not isinstance(state, dict) or not state.get("id"):
        raise ValueError("the container state on stdin has no id")
    return state


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] not in STAGES:
        print(f"usage: coldsnap-hook {{{'|'.join(STAGES)}}} < container-state.json", file=sys.stderr)
        return 2
    from coldsnap.oci.runtime import apply_config_env

    apply_config_env()  # hooks from oci-hooks.d run with an empty environment, like the runtime
    try:
        state = read_state(sys.stdin.read())
    except ValueError as e:
        print(f"coldsnap-hook: {args[0]}: cannot read the container state on stdin: {e}", file=sys.stderr)
        return 2
    if args[0] == "poststart":
        from coldsnap.hooks.poststart import poststart

        return poststart(state)
    if args[0] == "createRuntime":
        from coldsnap.hooks.createruntime import create_runtime

        return create_runtime(state)
    if args[0] == "poststop":
        from coldsnap.hooks.poststop import poststop

        return poststop(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
