"""`coldsnap-runtime`: runc, except that a container whose config.json carries the io.coldsnap.capsule annotation
is restored from that capsule at `create` instead of being started cold.

The decision sits here, in one place. The pass-through path (everything that is not create/run of an annotated
bundle, or start/delete of a container this shim restored) is os.execv of the real runc with the caller's argv,
unchanged, after importing only the argv parser; the spec and state readers load only for the subcommands that
need them, and the rest of ColdSnap (pydantic, CRIU, ...) only for an annotated create."""

from __future__ import annotations

import sys

from coldsnap.oci.argv import RuncArgv, parse_runc_argv
from coldsnap.oci.runtime import RuncNotFound, apply_config_env, exec_runc, find_runc

ANNOTATION_CAPSULE = "io.coldsnap.capsule"  # == coldsnap.contracts.capsule.ANNOTATION_CAPSULE (not imported: pydantic)


def annotated_spec(parsed: RuncArgv) -> dict | None:
    """The bundle's spec when it asks for a capsule; None (pass through) when it does not or cannot be read."""
    from coldsnap.oci.spec import coldsnap_annotations, load_spec

    try:
        spec = load_spec(parsed.bundle)
    except (OSError, ValueError):
        return None  # runc reports an unreadable bundle better than we would
    return spec if coldsnap_annotations(spec).get(ANNOTATION_CAPSULE, "").strip() else None


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
        runc = find_runc()
    except RuncNotFound as e:
        from coldsnap.oci.runclog import fail

        return fail(parsed, f"coldsnap-runtime: {e}")

    command, cid = parsed.command, parsed.container_id
    if command in ("create", "run") and cid:
        spec = annotated_spec(parsed)
        if spec is not None:
            _full_python()
            from coldsnap.shim.create import create_from_capsule

            return create_from_capsule(runc, parsed, spec)
    elif command in ("start", "delete") and cid:
        from coldsnap.oci import records

        apply_config_env()  # where the records are
        record = records.load(cid)
        if records.belongs(record, parsed.root):
            _full_python()
            if command == "delete":
                from coldsnap.shim.delete import delete

                return delete(runc, parsed)
            if record.get("outcome") == "restored":
                from coldsnap.shim.start import start_restored

                return start_restored(runc, parsed, record)
    exec_runc(runc, args)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
