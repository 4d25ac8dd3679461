"""Tensor parallelism for the reference engine: one process per rank, rank 0 serves HTTP and drives the others.

The command the user starts becomes a small launcher (no torch): it starts every rank as its own child, so the
workload is one process tree (one CRIU dump, one CUDA tree checkpoint) in which the ranks are siblings. Siblings
matter for restore time: CRIU restores a parent's memory before it forks the children (they may share pages
copy-on-write), so ranks under rank 0 would be restored one after the other; under a launcher they are restored
side by side. The launcher dies with any rank, taking the others along (a rank alone would wait in its next
collective forever).

Rank 0 tells the other ranks what to do over a pipe each, one JSON line per command (run a step, release, resume),
and every rank runs the same collectives in the same order. Commands travel over pipes, not over the process group,
on purpose: an idle rank waits in a read() on the host, never in a pending collective on the GPU, so the CUDA
checkpoint lock (which waits for outstanding GPU work) finds every rank idle.

What makes a tensor-parallel tree safe to capture (found on the 2×H200 machine, see knowledge/platform.md): NCCL
without CUDA IPC, cuMem or shared-memory transports (the driver cannot restore those buffers: error 801), ranks
talking over TCP on the loopback of the workload's own network namespace (CRIU restores established connections,
and a fresh namespace has no TIME_WAIT leftovers on the ports), and no io_uring (torch's TCPStore uses libuv,
which opens one CRIU cannot dump): a seccomp filter installed in the launcher before the ranks start.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

# The environment under which a torch.distributed tree can be CUDA-checkpointed and CRIU-dumped. Recorded in the
# capsule's profile; set (unless already set) by rank 0 before the ranks start.
CAPTURE_SAFE_ENV = {
    "NCCL_P2P_DISABLE": "1",  # no CUDA IPC peer buffers
    "NCCL_SHM_DISABLE": "1",  # no /dev/shm transport between ranks
    "NCCL_CUMEM_ENABLE": "0",  # ordinary device allocations, not cuMem handles shared between processes
    "NCCL_NVLS_ENABLE": "0",  # no NVLink multicast objects
    "NCCL_SOCKET_IFNAME": "lo",  # rank traffic on the namespace's loopback
    "GLOO_SOCKET_IFNAME": "lo",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # no watchdog tearing the group down while the tree is frozen
}

PR_SET_PDEATHSIG = 1


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """cuda → cuda:rank, cuda:K → cuda:K+rank; cpu stays cpu."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def make_capture_safe() -> dict[str, str]:
    """In the launcher, before anything starts a rank or a TCPStore: the settings above, and io_uring switched off
    for this process and every child. Returns the settings in force."""
    from coldsnap.engines import seccomp

    for k, v in CAPTURE_SAFE_ENV.items():
        os.environ.setdefault(k, v)
    seccomp.install()
    return settings_in_force()


def settings_in_force() -> dict[str, str]:
    """The capture-relevant settings this rank runs under (inherited from the launcher): what the profile records:
    the capture-safe ones and every other NCCL_* setting."""
    names = set(CAPTURE_SAFE_ENV) | {k for k in os.environ if k.startswith("NCCL_")}
    return {k: os.environ[k] for k in sorted(names) if k in os.environ}


def parse_nccl_env(spec: str | None) -> dict[str, str]:
    """--nccl-env "NCCL_X=V,NCCL_Y=W" → {"NCCL_X": "V", ...}; only NCCL_* names, and none of the capture-safe ones
    (changing those is what makes a capture unsafe)."""
    out: dict[str, str] = {}
    for item in filter(None, (spec or "").split(",")):
        key, sep, value = item.strip().partition("=")
        if not sep or not key.startswith("NCCL_") or not value:
            raise ValueError(f"--nccl-env wants NCCL_NAME=VALUE items, got {item!r}")
        if key in CAPTURE_SAFE_ENV:
            raise ValueError(f"--nccl-env may not change {key}: it is one of the capture-safe settings")
        out[key] = value
    return out


def init_group(rank: int, world: int, device: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **kwargs)


