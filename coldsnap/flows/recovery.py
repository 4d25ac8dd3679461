"""Recovery: undo what operations killed midway left on this host, from their journals (coldsnap.base.journal), and
finish what the shim's killed calls left (coldsnap.oci.records). The next coldsnap command, `coldsnap status`,
`stop` and `gc` run it; an operation whose owner still lives is never touched.

What an interrupted operation leaves, and what becomes of it:
  workload (capture, restore): every process in its network namespace is killed and reaped, its /dev/shm files
    removed, its network deleted (unless a live workload claims it) — except the workload of a --leave-running
    capture, which is brought back as it was (its CUDA state restored, its engine resumed) and kept, with its
    state file, for `coldsnap status` and `stop`.
  released (a container capture): the container's engine is resumed; the container is the user's.
  dir (capture and restore work, staging temp dirs, partial layers' scratch): removed.
  files (host /dev/shm files of a dumped tree): removed with the workload.
And a container the shim was restoring (its record says so): deleted with runc, its record forgotten."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from contextlib import suppress
from pathlib import Path

from coldsnap import net  # its names load pyroute2 on first use: every command recovers first
from coldsnap.base import journal as journals
from coldsnap.base.journal import (
    CudaTree,
    Dir,
    Journal,
    Linked,
    Network,
    Released,
    ShmFiles,
    Validated,
    Workload,
    same_process,
)
from coldsnap.base.procfs import alive, in_network_namespace
from coldsnap.base.progress import Progress, quiet
from coldsnap.contracts import ColdSnapError, NetworkPlan
from coldsnap.engines import get_adapter
from coldsnap.gpu import steps as gpu_steps
from coldsnap.oci import records
from coldsnap.oci.runtime import Runc
from coldsnap.workload.claim import CLAIM
from coldsnap.workload.state import WorkloadState, list_states, save_state
from coldsnap.workload.target import Target


def recover(progress: Progress = quiet) -> list[str]:
    """Clean up after every operation whose owner is gone; one sentence per operation cleaned."""
    done = []
    for j in journals.entries():
        if j.owner_alive():
            continue
        if j.kind == CLAIM:  # a dead owner's claim holds nothing: its operation's own entry says what to undo
            j.close()
            continue
        try:
            done.append(_undo(j))
        except Exception as e:  # noqa: BLE001 - one leftover must not block the rest, nor the command that looks
            done.append(f"{j.kind} {j.about.get('workload') or ''}: could not clean up entirely: {e}")
        j.close()
    done += _interrupted_container_restores()
    for line in done:
        progress(line)
    return done


# --- workloads -------------------------------------------------------------------------------------------------
def kill_network_namespace(netns: str) -> int:
    """SIGKILL every process in the named network namespace and wait until they are gone; how many there were."""
    try:
        inode = net.netns_inode(netns)
    except OSError:
        return 0
    pids = in_network_namespace(inode)
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        for pid in pids:
            with suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # ours to reap when this process restored it
        time.sleep(0.02)
    return len(pids)


def _claimed(netns: str, by_other_than: Journal) -> bool:
    """Whether a live workload's state file or another live operation holds this network namespace."""
    if any(ws.plan.netns == netns and alive(ws.pid) for ws in list_states()):
        return True
    return any(j.path != by_other_than.path and j.owner_alive() and any(
        (isinstance(t, Workload) and t.netns == netns) or (isinstance(t, Network) and t.plan.get("netns") == netns)
        for t in j.things) for j in journals.entries())


def _keep_left_running(j: Journal) -> bool:
    """A --leave-running capture's workload must serve on whatever happened to the capture: bring it back (CUDA
    state, engine) and give it a state file. False when there is nothing alive to keep."""
    if j.kind != "capture" or not j.about.get("leave_running") or not j.of(Validated):
        return False
    workload = next(iter(j.of(Workload)), None)
    if workload is None or workload.pid is None or not same_process(workload.pid, workload.start):
        return False
    plan = NetworkPlan.model_validate(j.about["plan"])
    for t in j.things:
        if isinstance(t, CudaTree):
            gpu_steps.restore_after_criu(workload.pid)
        elif isinstance(t, Released) and t.host:  # a process capture's engine, at its workload's address
            get_adapter(t.engine).after_capture_left_running(t.host, t.port, True, t.weights_mode)
    wdir = next((d.path for d in j.of(Dir) if d.workload_dir), "")
    save_state(WorkloadState(name=workload.name, pid=workload.pid, network=plan.model_dump(), origin="cold",
                             run_dir=wdir, log=str(Path(wdir) / "engine.log") if wdir else "",
                             url=f"http://{plan.workload_address}:{plan.port}", engine=j.about.get("engine", ""),
                             weights_mode=j.about.get("weights_mode", "")))
    return True


def _undo(j: Journal) -> str:
    kept = _keep_left_running(j)
    killed = 0
    for t in reversed(j.things):
        if isinstance(t, Workload) and not kept and t.netns and not _claimed(t.netns, j):
            killed += kill_network_namespace(t.netns)
        elif isinstance(t, Network) and not kept:
            plan = NetworkPlan.model_validate(t.plan)
            if not _claimed(plan.netns, j):
                net.destroy_network(plan)
        elif isinstance(t, (ShmFiles, Linked)) and not kept:
            for path in t.paths:
                Path(path).unlink(missing_ok=True)
        elif isinstance(t, Dir) and not (kept and t.workload_dir):
            shutil.rmtree(t.path, ignore_errors=True)
        elif isinstance(t, Released) and t.container_pid and alive(t.container_pid):
            target = Target(pid=t.container_pid, port=t.port, host=t.host)
            for cuda in j.of(CudaTree):
                gpu_steps.restore_after_criu(cuda.root)
            target.call(get_adapter(t.engine).after_capture_left_running, True, t.weights_mode)
    what = f"{j.kind} of {j.about.get('workload') or j.about.get('capsule') or j.about.get('container') or '?'}"
    if kept:
        return f"{what} was interrupted; its workload serves on (coldsnap status, coldsnap stop)"
    return f"{what} was interrupted; cleaned up" + (f" ({killed} process(es) stopped)" if killed else "")


# --- containers the shim was restoring -------------------------------------------------------------------------
def _interrupted_container_restores() -> list[str]:
    """Shim records of restores whose shim died before the container was validated: delete those containers."""
    out = []
    shim = Path(records.state_dir())
    for path in sorted(shim.glob("*.json")) if shim.is_dir() else []:
        record = records.load(path.stem)
        if record is None or record.outcome != records.Outcome.RESTORING:
            continue
        if record.owner and same_process(record.owner.pid, record.owner.start):
            continue
        try:
            Runc.at_root(record.runc, record.root).delete_force(record.id)
            records.forget(record.id)
            out.append(f"restore of container {record.id} was interrupted; the container was deleted")
        except (OSError, subprocess.SubprocessError, ColdSnapError) as e:
            out.append(f"restore of container {path.stem} was interrupted; could not delete it: {e}")
    return out
