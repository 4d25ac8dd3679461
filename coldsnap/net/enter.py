"""Run a function inside a container's network namespace.

A container's server usually listens on an address only its own network namespace can reach (a pre-made netns,
a CNI bridge, `--network none`). The most robust way to talk to it, whatever the engine (podman, docker,
containerd, plain runc) set up, is from inside: a forked child setns()es into /proc/<pid>/ns/net and connects to
127.0.0.1. The parent keeps its own namespace; the child's result (or ColdSnapError) comes back through a pipe.
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import time
from typing import Any, Callable

from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.net.setns import setns


def call_in_netns(pid: int, fn: Callable[..., Any], *args: Any, timeout: float = 900.0) -> Any:
    """fn(*args) in the network namespace of pid; its return value must pickle. Raises what fn raised as a
    ColdSnapError (other exceptions become INTERNAL with their text)."""
    path = f"/proc/{pid}/ns/net"
    if not os.path.exists(path):
        raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, f"the container's process {pid} is gone (no {path})")
    r, w = os.pipe()
    # The child must never finalize the parent's objects (e.g. a zstd compressor whose worker threads do not exist
    # in the child: it then waits for them forever). Cyclic GC is off across the fork, and the parent's objects are
    # frozen out of the collector's reach before it: another thread's subprocess call can turn GC back on between
    # our disable and the fork (it restores what it saw when it began). The child lives for one call and leaves by
    # os._exit.
    gc_was_on = gc.isenabled()
    gc.disable()
    gc.freeze()
    child = -1
    try:
        child = os.fork()
    finally:
        if child != 0:  # the parent (or a failed fork) collects again
            gc.unfreeze()
            if gc_was_on:
                gc.enable()
    if child == 0:  # pragma: no cover - runs in the child
        gc.disable()
        os.close(r)
        payload: tuple[Any, ...]  # ("ok", result) or ("err", code, message)
        try:
            setns(path)
            payload = ("ok", fn(*args))
        except ColdSnapError as e:
            payload = ("err", e.code.value, e.message)
        except BaseException as e:  # noqa: BLE001 - everything must reach the parent
            payload = ("err", ErrorCode.INTERNAL.value, f"{type(e).__name__}: {e}")
        try:
            data = pickle.dumps(payload)
        except Exception as e:  # noqa: BLE001
            data = pickle.dumps(("err", ErrorCode.INTERNAL.value, f"result does not pickle: {e}"))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        with os.fdopen(r, "rb") as f:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([f], [], [], left)[0]:
                    os.kill(child, signal.SIGKILL)
                    raise ColdSnapError(ErrorCode.VALIDATION_TIMEOUT,
                                        f"no answer from inside the network namespace of pid {pid} in {timeout:.0f} s")
                chunk = os.read(f.fileno(), 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        _, status = os.waitpid(child, 0)
    if not chunks:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
        raise ColdSnapError(ErrorCode.INTERNAL, f"the helper in the network namespace of pid {pid} died ({how})")
    payload = pickle.loads(b"".join(chunks))
    if payload[0] == "ok":
        return payload[1]
    raise ColdSnapError(ErrorCode(payload[1]), payload[2])
