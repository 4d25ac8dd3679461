"""Start a workload cold (vanilla) in its network plan and validate it: the path capture, cold fallback and the
benchmark's vanilla samples share."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..contracts import NetworkPlan, Validation
from ..net import create_network, destroy_network
from ..probe import ProbeResult, ValidationProbe
from ..workload import WorkloadState, alive, kill_tree, run_dir, start_in_namespaces, workload_env


@dataclass
class ColdStart:
    state: WorkloadState
    probe: ValidationProbe
    first: ProbeResult
    started: float  # monotonic: when the start was issued
    ready: float  # monotonic: when /health first answered

    @property
    def time_to_first_token(self) -> float:
        return self.first.first_token_s - self.started


def start_cold(name: str, plan: NetworkPlan, argv: list[str], env: dict[str, str], cwd: str | None,
               validation: Validation, expected: str | None = None, gpu: bool = False) -> ColdStart:
    """Network, start, ready, one validated completion. On failure nothing is left running."""
    wdir = run_dir(name)
    log = wdir / "engine.log"
    log.unlink(missing_ok=True)
    pid = None
    try:
        create_network(plan)
        started = time.monotonic()
        pid = start_in_namespaces(argv, workload_env(env), plan, log, cwd=cwd, pid_namespace=not gpu)
        probe = ValidationProbe(plan.workload_address, plan.port, validation)
        ready = probe.wait_ready(alive=lambda: alive(pid))
        first = probe.complete(expected=expected)
    except BaseException:
        if pid is not None:
            kill_tree(pid)
        destroy_network(plan)
        raise
    state = WorkloadState(name=name, pid=pid, network=plan.model_dump(), origin="cold", run_dir=str(wdir),
                          log=str(log), url=f"http://{plan.workload_address}:{plan.port}")
    return ColdStart(state=state, probe=probe, first=first, started=started, ready=ready)
