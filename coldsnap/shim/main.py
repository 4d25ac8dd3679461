"""`coldsnap-runtime`: runc, except that a container whose config.json carries the io.coldsnap.capsule annotation
is restored from that capsule at `create` instead of being started cold.

The decision sits here, in one place (decide). The pass-through path (everything that is not create/run of an
annotated bundle, or start/delete of a container this shim handled) is os.execv of the real runc with the caller's
argv, unchanged, after importing only the argv parser and the runc locator (stdlib only); the spec and record
readers load only for the subcommands that need them, and the rest of ColdSnap (pydantic, CRIU, ...) only once the
decision is not to pass through."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable

from coldsnap.oci.argv import RuncArgv, parse_runc_argv, valid_container_id
from coldsnap.oci.runtime import RuncNotFound, apply_config_env, exec_runc, find_runc

if TYPE_CHECKING:
    from coldsnap.oci.records import ShimRecord

ANNOTATION_CAPSULE = "io.coldsnap.capsule"  # == coldsnap.contracts.capsule.ANNOTATION_CAPSULE (not imported: pydantic)

PASS_THROUGH = "pass-through"  # exec the real runc, argv unchanged
RESTORE = "restore"  # create/run of an annotated bundle: restore it from the capsule (or fall back cold)
ANSWER_START = "answer-start"  # start of a container the shim restored (it already runs: run poststart hooks), or
#                               whose restore was interrupted (delete it, fail the start)
DELETE = "delete"  # delete of a container the shim handled: runc deletes it, the shim forgets it


def annotated_spec(bundle: str) -> dict | None:
    """The bundle's spec when it asks for a capsule; None (pass through) when it does not or cannot be read."""
    from coldsnap.oci.spec import coldsnap_annotations, is_pod_sandbox, load_spec, runc_refuses

    try:
        spec = load_spec(bundle)
    except (OSError, ValueError, RecursionError):
        return None  # runc reports an unreadable bundle better than we would
    if runc_refuses(spec) or is_pod_sandbox(spec):
        return None  # and a malformed one; a pod's pause container is started as it is, always
    return spec if coldsnap_annotations(spec).get(ANNOTATION_CAPSULE, "").strip() else None


def shim_record(container_id: str) -> "ShimRecord | None":
    from coldsnap.oci import records

    return records.load(container_id)


def decide(parsed: RuncArgv, spec_of: Callable[[str], dict | None] = annotated_spec,
           record_of: Callable[[str], "ShimRecord | None"] = shim_record) -> tuple[str, "dict | ShimRecord | None"]:
    """(action, the annotated spec or the shim's record) for a runc command line. spec_of(bundle) returns the spec
    only when it is annotated; record_of(id) the shim's record of a container, if any."""
    command, cid = parsed.command, parsed.container_id
    if cid is None or not valid_container_id(cid):
        return PASS_THROUGH, None  # runc refuses it (or needs no id): nothing of ours is touched
    if command in ("create", "run"):
        spec = spec_of(parsed.bundle)
        if spec is not None:
            return RESTORE, spec
    elif command in ("start", "delete"):
        from coldsnap.oci.records import Outcome, belongs

        record = record_of(cid)
        if belongs(record, parsed.root):
            if command == "delete":
                return DELETE, record
            if record is not None and record.outcome in (Outcome.RESTORED, Outcome.RESTORING):
                return ANSWER_START, record
    return PASS_THROUGH, None


def _full_python() -> None:
    """Before anything beyond the pass-through: settings from runtime.json, and site-packages (pydantic, pycriu)
    when a fast launcher runs us with `python -S`."""
    apply_config_env()
    if sys.flags.no_site:
        import site

        site.main()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = parse_runc_argv(args)
    try:
        return _run(args, parsed)
    except Exception as e:  # noqa: BLE001 - whatever raised: one line in runc's log format, never a traceback
        from coldsnap.base.paths import settings  # an error's path only: the pass-through imports no more
        from coldsnap.oci.runclog import fail

        if settings().debug:
            raise
        code = getattr(getattr(e, "code", None), "value", "internal")
        message = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
        return fail(parsed, f"coldsnap-runtime: {code}: {message[:300]}")


def _run(args: list[str], parsed: RuncArgv) -> int:
    try:
        runc = find_runc()
    except RuncNotFound as e:
        from coldsnap.oci.runclog import fail

        return fail(parsed, f"coldsnap-runtime: {e}")
    if parsed.command in ("start", "delete"):
        apply_config_env()  # where the records are
    action, data = decide(parsed)
    if action == PASS_THROUGH:
        exec_runc(runc, args)
        return 127  # not reached
    _full_python()
    if action == RESTORE and isinstance(data, dict):
        from coldsnap.shim.create import create

        return create(runc, parsed, data)
    if action == DELETE:
        from coldsnap.shim.delete import delete

        return delete(runc, parsed)
    from coldsnap.oci.records import ShimRecord
    from coldsnap.shim.start import start_restored

    if not isinstance(data, ShimRecord):
        raise RuntimeError(f"no shim record for {action}")
    return start_restored(runc, parsed, data)


if __name__ == "__main__":
    sys.exit(main())
