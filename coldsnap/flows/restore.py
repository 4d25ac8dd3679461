"""restore: (pull →) admit → stage → restore → hydrate → validate → receipt.

A refused or failed restore falls back to a cold start when the policy allows it: never worse than vanilla.
`prepare` (restore --prepare-only) runs admit and stage only and touches no workload."""

from __future__ import annotations

import importlib
import shutil
import threading
import time
import uuid
from contextlib import ExitStack
from typing import Callable

from coldsnap import net  # its names load pyroute2 on first use
from coldsnap.base.files import private_dir
from coldsnap.base.journal import Dir, Journal, Network, Workload, start_time
from coldsnap.base.paths import settings
from coldsnap.base.procfs import alive, descendants
from coldsnap.base.progress import Progress, quiet
from coldsnap.capsule import LoadedCapsule
from coldsnap.capsule import staged as staged_area
from coldsnap.capsule.pieces import direct_wanted
from coldsnap.contracts import ColdSnapError, ErrorCode, NetworkPlan, Receipt, RestoreRequest
from coldsnap.contracts.results import Hydrate, InsteadOf, Operation, Ranks, RestoreFacts
from coldsnap.criu import CriuDriver, CriuOptions, criu_stats, lazy_pages_wanted
from coldsnap.engines import get_adapter
from coldsnap.engines.base import engine_info
from coldsnap.engines.lease import hold as hold_lease
from coldsnap.flows import streaming
from coldsnap.flows.admission import admit_capsule, load_capsule, look_at_this_host_soon
from coldsnap.flows.coldstart import start_cold
from coldsnap.flows.fallback import may_fall_back
from coldsnap.flows.fetch import Arriving, fetch, is_registry_reference
from coldsnap.flows.receipts import finish_receipt, receipt_on_failure
from coldsnap.flows.spans import Timeline
from coldsnap.flows.staging import StagedForRestore, put_back_files, reloads_weights, stage
from coldsnap.gpu import steps as gpu_steps
from coldsnap.workload.claim import claimed
from coldsnap.workload.probe import ValidationProbe
from coldsnap.workload.process import kill_tree
from coldsnap.workload.state import WorkloadState, run_dir, save_state


