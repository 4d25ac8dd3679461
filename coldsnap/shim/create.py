"""`create` (or `run -d`) of a bundle annotated with io.coldsnap.capsule: admit → stage → restore → hydrate, then
record that the container is restored (its `start` is answered by the shim; the poststart hook validates and
writes the receipt). A refusal or a failed restore falls back to plain `runc create` with the caller's argv when
the policy allows, and never leaves a half-restored container behind."""

from __future__ import annotations

import os
import shutil
import subprocess

from coldsnap.capsule import LoadedCapsule
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.flows.restore import admission_for, load_capsule, stage
from coldsnap.flows.spans import Timeline
from coldsnap.oci import records, runclog
from coldsnap.oci.argv import RuncArgv
from coldsnap.oci.hooks import add_coldsnap_hooks
from coldsnap.oci.runtime import exec_runc
from coldsnap.oci.spec import coldsnap_annotations, netns_path, write_spec
from coldsnap.shim.delete import forget
from coldsnap.shim.record import ContainerRequest, request_from_annotations, timeline_to_dict, write_receipt
from coldsnap.shim.restore import restore_container, work_dir_path

NO_FALLBACK = (ErrorCode.INVALID_REQUEST,)  # a malformed annotation is the caller's to fix, not to paper over


def _admit(creq: ContainerRequest, tl: Timeline) -> LoadedCapsule:
    policy = creq.request.policy
    with tl.span("admit"):
        capsule = load_capsule(creq.request.capsule, policy.allow_unpinned)
        profile = capsule.profile
        if profile.snapshot_driver != "criu-runc":
            raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"capsule {capsule.digest} was captured with the "
                                f"{profile.snapshot_driver} driver; a container restores only criu-runc capsules")
        if creq.image_digest and profile.image_digest and creq.image_digest != profile.image_digest:
            raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"container image {creq.image_digest} differs from the "
                                f"captured image {profile.image_digest}")
        verdict = admission_for(capsule, policy.compatibility)
    if not verdict.admitted:
        raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"capsule refused on this host: {verdict.sentence()}")
    return capsule


def _stage(capsule: LoadedCapsule):
    """stage(), once more if a concurrent restore of the same capsule won the race to publish the staged dir."""
    try:
        return stage(capsule)
    except OSError:
        return stage(capsule)


def create_from_capsule(runc: str, parsed: RuncArgv, spec: dict) -> int:
    from coldsnap.shim.start import start_restored

    cid = parsed.container_id
    if os.path.exists(os.path.join(parsed.root, cid)):  # runc's own refusal; and never touch that container
        return runclog.fail(parsed, f"container with id exists: {cid}")
    try:
        creq = request_from_annotations(coldsnap_annotations(spec))
        if add_coldsnap_hooks(spec):
            write_spec(parsed.bundle, spec)
    except ColdSnapError as e:
        return runclog.fail(parsed, f"coldsnap-runtime: {e}")
    except OSError as e:
        return runclog.fail(parsed, f"coldsnap-runtime: cannot update {parsed.bundle}/config.json: {e}")

    tl = Timeline()
    capsule = None
    attempted = False
    try:
        if parsed.command == "run" and not parsed.detach:
            raise ColdSnapError(ErrorCode.RUNTIME, "a foreground `runc run` cannot be restored (use create + start "
                                "or run --detach)")
        capsule = _admit(creq, tl)
        with tl.span("stage"):
            staged = _stage(capsule)
        attempted = True
        restored = restore_container(runc, parsed, staged, spec, creq.host, creq.port, tl)
    except Exception as e:  # noqa: BLE001 - whatever went wrong, the container must still come up (or say why)
        cause = e if isinstance(e, ColdSnapError) else ColdSnapError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        return fall_back(runc, parsed, creq, tl, capsule, cause, attempted, netns_path(spec))

    profile = capsule.profile
    record = {
        "outcome": "restored", "id": cid, "root": parsed.root, "bundle": parsed.bundle, "capsule": capsule.digest,
        "request": creq.request.model_dump(mode="json"),
        "validation": creq.validation(profile.validation).model_dump(mode="json"),
        "expected_text": profile.expected_text, "weights_mode": profile.weights_mode,
        "criu_options": profile.criu_options, "timeline": timeline_to_dict(tl), "started": False, **restored,
    }
    records.save(cid, record)
    if parsed.command == "run":  # run --detach = create + start
        return start_restored(runc, parsed, record)
    return 0


def _remove_container(runc: str, parsed: RuncArgv) -> None:
    subprocess.run([runc, *parsed.global_argv(drop=("log", "log-format")), "delete", "--force", parsed.container_id],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _unlock_network(netns: str | None) -> dict:
    """Before a cold start in a network namespace the container joins (a pod's): remove the network lock an
    in-flight capture left there for the restore that is not coming (coldsnap.net.lock). Never raises."""
    if not netns or not os.path.exists(netns):
        return {}
    try:
        from coldsnap.net.lock import remove_criu_locks

        removed = remove_criu_locks(netns)
        return {"network_lock_removed": removed} if removed else {}
    except Exception as e:  # noqa: BLE001 - the cold start goes ahead; the receipt says what is left
        return {"network_lock_note": f"could not check {netns} for a leftover network lock: {e}"}


def fall_back(runc: str, parsed: RuncArgv, creq: ContainerRequest, tl: Timeline, capsule: LoadedCapsule | None,
              cause: ColdSnapError, attempted: bool, netns: str | None = None) -> int:
    cid = parsed.container_id
    if attempted:  # never leave a half-restored container (only ours: a restore was tried under this id)
        _remove_container(runc, parsed)
    forget(cid)
    shutil.rmtree(work_dir_path(cid), ignore_errors=True)  # what is worth keeping sits beside the receipt
    reason = f"{cause.code.value}: {cause.message}"
    if cause.code in NO_FALLBACK or not creq.request.policy.fallback_to_cold:
        write_receipt(creq.request, cid, tl, "refused" if cause.code == ErrorCode.INCOMPATIBLE else "failed",
                      error=cause)
        return runclog.fail(parsed, f"coldsnap-runtime: {reason}")
    unlocked = _unlock_network(netns)
    try:  # bookkeeping must not stand between the container and its cold start
        receipt = write_receipt(creq.request, cid, tl, "fell-back", result={
            "container": cid, "capsule": capsule.digest if capsule else creq.request.capsule,
            "fallback_reason": reason, "started": "cold", **unlocked})
        records.save(cid, {"outcome": "fell-back", "id": cid, "root": parsed.root, "bundle": parsed.bundle,
                         "reason": reason, "receipt": receipt["_path"]})
    except Exception as e:  # noqa: BLE001
        reason += f" (and no receipt: {e})"
    runclog.log(parsed, "warning", f"coldsnap: {reason}; starting the container cold")
    exec_runc(runc, parsed.argv)
    return 127  # not reached
