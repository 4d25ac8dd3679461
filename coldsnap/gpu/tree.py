"""CUDA state of a whole process tree: find the CUDA clients, checkpoint them all, restore them all.

Every process of the tree that holds CUDA state must be locked and checkpointed before CRIU dumps the tree, and a
process that maps /dev/nvidia* without being a CUDA client (a child forked after CUDA init inherits the mappings but
not the CUDA state) makes CRIU fail with "Can't handle non-regular mapping": capture must refuse it by name.

The procfs walking takes its readers as parameters so it can be tested without a GPU.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from coldsnap.base.procfs import process_tree, read_children
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.gpu.cuda_checkpoint import CudaCheckpointAPI

ChildrenReader = Callable[[int], list[int]]
MapsReader = Callable[[int], Iterable[str]]
CmdlineReader = Callable[[int], str]

NO_CUDA = "no CUDA processes"


# ---- procfs -------------------------------------------------------------------------------------------------
def read_maps(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.readlines()
    except OSError:
        return []


def read_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    if not text:  # kernel threads and zombies have no cmdline
        with suppress(OSError), open(f"/proc/{pid}/comm") as f:
            text = f"[{f.read().strip()}]"
    return text


def maps_nvidia(lines: Iterable[str]) -> bool:
    """Whether a /proc/<pid>/maps text maps any /dev/nvidia* device (nvidiactl, nvidia0, nvidia-uvm, …)."""
    # address perms offset dev inode [path]; the path may contain spaces and end in " (deleted)".
    fields = (line.split(maxsplit=5) for line in lines)
    return any(len(parts) == 6 and parts[5].startswith("/dev/nvidia") for parts in fields)


# ---- discovery ----------------------------------------------------------------------------------------------
def cuda_pids(
    root_pid: int,
    api: CudaCheckpointAPI | None = None,
    *,
    is_cuda: Callable[[int], bool] | None = None,
    children: ChildrenReader = read_children,
    max_scans: int = 20,
    interval_s: float = 0.05,
) -> list[int]:
    """The CUDA clients of the tree under root_pid (tree order), rescanned until two scans agree.

    A process is a CUDA client when the driver can name its restore thread (cuCheckpointProcessGetRestoreThreadId
    succeeds). Without the checkpoint API no process can be checkpointed: the answer is []. `is_cuda` replaces the
    driver query (tests). Raises ColdSnapError(GPU_FAILED) if the set keeps changing for max_scans scans."""
    if is_cuda is None:
        api = api or CudaCheckpointAPI()
        if not api.available():
            return []
        is_cuda = api.is_cuda_process
    previous: list[int] | None = None
    for _ in range(max_scans):
        current = [p for p in process_tree(root_pid, children) if is_cuda(p)]
        if current == previous:
            return current
        previous = current
        time.sleep(interval_s)
    raise ColdSnapError(
        ErrorCode.GPU_FAILED,
        f"the set of CUDA processes under pid {root_pid} kept changing over {max_scans} scans (last: {previous})",
    )


def foreign_nvidia_mappings(
    root_pid: int,
    cuda_pids: Sequence[int],
    *,
    children: ChildrenReader = read_children,
    maps: MapsReader = read_maps,
    cmdline: CmdlineReader = read_cmdline,
) -> list[tuple[int, str]]:
    """(pid, command line) of every process in the tree that maps /dev/nvidia* but is not a CUDA client.

    CRIU cannot dump these ("Can't handle non-regular mapping") and the CUDA checkpoint can't clear them: a capture
    must refuse, naming them (typically a child forked after CUDA init: start it with spawn, or before CUDA)."""
    known = set(cuda_pids)
    return [(p, cmdline(p)) for p in process_tree(root_pid, children) if p not in known and maps_nvidia(maps(p))]


def describe_foreign(foreign: Sequence[tuple[int, str]]) -> str:
    """One sentence for a refusal: which processes, and why."""
    listed = "; ".join(f"pid {pid} ({cmd[:120] or '?'})" for pid, cmd in foreign)
    return (
        f"{len(foreign)} process(es) map /dev/nvidia* without being CUDA clients, which CRIU cannot dump "
        f"(Can't handle non-regular mapping): {listed}. Typically children forked after CUDA initialisation; "
        "start them before CUDA or with the spawn start method."
    )


# ---- checkpoint / restore -----------------------------------------------------------------------------------
@dataclass
class TreeReport:
    """What a tree operation did: the pids, the seconds spent per step (all pids) and per pid."""

    operation: str  # "checkpoint" | "restore"
    pids: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    per_pid: dict[int, dict[str, float]] = field(default_factory=dict)
    message: str = ""

    def to_dict(self) -> dict:
        return {
            "operation": self.operation,
            "pids": list(self.pids),
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "per_pid": {str(p): {k: round(v, 6) for k, v in s.items()} for p, s in self.per_pid.items()},
            "message": self.message,
        }


def _each(report: TreeReport, step: str, pids: Sequence[int], fn: Callable[[int], None]) -> None:
    """Run one step on every pid at once (the ranks of a tensor-parallel tree are restored side by side: the
    driver calls release the GIL). report.seconds[step] is the wall time of the step, per_pid each pid's own.
    Raises the first failure, after every call has returned."""
    def timed(pid: int) -> None:
        t = time.perf_counter()
        try:
            fn(pid)
        finally:
            report.per_pid.setdefault(pid, {})[step] = time.perf_counter() - t

    t0 = time.perf_counter()
    try:
        if len(pids) == 1:
            timed(pids[0])
        elif pids:
            with ThreadPoolExecutor(len(pids), thread_name_prefix=f"cuda-{step}") as pool:
                for f in [pool.submit(timed, pid) for pid in pids]:
                    f.result()
    finally:
        report.seconds[step] = report.seconds.get(step, 0.0) + time.perf_counter() - t0


def _roll_back(api: CudaCheckpointAPI, pids: Sequence[int]) -> list[str]:
    """Bring pids back to running, whatever step they reached. Returns the problems (empty = all running)."""
    problems: list[str] = []
    for pid in reversed(list(pids)):
        try:
            st = api.state(pid)
            if st == "checkpointed":
                api.restore(pid)
                st = api.state(pid)
            if st == "locked":
                api.unlock(pid)
                st = api.state(pid)
            if st != "running":
                problems.append(f"pid {pid} left {st}")
        except ColdSnapError as e:
            problems.append(f"pid {pid}: {e.message}")
    return problems


def checkpoint_tree(
    root_pid: int,
    lock_timeout_ms: int = 30000,
    *,
    api: CudaCheckpointAPI | None = None,
    pids: Sequence[int] | None = None,
) -> TreeReport:
    """Lock every CUDA process of the tree, then checkpoint each (GPU memory moves into host memory).

    pids: the CUDA processes if already discovered (else cuda_pids(root_pid)). On any failure the processes already
    locked or checkpointed are restored and unlocked, so the workload keeps running, and ColdSnapError is raised."""
    api = api or CudaCheckpointAPI()
    report = TreeReport("checkpoint")
    t0 = time.perf_counter()
    found = list(pids) if pids is not None else cuda_pids(root_pid, api)
    report.seconds["discover"] = time.perf_counter() - t0
    if not found:
        report.message = NO_CUDA
        return report
    report.pids = found
    try:
        _each(report, "lock", found, lambda pid: api.lock(pid, lock_timeout_ms))
        _each(report, "checkpoint", found, api.checkpoint)
    except ColdSnapError as e:
        problems = _roll_back(api, found)  # every pid a step was attempted on
        after = (
            f"rollback left problems: {'; '.join(problems)}"
            if problems
            else f"rolled back: {len(found)} process(es) running again"
        )
        raise ColdSnapError(e.code, f"{e.message} ({after})") from e
    report.message = f"checkpointed {len(found)} CUDA process(es)"
    return report


def restore_tree(
    pids: Sequence[int],
    gpu_pairs: Sequence[tuple[str | bytes, str | bytes]] | None = None,
    *,
    api: CudaCheckpointAPI | None = None,
) -> TreeReport:
    """Restore every checkpointed process (GPU memory back on the GPU), then unlock them all.

    Processes already restored (locked) are only unlocked, running ones are left alone, so a retry after a partial
    failure is safe. Raises ColdSnapError naming the first pid that fails."""
    report = TreeReport("restore", pids=list(pids))
    if not pids:
        report.message = NO_CUDA
        return report
    api = api or CudaCheckpointAPI()
    states = {pid: api.state(pid) for pid in pids}
    failed = [pid for pid in pids if states[pid] == "failed"]
    if failed:
        raise ColdSnapError(ErrorCode.GPU_FAILED, f"pid {failed[0]}: CUDA process state is 'failed'; cannot restore it")
    _each(report, "restore", [p for p in pids if states[p] == "checkpointed"], lambda pid: api.restore(pid, gpu_pairs))
    _each(report, "unlock", [p for p in pids if states[p] in ("checkpointed", "locked")], api.unlock)
    report.message = f"restored {len(pids)} CUDA process(es)"
    return report


def checkpointed_pids(root_pid: int, *, api: CudaCheckpointAPI | None = None,
                      children: ChildrenReader = read_children) -> list[int]:
    """After `criu restore` the CUDA processes have new host PIDs: find those whose CUDA state is checkpointed."""
    api = api or CudaCheckpointAPI()
    found = []
    for pid in process_tree(root_pid, children):
        with suppress(ColdSnapError):  # not a CUDA client
            if api.state(pid) == "checkpointed":
                found.append(pid)
    return found