# --- the whole restore -------------------------------------------------------------------------------------------
def restore(request: RestoreRequest, progress: Progress = quiet) -> Receipt:
    tl = Timeline()
    op: Operation = "prepare" if request.operation == "prepare" else "restore"
    op_id = request.id or f"{op}-{uuid.uuid4().hex[:12]}"
    with receipt_on_failure(request, op_id, op, tl), ExitStack() as held:
        pulled: dict = {}
        arriving = None
        # a direct pull's prefetch, ordered before admission (streaming.PrefetchAhead)
        orders = streaming.PrefetchAhead(request.gpu_map) if op == "restore" and direct_wanted() else None
        ahead = None
        if is_registry_reference(request.capsule):
            def meanwhile() -> None:
                """While the pull waits on the registry, off the restore's clock: the network step's library loads,
                admission looks at this host, and a direct pull's prefetcher starts CUDA."""
                threading.Thread(target=importlib.import_module, args=("coldsnap.net.netns",), daemon=True).start()
                look_at_this_host_soon()
                if orders is not None and (waiting := gpu_steps.stand_by()) is not None:
                    held.callback(waiting.reap)  # taken, or not needed: it goes
                    orders.stand_by(waiting)

            with tl.span("pull"):  # until the capsule's own blobs are in: its weights follow
                request, pulled, arriving = fetch(request, progress, meanwhile,
                                                  orders.profile_in if orders is not None else None)
            if arriving is not None:
                held.callback(arriving.settle)  # the pull ends before the restore does, however it ends
        with tl.span("admit"):
            capsule = load_capsule(request.capsule, request.policy.allow_unpinned)
            if orders is not None:
                ahead = orders.taken(capsule, arriving)
            if ahead is not None:  # reaped whatever happens; the restore's own reaping comes first where it took it
                held.callback(lambda: gpu_steps.finish_prefetch(ahead()))
            verdict = admit_capsule(capsule, request.policy, _driver_for(capsule, op))
            instead_of: InsteadOf | None = None
            if not verdict.admitted and not verdict.untrusted and arriving is not None:
                arriving.wait()  # its template, if it names one, comes with the rest of the pull
            if not verdict.admitted and not verdict.untrusted and (template := _template_of(capsule)):
                # the full capsule's device state cannot restore here; its template rebuilds it
                template_verdict = admit_capsule(template, request.policy, "criu-template")
                if template_verdict.admitted:
                    progress(f"{verdict.refusal().message}; restoring its template {template.digest[:19]}… instead")
                    instead_of = InsteadOf(capsule=capsule.digest, refused=verdict.sentence())
                    capsule, verdict = template, template_verdict
        for w in verdict.warnings:
            progress(f"note: {w} (relaxed compatibility)")
        if op == "restore":  # the name is this restore's until its state file is written, fallback included
            held.enter_context(claimed(workload_name(request, capsule.profile), "restore"))
        if not verdict.admitted:
            return _fall_back(request, capsule, tl, op_id, verdict.refusal(), progress)
        with tl.span("stage"):
            try:
                staged = stage(capsule, arriving.wait if arriving else None, arriving.early if arriving else None)
            except Exception:
                if arriving is not None and (cause := arriving.failed()) is not None:
                    raise cause from None  # the stream's refusal took the blobs staging was reading
                raise
        if staged.weights_later is not None and op == "prepare":  # admitted and staged while they arrived
            with tl.span("weights"):
                staged.weights_later()
        progress(f"staged {capsule.digest[:19]}… (all digests verified)")
        if op == "prepare":
            result = RestoreFacts(capsule=capsule.digest, staged=str(staged.images.parent), admission="admitted")
        else:
            try:
                result = _restore_staged(request, staged, tl, progress, arriving,
                                         ahead if capsule.digest == request.capsule else None)
            except ColdSnapError as e:
                if staged.weights_later is not None:  # a cold start reads the weights: all of them, checked
                    with tl.span("weights"):
                        staged.weights_later()
                return _fall_back(request, capsule, tl, op_id, e, progress)
        # what every receipt of this restore or prepare carries: where staging went, and a template's reason
        result.stage_parts, result.instead_of, result.pull = staged.parts, instead_of, pulled or None
        result.admit_parts = verdict.parts or None
        return finish_receipt(request, op_id, op, tl, "succeeded", result=result)


def _driver_for(capsule: LoadedCapsule, op: str) -> str:
    """The snapshot driver this operation restores with: a prepare stages a capsule of any driver (a container
    capsule is then restored by its runtime, coldsnap-runtime, from the staged copy); a restore here is a process
    restore, of a full capsule (criu-process) or a template (criu-template)."""
    driver = capsule.profile.snapshot_driver
    return driver if op == "prepare" or driver == "criu-template" else "criu-process"


def _template_of(capsule: LoadedCapsule) -> LoadedCapsule | None:
    """The template capsule a full capsule names (captured with it, --snapshot-driver both), when this store has it."""
    digest = capsule.template
    if not digest:
        return None
    try:
        return load_capsule(digest, allow_unpinned=False)
    except ColdSnapError:
        return None


def workload_name(request: RestoreRequest, profile) -> str:
    """--name, else the captured workload's name."""
    return (request.lifecycle.name or profile.workload_name
            or profile.network.netns.removeprefix("coldsnap-"))


