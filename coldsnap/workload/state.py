"""A workload's state file: <run>/workloads/<name>/state.json (0600), what `status`, `stop`, `sleep` and `wake`
read."""

from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

from coldsnap.base.files import private_dir, write_run_state
from coldsnap.base.paths import settings
from coldsnap.base.procfs import alive
from coldsnap.contracts import ColdSnapError, ErrorCode, NetworkPlan


@dataclass
class WorkloadState:
    name: str
    pid: int  # host PID of the PID-namespace init
    network: dict
    state: str = "active"  # active | sleeping
    origin: str = "cold"  # cold | restored
    capsule: str | None = None
    run_dir: str = ""
    log: str = ""
    url: str = ""
    cuda_pids: list[int] = field(default_factory=list)
    engine: str = ""  # adapter name: sleep/wake ask the engine to release and resume
    weights_mode: str = ""  # native | recovery
    sleep_mode: str = ""  # how it sleeps now: engine | cuda

    @property
    def plan(self) -> NetworkPlan:
        return NetworkPlan.model_validate(self.network)


def run_dir(name: str) -> Path:
    return private_dir(settings().run / "workloads" / name)


def save_state(ws: WorkloadState) -> None:
    write_run_state(run_dir(ws.name) / "state.json", json.dumps(asdict(ws), indent=1).encode())


def _read(path: Path) -> WorkloadState:
    return WorkloadState(**json.loads(path.read_text()))


def load_state(name: str) -> WorkloadState:
    try:
        return _read(settings().run / "workloads" / name / "state.json")
    except FileNotFoundError:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"no workload named {name!r} on this host") from None


def list_states() -> list[WorkloadState]:
    out = []
    for p in sorted((settings().run / "workloads").glob("*/state.json")):
        with suppress(ValueError, TypeError):
            out.append(_read(p))
    return out


def refuse_running(name: str) -> None:
    """A workload of this name that runs in this home (its state file and process): a second one would take its
    run directory and state."""
    try:
        ws = _read(settings().run / "workloads" / name / "state.json")
    except (OSError, ValueError, TypeError):
        return
    if alive(ws.pid):
        raise ColdSnapError(ErrorCode.RESOURCE_BUSY, f"workload {name!r} is running (pid {ws.pid}): stop it "
                            f"(coldsnap stop {name}) or choose another --name")