def launch(argv: list[str], world: int) -> int:
    """The launcher: start ranks 0..world-1 with the command pipes between rank 0 and the others, wait; when one
    rank exits, stop the rest and exit with its status."""
    base = [sys.executable, "-m", "coldsnap_reference.server", *argv]
    procs: list[subprocess.Popen] = []
    to_rank0: list[str] = []
    close_here: list[int] = []
    for rank in range(1, world):
        cmd_r, cmd_w = os.pipe()
        rep_r, rep_w = os.pipe()
        procs.append(subprocess.Popen([*base, "--tp-rank", str(rank), "--tp-fds", f"{cmd_r},{rep_w}"],
                                      pass_fds=(cmd_r, rep_w), stdin=subprocess.DEVNULL))
        to_rank0.append(f"{cmd_w},{rep_r}")
        close_here += [cmd_r, cmd_w, rep_r, rep_w]
    fds = tuple(int(x) for pair in to_rank0 for x in pair.split(","))
    procs.insert(0, subprocess.Popen([*base, "--tp-rank", "0", "--tp-fds", ";".join(to_rank0)], pass_fds=fds,
                                     stdin=subprocess.DEVNULL))
    for fd in close_here:  # only the ranks hold the pipes: a rank gone means EOF for the one reading from it
        os.close(fd)
    signal.signal(signal.SIGTERM, lambda *_: _stop(procs, 143))
    pid, status = os.wait()
    code = os.waitstatus_to_exitcode(status)
    rank = next((r for r, p in enumerate(procs) if p.pid == pid), "?")
    print(json.dumps({"event": "fatal" if code else "exit", "error": f"rank {rank} (pid {pid}) exited with "
                      f"status {code}; stopping the other ranks"}), file=sys.stderr, flush=True)
    _stop(procs, code or 1)
    return code or 1


def _stop(procs: list[subprocess.Popen], code: int):
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
    os._exit(code)


class Peers:
    """Rank 0's handle on ranks 1..N-1: send commands, collect replies. fds: "cmd_w,rep_r;cmd_w,rep_r;..."."""

    def __init__(self, fds: str) -> None:
        self.cmds = []
        self.replies_in = []
        for pair in fds.split(";"):
            w, r = (int(x) for x in pair.split(","))
            self.cmds.append(os.fdopen(w, "wb"))
            self.replies_in.append(os.fdopen(r, "r"))
        self._lock = threading.Lock()

    def send(self, cmd: dict[str, Any]) -> None:
        line = (json.dumps(cmd, separators=(",", ":")) + "\n").encode()
        with self._lock:
            for f in self.cmds:
                f.write(line)
                f.flush()

    def replies(self) -> list[dict[str, Any]]:
        """One reply per rank to the last release/resume (they run in parallel with rank 0's own)."""
        out = []
        for f in self.replies_in:
            line = f.readline()
            if not line:
                raise RuntimeError("a tensor-parallel rank closed its reply pipe")
            reply = json.loads(line)
            if "error" in reply:
                raise RuntimeError(f"tensor-parallel rank: {reply['error']}")
            out.append(reply)
        return out

    def ready(self) -> list[dict[str, Any]]:
        """Wait for every rank's start-up report (sent once its model is built)."""
        return self.replies()


def die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def serve_rank(runner, fds: str, started: dict[str, Any]) -> int:
    """A rank other than 0: report ready, then do what rank 0 says until its pipe closes. fds: "cmd_r,rep_w"."""
    import torch

    cmd_fd, reply_fd = (int(x) for x in fds.split(","))
    commands = os.fdopen(cmd_fd, "rb")
    reply = os.fdopen(reply_fd, "w")

    def answer(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    answer({"ready": True, **started})
    for line in commands:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "step":
                with torch.no_grad():
                    runner.run_step(cmd["ids"], cmd["start"])
            elif op == "release":
                answer(runner.release(weights=bool(cmd.get("weights", True)), stash_code=cmd.get("stash_code")))
            elif op == "resume":
                answer(runner.resume(cmd.get("prefetched")))  # {GPU UUID: socket}: this rank takes its GPU's
            elif op == "exit":
                break
        except Exception as e:  # noqa: BLE001 - report it to rank 0, which fails the request
            if op in ("release", "resume"):
                answer({"error": f"{type(e).__name__}: {e}"})
            else:
                raise
    return 0