def _restore_staged(request: RestoreRequest, staged: StagedForRestore, tl: Timeline, progress: Progress,
                    arriving: Arriving | None = None,
                    ahead: Callable[[], gpu_steps.Prefetch] | None = None) -> RestoreFacts:
    profile = staged.capsule.profile
    name = workload_name(request, profile)
    gpu_steps.refuse_without_room(profile, request.gpu_map)
    validation = request.validation or profile.validation
    criu = CriuDriver()
    adapter = get_adapter(profile.engine.name)
    pid = lease = lazy = prefetched = None
    ok = False
    # Journaled before it exists: a restore killed before its validation leaves nothing running once someone looks.
    journal = Journal.begin("restore", workload=name, capsule=staged.capsule.digest)
    try:
        weights = streaming.link_or_wait(staged, arriving, journal, tl)
    except BaseException:
        journal.close()
        raise
    t0 = time.monotonic()  # the restore clock: staging is excluded, as for a vanilla start
    # The weights go onto the GPU meanwhile, when they can (a process of its own; the engine takes them at resume),
    # weights still streaming in piece by piece as each is checked against its pin; or already on their way (ahead).
    prefetch_started = ahead or gpu_steps.start_prefetch_soon(
        profile, adapter.supports_prefetch and reloads_weights(staged.capsule), request.gpu_map,
        private_dir(settings().run / "prefetch"), by_file=adapter.prefetch_by_file,
        arrivals=weights.for_prefetch() if weights else None)
    try:
        with tl.span("network"):
            # A network of its own, whatever the capture's was: the engine listens on 0.0.0.0, its own connections
            # go over loopback, and N restores of one capsule each get a namespace and addresses of their own.
            # Journaled between its choice and its making (new_network's `before`).
            assert profile.network is not None, "admission lets only process capsules restore here"
            plan = net.new_network(name, profile.network.port,
                               before=lambda chosen: journal.add(Network(chosen.model_dump())))
            workload = journal.add(Workload(name=name, netns=plan.netns))
        progress("restoring with CRIU")
        work = settings().run / "restore-work" / uuid.uuid4().hex
        journal.add(Dir(str(work)))
        private_dir(work)
        # the restored engine waits on this lease for its resume, instead of resuming itself
        lease = hold_lease(profile.engine_lease) if profile.engine_lease else None
        with tl.span("criu-restore"), staged_area.restoring(staged.capsule.digest):
            # one restore of a capsule at a time puts back its files and hands them to CRIU: each gets its own
            # copies (replaced, not rewritten, so an earlier restore keeps the ones it has)
            put_back_files(staged)
            options = CriuOptions(host_mounts=True, lazy_pages=lazy_pages_wanted())
            pid, lazy = criu.restore(staged.images, work, options, net.netns_path(plan.netns))
        journal.update(workload, pid=pid, start=start_time(pid))
        criu_account = criu_stats(work, "restore")
        with tl.span("hydrate"):
            gpu = gpu_steps.restore_after_criu(pid, gpu_pairs=list(request.gpu_map.items()) or None)
            prefetch = prefetch_started()
            if weights is not None:  # the engine takes them next: every piece checked, on its GPUs or in its files
                weights.before_resume(prefetch)
            engine = adapter.after_restore(plan.workload_address, plan.port, profile.kv_discarded,
                                           profile.weights_mode, prefetched=prefetch.for_engine())
            if weights is not None:
                weights.check_taken(adapter, engine)
        probe = ValidationProbe(plan.workload_address, plan.port, validation)
        with tl.span("validate"):
            probe.wait_ready(alive=lambda: alive(pid), timeout=validation.ready_timeout_s)
            res = probe.complete(expected=profile.expected_text)
        ttft = res.first_token_s - t0
        if weights is not None:  # written behind the first token: the blob listed, in the links' place
            weights.settle()
        pages_in_s = None
        if lazy is not None:  # the tree counts as restored once every page is in
            lazy.finish()
            pages_in_s = round(time.monotonic() - t0, 4)
        prefetched = gpu_steps.finish_prefetch(prefetch_started())
        ranks = _ranks_restored(profile, plan, pid)
        progress(f"restored and validated: first token {ttft:.3f} s after restore began"
                 + (f"; {ranks.restored}/{ranks.expected} ranks" if ranks else ""))
        url = f"http://{plan.workload_address}:{plan.port}"
        save_state(WorkloadState(name=name, pid=pid, network=plan.model_dump(), origin="restored",
                                 capsule=staged.capsule.digest, run_dir=str(run_dir(name)),
                                 log=profile.files[0].path if profile.files else "", url=url, cuda_pids=gpu.pids,
                                 engine=profile.engine.name, weights_mode=profile.weights_mode))
        ok = True
        for owned in (workload, *journal.of(Network)):  # its state file owns them now
            journal.drop(owned)
        return RestoreFacts(
            capsule=staged.capsule.digest, snapshot_driver=profile.snapshot_driver, workload=name, pid=pid, url=url,
            time_to_first_token_s=round(ttft, 4), validated_text=res.text, cuda_processes=len(gpu.pids),
            first_token_monotonic_s=round(res.first_token_s, 6), criu_options=options.cli_flags(),
            hydrate=Hydrate(cuda_restore_s=gpu.seconds, cuda_restore_per_pid_s=gpu.per_pid if len(gpu.pids) > 1
                            else None, engine_resume=engine, prefetch=prefetched,
                            weights_wait_s=weights.wait_s if weights else None),
            criu_stats=criu_account, lazy_pages={"all_in_s": pages_in_s} if lazy else None,
            weights_mode=profile.weights_mode, ranks=ranks)
    finally:
        if lease is not None:
            lease.release()
        if prefetched is None:  # failed before the first token: reap the prefetchers whatever they did
            gpu_steps.finish_prefetch(prefetch_started())
        if not ok:
            if pid is not None:
                kill_tree(pid)
            if lazy is not None:
                lazy.kill()
            for network in journal.of(Network):  # ours: chosen (and perhaps made) by this restore
                net.destroy_network(NetworkPlan.model_validate(network.plan))
        for d in journal.of(Dir):
            shutil.rmtree(d.path, ignore_errors=True)
        if weights is not None:  # links still the partial's: nothing may read them (the fallback places them)
            weights.undo()
        journal.close()


