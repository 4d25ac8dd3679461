"""Workload processes: start a command as the init of its own PID and mount namespaces inside a network namespace,
kill its whole tree, stop it (tree, network, state file).

Own PID namespace because a restore must not depend on which PIDs the host uses (CRIU restores the whole namespace
with the PIDs the tree had); own mount namespace for the /proc that matches it (the NVIDIA driver needs one: CUDA
fails with error 304 in a PID namespace that sees the host's /proc). One mechanism for CPU and GPU workloads
(coldsnap.workload.mountns).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

from coldsnap import net  # its names load pyroute2 on first use
from coldsnap.base.procfs import descendants, read_children, session_of
from coldsnap.contracts import ColdSnapError, ErrorCode, NetworkPlan
from coldsnap.workload.state import WorkloadState

# The environment a workload starts with: nothing of the caller's (secrets, and restores must not depend on it)
# beyond these names.
PASS_THROUGH_ENV = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "HOME", "TMPDIR", "CUDA_VISIBLE_DEVICES",
                    "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH")


def workload_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASS_THROUGH_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("HOME", "/root")
    env.update(extra)
    return env


def start_in_namespaces(argv: list[str], env: dict[str, str], plan: NetworkPlan, log_path: Path,
                        cwd: str | None = None) -> int:
    """Start argv inside plan's netns as a session leader and PID 1 of new PID and mount namespaces (a private copy
    of the host's mounts with its own /proc). Returns the host PID of the workload's root."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    prefix = ["nsenter", f"--net={net.netns_path(plan.netns)}",
              "unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation", "private",
              sys.executable, "-m", "coldsnap.workload.mountns", str(log_path)]
    try:
        launcher = subprocess.Popen([*prefix, *argv], stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                    env=env, cwd=cwd, close_fds=True)
    finally:
        os.close(log_fd)
    _LAUNCHERS[launcher.pid] = launcher  # reaped in kill_tree (avoids zombies holding PIDs)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        root = next(iter(read_children(launcher.pid)), None)
        # Return only once setsid has run: until then the root is still in our session, and a capture or a
        # signal to its session could reach us.
        if root is not None and session_of(root) == root:
            return root
        if launcher.poll() is not None:
            raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, f"workload exited at once (status {launcher.returncode}); "
                                f"see {log_path}")
        time.sleep(0.005)
    launcher.kill()
    raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, "workload did not become a session leader within 10 s")


_LAUNCHERS: dict[int, subprocess.Popen] = {}


def inner_pid(pid: int) -> int | None:
    """The PID a process has in its own (innermost) PID namespace: what it reports about itself."""
    with suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as f:
        return next((int(line.split()[-1]) for line in f if line.startswith("NSpid:")), None)
    return None


def kill_tree(pid: int, timeout: float = 30.0) -> None:
    """SIGKILL the workload's root and every descendant (for a PID-namespace init the kernel does the rest), wait
    until each is gone and reaped (a zombie still holds its PID and its GPU memory), then remove the host /dev/shm
    files it used and the UNIX socket files it bound (a SIGKILLed engine leaves its queues, semaphores and ZMQ ipc
    sockets behind)."""
    from coldsnap.workload.hostfiles import remove_files, remove_socket_files, tree_shm_files, tree_socket_files

    shm = tree_shm_files(pid)
    sockets = tree_socket_files(pid)
    tree = [pid, *descendants(pid)]
    for p in tree:
        with suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    # Wait until every process of the tree is really gone: a GPU process can take a while to exit (driver teardown),
    # and until then it holds its GPU memory.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in tree:
            with suppress(ChildProcessError):  # someone else's to reap (init reaps an orphan in a second or two)
                os.waitpid(p, os.WNOHANG)  # ours if we started or restored it (rst_sibling): reap it
        if not any(os.path.exists(f"/proc/{p}") for p in tree):
            break
        time.sleep(0.01)
    remove_files(shm)
    remove_socket_files(sockets)
    for launcher_pid, launcher in list(_LAUNCHERS.items()):
        with suppress(subprocess.TimeoutExpired):
            launcher.wait(timeout=max(0.0, deadline - time.monotonic()))
            _LAUNCHERS.pop(launcher_pid, None)


def stop_workload(ws: WorkloadState) -> None:
    kill_tree(ws.pid)
    net.destroy_network(ws.plan)
    if ws.run_dir:
        (Path(ws.run_dir) / "state.json").unlink(missing_ok=True)
