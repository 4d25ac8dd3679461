"""Container restore: what coldsnap-runtime does at `create` of a bundle annotated with io.coldsnap.capsule
(coldsnap.hooks.poststart says afterwards how it went).

  create     admit → stage → `runc restore --detach` → hydrate → validate → receipt, then a record that `start`,
             the poststart hook and `delete` read. The container counts as restored only once it has served a real
             completion equal to the one validated at capture. A refusal, a failed restore or a failed validation
             falls back to a cold `runc create` with the caller's argv when the policy allows, and never leaves a
             half-restored container behind.

Annotations (keys in coldsnap.contracts.capsule):
  io.coldsnap.capsule       capsule reference, pinned (sha256:… or NAME@sha256:…)
  io.coldsnap.policy        JSON of contracts.Policy fields, e.g. {"fallback_to_cold": true, "compatibility": "strict"}
  io.coldsnap.validation    JSON: {"host": ..., "port": ...} (where the server answers; default: 127.0.0.1 inside
                            the container's network namespace, port as captured) plus any contracts.Validation
                            field to override the validation recorded at capture (e.g. "ready_timeout_s")
  io.coldsnap.image-digest  (optional) the container image's digest; must equal the capsule's when both are set
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from coldsnap.base.files import private_dir
from coldsnap.base.journal import Journal, start_time
from coldsnap.base.paths import settings
from coldsnap.capsule import LoadedCapsule
from coldsnap.contracts import ColdSnapError, ErrorCode, Policy, RestoreRequest, Validation
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.parse import first_error, short, strict_json
from coldsnap.contracts.results import Hydrate, RestoreFacts
from coldsnap.criu import criu_stats
from coldsnap.criu.creds import exceeds_spec, image_creds
from coldsnap.criu.runc import restore_container
from coldsnap.engines import get_adapter
from coldsnap.flows import streaming
from coldsnap.flows.admission import admit_capsule, load_capsule, look_at_this_host_soon
from coldsnap.flows.fallback import may_fall_back
from coldsnap.flows.fetch import Arriving, fetch, is_registry_reference
from coldsnap.flows.receipts import failed_state, finish_receipt, receipt_path
from coldsnap.flows.spans import Timeline
from coldsnap.flows.staging import StagedForRestore, reloads_weights, stage
from coldsnap.gpu import relay
from coldsnap.gpu import steps as gpu_steps
from coldsnap.oci import records, runclog
from coldsnap.oci.argv import RuncArgv
from coldsnap.oci.hooks import add_coldsnap_hooks
from coldsnap.oci.records import Outcome, Owner, ShimRecord
from coldsnap.oci.runtime import Runc
from coldsnap.oci.spec import coldsnap_annotations, netns_path, root_path, write_spec
from coldsnap.workload import hostfiles
from coldsnap.workload.layer import PutBack, put_back_layer
from coldsnap.workload.target import Target, validate


# --- what the annotations ask for --------------------------------------------------------------------------------
@dataclass
class ContainerRequest:
    request: RestoreRequest  # what the receipt's request_sha256 is taken over
    validation_overrides: dict = field(default_factory=dict)
    host: str | None = None
    port: int | None = None
    image_digest: str | None = None

    def validation(self, recorded: Validation) -> Validation:
        return Validation.model_validate({**recorded.model_dump(), **self.validation_overrides})


def _json_annotation(ann: dict[str, str], key: str) -> dict:
    raw = ann.get(key)
    if raw is None or not raw.strip():
        return {}
    value = strict_json(raw, f"annotation {key}", max_bytes=mt.MAX_ANNOTATION_BYTES)
    if not isinstance(value, dict):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotation {key}: must be a JSON object")
    return value


def request_from_annotations(ann: dict[str, str]) -> ContainerRequest:
    unknown = sorted(k for k in ann if k.startswith("io.coldsnap.") and k not in mt.CONTAINER_ANNOTATIONS)
    if unknown:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotation {short(unknown[0])}: unknown (ColdSnap reads "
                            f"{', '.join(mt.CONTAINER_ANNOTATIONS)})")
    ref = ann.get(mt.ANNOTATION_CAPSULE, "").strip()
    policy = _json_annotation(ann, mt.ANNOTATION_POLICY)
    val = _json_annotation(ann, mt.ANNOTATION_VALIDATION)
    host, port = val.pop("host", None), val.pop("port", None)
    if host is not None and not isinstance(host, str):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotation {mt.ANNOTATION_VALIDATION}: host must be a string")
    if port is not None and (type(port) is not int or not 0 < port < 65536):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotation {mt.ANNOTATION_VALIDATION}: port must be 1-65535")
    try:
        request = RestoreRequest(operation="restore", capsule=ref, policy=Policy.model_validate(policy),
                                 validation=Validation.model_validate(val) if val else None)
    except ValidationError as e:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotations: {first_error(e)}") from None
    digest = ann.get(mt.ANNOTATION_IMAGE_DIGEST) or None
    if digest is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotation {mt.ANNOTATION_IMAGE_DIGEST}: {short(digest)} is "
                            "not sha256:<64 lowercase hex digits>")
    return ContainerRequest(request=request, validation_overrides=val, host=host or None, port=port,
                            image_digest=digest)


# --- create ------------------------------------------------------------------------------------------------------
@dataclass
class CreateOutcome:
    """What the shim answers: restored (record saved); cold (the caller's `runc create` ran instead, exit_code is
    runc's; message says why, for runc's log); exec (a foreground `runc run`: the shim becomes runc with the
    caller's argv); fail (message: the runc-style error line)."""

    action: Literal["restored", "cold", "exec", "fail"]
    message: str = ""
    record: ShimRecord | None = None
    exit_code: int = 0


def restore_at_create(runc: str, parsed: RuncArgv, spec: dict) -> CreateOutcome:
    cid = parsed.id
    if os.path.exists(os.path.join(parsed.root, cid)):  # runc's own refusal; and never touch that container
        return CreateOutcome("fail", f"container with id exists: {cid}")
    try:
        creq = request_from_annotations(coldsnap_annotations(spec))
        if add_coldsnap_hooks(spec):
            write_spec(parsed.bundle, spec)
    except ColdSnapError as e:
        return CreateOutcome("fail", f"coldsnap-runtime: {e}")
    except OSError as e:
        return CreateOutcome("fail", f"coldsnap-runtime: cannot update {parsed.bundle}/config.json: {e}")

    tl = Timeline()
    capsule = arriving = staged = None
    pull_facts: dict = {}
    attempted = False
    try:
        if parsed.command == "run" and not parsed.detach:
            raise ColdSnapError(ErrorCode.RUNTIME, "a foreground `runc run` cannot be restored (use create + start "
                                "or run --detach)")
        ref = creq.request.capsule
        if is_registry_reference(ref):  # a node whose store lacks it pulls it here (the request stays as written)
            with tl.span("pull"):  # admission's look at this host meanwhile, while the pull waits on the network
                pulled, pull_facts, arriving = fetch(creq.request, lambda _: None, look_at_this_host_soon)
                ref = pulled.capsule
        with tl.span("admit"):
            capsule = load_capsule(ref, creq.request.policy.allow_unpinned)
            verdict = admit_capsule(capsule, creq.request.policy, "criu-runc", creq.image_digest, spec)
        if not verdict.admitted:
            raise verdict.refusal()
        with tl.span("stage"):  # the images unpacked while the weights arrive (linked, or waited for, next)
            staged = stage(capsule, arriving.wait if arriving else None, arriving.early if arriving else None)
            # what the images would give the processes, held to this container's spec before anything runs
            beyond = exceeds_spec(image_creds(staged.images), spec)
            if beyond:
                raise ColdSnapError(ErrorCode.UNTRUSTED, f"the capsule would restore more than this container "
                                    f"grants: {beyond}")
        attempted = True
        restored = _restore(runc, parsed, staged, spec, creq, tl, arriving)
    except Exception as e:  # noqa: BLE001 - whatever went wrong, the container must still come up (or say why)
        error: Exception = e
        if arriving is not None:
            arriving.settle()  # the pull ends first; a refused one is the cause
            if isinstance(refused := arriving.failed(), ColdSnapError):
                error = refused
            elif staged is not None and staged.weights_later is not None:  # the cold start reads them: in place
                try:
                    with tl.span("weights"):
                        staged.weights_later()
                except Exception:  # noqa: BLE001 - the restore's own failure is the one to report
                    pass
        cause = error if isinstance(error, ColdSnapError) else ColdSnapError(ErrorCode.INTERNAL,
                                                                             f"{type(error).__name__}: {error}")
        return _fall_back(runc, parsed, creq, tl, capsule, cause, attempted, netns_path(spec))

    if arriving is not None:  # the pull has ended by now (the weights were waited for): as in process mode
        arriving.settle()
    restored.facts.pull = pull_facts or None  # completed by the pull's end
    restored.facts.admit_parts = verdict.parts or None
    message = (f"{cid} restored from {capsule.digest[:19]}… and validated: first token "
               f"{restored.facts.time_to_first_token_s:.3f} s after the restore began (receipt {receipt_path(cid)})")
    # the receipt, then the record that start, the poststart hook and delete read
    finish_receipt(creq.request, cid, "restore", tl, "succeeded", result=restored.facts)
    record = ShimRecord(outcome=Outcome.RESTORED, id=cid, root=parsed.root, bundle=parsed.bundle,
                        capsule=capsule.digest, pid=restored.facts.pid, work_dir=str(restored.work_dir),
                        validated=True, receipt=str(receipt_path(cid)), summary=message)
    records.save(cid, record)
    return CreateOutcome("restored", record=record)


@dataclass
class _Restored:
    facts: RestoreFacts  # the receipt's result
    work_dir: Path  # runc's and CRIU's logs; removed with the container


def _restore(runc: str, parsed: RuncArgv, staged: StagedForRestore, spec: dict, creq: ContainerRequest,
             tl: Timeline, arriving: Arriving | None = None) -> _Restored:
    """criu-restore, hydrate and validate spans. spec: the new container's. The container counts as restored only
    once it served the completion validated at capture, here at create: a restore that fails it is undone and the
    caller falls back to a cold create, as for any other failure (the runtime's start then finds it ready).
    arriving: the weights of a streamed pull, still moving (coldsnap.flows.streaming, as in process mode)."""
    journal = Journal.begin("container-restore", container=parsed.id, capsule=staged.capsule.digest)
    try:
        return _restore_journaled(runc, parsed, staged, spec, creq, tl, arriving, journal)
    finally:
        journal.close()


def _restore_journaled(runc: str, parsed: RuncArgv, staged: StagedForRestore, spec: dict, creq: ContainerRequest,
                       tl: Timeline, arriving: Arriving | None, journal: Journal) -> _Restored:
    profile = staged.capsule.profile
    cid = parsed.id
    weights = streaming.link_or_wait(staged, arriving, journal, tl)
    # Recorded before runc restores anything: whoever looks next (the next runc call for this id, coldsnap gc)
    # deletes a container whose restore this shim did not live to validate.
    records.save(cid, ShimRecord(outcome=Outcome.RESTORING, id=cid, root=parsed.root, bundle=parsed.bundle,
                                 runc=runc, owner=Owner(pid=os.getpid(), start=start_time(os.getpid()))))
    work = Path(records.work_dir_path(cid))  # runc's and CRIU's logs; removed when the container is deleted
    shutil.rmtree(work, ignore_errors=True)
    private_dir(work)
    t0 = time.monotonic()  # the restore clock: staging excluded, as for process mode
    # files of a bound /dev/shm the dump refers to, and those the container wrote into its root filesystem: into
    # the new container's before CRIU looks for them
    put_back = hostfiles.put_back_container_shm(staged.files, profile.files, spec)
    layer = PutBack()
    adapter = get_adapter(profile.engine.name)
    # The weights go onto the GPU meanwhile, as in process mode; the engine takes them through relays in the
    # container (coldsnap.gpu.relay): the prefetchers' sockets are host paths it cannot see.
    prefetch_started = gpu_steps.start_prefetch_soon(
        profile, adapter.supports_prefetch and reloads_weights(staged.capsule), {},
        private_dir(settings().run / "prefetch"), by_file=adapter.prefetch_by_file,
        arrivals=weights.for_prefetch() if weights else None)
    prefetched: dict | None = None
    try:
        rootfs = root_path(spec, parsed.bundle)
        if rootfs:
            put_back_layer(staged.files, profile.files, rootfs, layer)
        with tl.span("criu-restore"):
            pid, argv = restore_container(runc, parsed, staged.images, profile.criu_options, work,
                                          settings().receipts)
        criu_account = criu_stats(work, "restore")  # CRIU's own share of runc's restore
        target = Target(pid=pid, port=creq.port or profile.launch.port, host=creq.host)
        with tl.span("hydrate"):
            gpu = gpu_steps.restore_after_criu(pid) if profile.cuda_pids else gpu_steps.GpuCheckpoint()
            prefetch = prefetch_started()
            if weights is not None:  # the engine takes them next: every piece checked, on its GPUs or in its files
                weights.before_resume(prefetch)
            with relay.into_container(pid, prefetch.for_engine()) as inside:
                resumed = target.call(adapter.after_restore, profile.kv_discarded, profile.weights_mode, inside)
            if weights is not None:
                weights.check_taken(adapter, resumed)
        with tl.span("validate"):
            res = validate(target, creq.validation(profile.validation), profile.expected_text)
        if weights is not None:  # written behind the first token: the blob listed, in the links' place
            weights.settle()
        # the engine has taken the copies (or read the files itself) and served: the prefetchers can go
        prefetched = gpu_steps.finish_prefetch(prefetch_started())
    except BaseException:
        hostfiles.remove_files(put_back)  # the cold start the caller falls back to gets its files as they were
        layer.undo()
        raise
    finally:
        if prefetched is None:
            gpu_steps.finish_prefetch(prefetch_started())
        if weights is not None:  # links still the partial's: nothing may read them (the fallback places them)
            weights.undo()
    layer.settle()
    hydrate = {"cuda_restore_s": gpu.seconds, "engine_resume": resumed,
               "prefetch": prefetched if profile.cuda_pids else None,
               "weights_wait_s": weights.wait_s if weights else None}
    facts = RestoreFacts(
        container=cid, capsule=staged.capsule.digest, pid=pid, address=target.describe(),
        time_to_first_token_s=round(res.first_token_s - t0, 4), validated_text=res.text,
        cuda_processes=len(gpu.pids), criu_options=profile.criu_options, runc_restore=argv,
        weights_mode=profile.weights_mode,
        hydrate=Hydrate.model_validate({k: v for k, v in hydrate.items() if v}), criu_stats=criu_account or None,
        stage_parts=staged.parts or None)
    return _Restored(facts=facts, work_dir=work)


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


def _fall_back(runc: str, parsed: RuncArgv, creq: ContainerRequest, tl: Timeline, capsule: LoadedCapsule | None,
               cause: ColdSnapError, attempted: bool, netns: str | None) -> CreateOutcome:
    cid = parsed.id
    if attempted:  # never leave a half-restored container (only ours: a restore was tried under this id)
        Runc.for_call(runc, parsed).delete_force(cid)
    records.forget(cid)
    shutil.rmtree(records.work_dir_path(cid), ignore_errors=True)  # what is worth keeping sits beside the receipt
    reason = f"{cause.code.value}: {cause.message}"
    if not may_fall_back(cause, creq.request.policy, own_launch=True):
        finish_receipt(creq.request, cid, "restore", tl, failed_state(cause), error=cause)
        return CreateOutcome("fail", f"coldsnap-runtime: {reason}")
    unlocked = _unlock_network(netns)
    result = RestoreFacts(container=cid, capsule=capsule.digest if capsule else creq.request.capsule,
                          fallback_reason=reason, started="cold", **unlocked)
    message = f"coldsnap: {reason}; starting the container cold"
    if parsed.command == "run" and not parsed.detach:  # runc stays in the foreground: hand over to it
        try:
            _record_cold_start(creq, parsed, tl, result, reason)
        except Exception as e:  # noqa: BLE001 - bookkeeping must not stand between the container and its start
            message += f" (and no receipt: {short(str(e), 200)})"
        return CreateOutcome("exec", message)
    runclog.log(parsed, "warning", message)
    # The caller's own create, as runc would run it (all fds: --preserve-fds, the console socket's); the record
    # and the receipt say what happened only once runc has answered.
    with tl.span("cold-start"):
        rc = Runc(runc).call(parsed.argv)
    if rc == 0:
        try:  # the container exists now: bookkeeping that fails must not fail its create
            _record_cold_start(creq, parsed, tl, result, reason)
        except Exception as e:  # noqa: BLE001
            runclog.log(parsed, "warning", f"coldsnap: no receipt or record for the cold start: {short(str(e), 200)}")
        return CreateOutcome("cold", message)
    failed = ColdSnapError(ErrorCode.RUNTIME, f"{reason}; and the cold start failed too: runc {parsed.command} "
                           f"exited {rc}")
    finish_receipt(creq.request, cid, "restore", tl, "failed", result=result, error=failed)
    return CreateOutcome("cold", message, exit_code=rc)


def _record_cold_start(creq: ContainerRequest, parsed: RuncArgv, tl: Timeline, result: RestoreFacts,
                       reason: str) -> None:
    """The receipt and the record of a container started cold (its poststart hook says so; its delete forgets)."""
    cid = parsed.id
    finish_receipt(creq.request, cid, "restore", tl, "fell-back", result=result)
    records.save(cid, ShimRecord(outcome=Outcome.FELL_BACK, id=cid, root=parsed.root, bundle=parsed.bundle,
                                 reason=reason, receipt=str(receipt_path(cid))))