def _ranks_restored(profile, plan, root_pid: int) -> Ranks | None:
    """A distributed workload: every rank must be back, in the restored tree. (The validated completion already
    needed every rank's collectives; this names a missing one instead of a hang.)"""
    if profile.distributed is None:
        return None
    from coldsnap.workload.process import inner_pid

    # The ranks report their PIDs as they see them (inside the workload's PID namespace on CPU).
    tree = {inner_pid(p) for p in (root_pid, *descendants(root_pid)) if alive(p)}
    reported = (engine_info(plan.workload_address, plan.port).get("tensor_parallel") or {}).get("ranks") or []
    restored = sum(1 for r in reported if r.get("pid") in tree)
    expected = profile.distributed.world_size
    if restored != expected:
        raise ColdSnapError(ErrorCode.VALIDATION_FAILED, f"{restored}/{expected} ranks restored")
    return Ranks(restored=restored, expected=expected)


# --- cold fallback -----------------------------------------------------------------------------------------------
def _fall_back(request: RestoreRequest, capsule: LoadedCapsule, tl: Timeline, op_id: str, cause: ColdSnapError,
               progress: Progress) -> Receipt:
    """Start the capsule's launch cold when the policy allows it (a prepare never does); else the cause, with its
    receipt, goes up."""
    if request.operation == "prepare" or not may_fall_back(cause, request.policy, own_launch=False):
        raise cause
    progress(f"{cause.message}; falling back to a cold start")
    with tl.span("cold-start"):
        result = cold_start(capsule.profile, request, progress)
    result.fallback_reason, result.capsule = f"{cause.code.value}: {cause.message}", capsule.digest
    return finish_receipt(request, op_id, "restore", tl, "fell-back", result=result)


def cold_start(profile, request: RestoreRequest, progress: Progress) -> RestoreFacts:
    """Start the captured workload's launch cold, on a network of its own, and validate it."""
    name = workload_name(request, profile)
    template = profile.snapshot_driver == "criu-template"  # its launch starts a template: started, then resumed
    cold = start_cold(name, profile.network.port, profile.launch.command, profile.launch.env, profile.launch.workdir,
                      request.validation or profile.validation, expected=profile.expected_text, template=template)
    if template:  # the device work a template does when resumed
        try:
            plan = cold.state.plan
            get_adapter(profile.engine.name).after_restore(plan.workload_address, plan.port, True, "recovery")
            cold.probe.wait_ready(alive=lambda: alive(cold.state.pid))
            cold.first = cold.probe.complete(expected=profile.expected_text)
        except BaseException:
            kill_tree(cold.state.pid)
            net.destroy_network(cold.state.plan)
            raise
    cold.state.engine, cold.state.weights_mode = profile.engine.name, profile.weights_mode
    save_state(cold.state)
    progress(f"cold start validated: first token {cold.time_to_first_token:.2f} s after start")
    assert cold.first is not None  # time_to_first_token has it
    return RestoreFacts(workload=name, pid=cold.state.pid, url=cold.state.url,
                        time_to_first_token_s=round(cold.time_to_first_token, 4), validated_text=cold.first.text,
                        started="cold")
