"""Start a workload cold (vanilla) in its network plan and validate it: the path capture, cold fallback and the
benchmark's vanilla samples share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from coldsnap import net  # its names load pyroute2 on first use
from coldsnap.base.journal import Journal, Network, Thing, Workload, start_time
from coldsnap.base.procfs import alive
from coldsnap.contracts import ColdSnapError, ErrorCode, NetworkPlan, Validation
from coldsnap.workload.probe import ProbeResult, ValidationProbe
from coldsnap.workload.process import kill_tree, start_in_namespaces, workload_env
from coldsnap.workload.state import WorkloadState, run_dir


@dataclass
class ColdStart:
    state: WorkloadState
    probe: ValidationProbe
    first: ProbeResult | None  # None: a template, which serves nothing until it is resumed
    started: float  # monotonic: when the start was issued
    ready: float  # monotonic: when /health first answered
    journaled: list[Thing] = field(default_factory=list)  # its entries in the caller's journal, to drop at hand-over

    @property
    def time_to_first_token(self) -> float:
        if self.first is None:
            raise ValueError("a template start answers no request: it has no time to first token")
        return self.first.first_token_s - self.started


def start_cold(name: str, plan: NetworkPlan | int, argv: list[str], env: dict[str, str], cwd: str | None,
               validation: Validation, expected: str | None = None,
               journal: Journal | None = None, template: bool = False) -> ColdStart:
    """Network, start, ready, one validated completion. On failure nothing is left running. plan: the network to
    create, or the port the workload serves on (a free network is chosen, ColdStart.state.network says which). With
    a journal, the network and the workload are recorded in it before they exist (the caller drops them once it owns
    them). template: the engine starts as a pre-device template; ready once it says so, with nothing validated."""
    wdir = run_dir(name)
    log = wdir / "engine.log"
    log.unlink(missing_ok=True)
    pid = None
    own = journal is None
    journal = journal or Journal.begin("cold-start", workload=name)
    network = None

    def record(chosen: NetworkPlan) -> None:
        nonlocal network
        network = journal.add(Network(chosen.model_dump()))

    try:
        if isinstance(plan, NetworkPlan):
            record(plan)
            net.create_network(plan)
        else:
            plan = net.new_network(name, plan, before=record)
    except BaseException:  # refused: nothing of ours to clean (the netns, address or veth is someone else's)
        if network is not None:
            journal.drop(network)
        if own:
            journal.close()
        raise
    assert network is not None  # record() ran before the network was created
    workload = journal.add(Workload(name=name, netns=plan.netns))
    try:
        started = time.monotonic()
        pid = start_in_namespaces(argv, workload_env(env), plan, log, cwd=cwd)
        journal.update(workload, pid=pid, start=start_time(pid))
        probe = ValidationProbe(plan.workload_address, plan.port, validation)
        if template:  # ready to be captured before the device is touched: nothing to validate yet
            ready, first = probe.wait_template(alive=lambda: alive(pid)), None
        else:
            ready = probe.wait_ready(alive=lambda: alive(pid))
            first = probe.complete(expected=expected)
    except BaseException as e:
        if pid is not None:
            kill_tree(pid)
        net.destroy_network(plan)
        journal.drop(workload)
        journal.drop(network)
        if own:
            journal.close()
        if isinstance(e, ColdSnapError) and e.code == ErrorCode.WORKLOAD_FAILED:
            why = last_words(log)
            if why:
                raise ColdSnapError(e.code, f"{e.message}: {why}") from None
        raise
    state = WorkloadState(name=name, pid=pid, network=plan.model_dump(), origin="cold", run_dir=str(wdir),
                          log=str(log), url=f"http://{plan.workload_address}:{plan.port}")
    if own:  # the caller owns the workload from here (its state file, or it stops it)
        journal.close()
    return ColdStart(state=state, probe=probe, first=first, started=started, ready=ready,
                     journaled=[] if own else [network, workload])


def last_words(log) -> str:
    """Why an engine died, from its log: the first fatal event of an engine that prints JSON events (the reference
    engine; with several ranks the first is the cause, the rest follow from it), else the last line that looks like
    an error, else the last line that is not an event (the launcher's own lines left out)."""
    import json

    try:
        lines = [ln.strip() for ln in open(log, errors="replace").read().splitlines()[-200:] if ln.strip()]
    except OSError:
        return ""
    # what the namespace launcher says when the engine under it is killed, not the engine's words
    lines = [ln for ln in lines if not ln.startswith(("unshare: ", "nsenter: "))]
    for ln in lines:
        if ln.startswith("{"):
            try:
                event = json.loads(ln)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "fatal" and event.get("error"):
                return str(event["error"])[:300]
    for ln in reversed(lines):
        if "Error" in ln or "error:" in ln.lower():
            return ln[:300]
    words = [ln for ln in lines if not ln.startswith("{")]  # an event that is not fatal says nothing of a death
    return words[-1][:300] if words else ""
