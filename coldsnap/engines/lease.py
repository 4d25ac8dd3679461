"""The engine's lease while it is released for a capture: if the capturer dies before it resumes the engine, the
engine resumes itself, so a failed capture never leaves a server answering 503.

The capturer holds a shared flock on a lease file (the workload's run dir, engine.lease) from before it asks the
engine to release until after it resumed it or the dump took the engine away. The released engine tries an
exclusive lock every half second: the kernel drops the capturer's lock when it dies, so the engine gets the lock
exactly when nobody holds the lease any more, whatever PID namespace either is in. A restore holds the same lease
from before CRIU brings the engine back until it resumed it: the restored engine's watcher is part of its
memory, and waits for the restore, not for a capturer long gone. A missing lease file means "wait": only a held
lease that was let go means "resume yourself"."""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass
from typing import Callable

INTERVAL_S = 0.5


@dataclass
class Lease:
    path: str
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def hold(path) -> Lease:
    """Take (shared) the lease at path, creating the file (0600) and its directory."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return Lease(path, fd)


def let_go(path: str) -> bool:
    """Whether the lease file exists and nobody holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def watch(path: str, still_released: Callable[[], bool], resume: Callable[[], None]) -> threading.Thread:
    """In the engine: call resume() once the lease is let go while the engine is still released."""
    def loop() -> None:
        stop = threading.Event()
        while still_released():
            if let_go(path):
                if still_released():
                    resume()
                return
            stop.wait(INTERVAL_S)

    thread = threading.Thread(target=loop, name="coldsnap-lease", daemon=True)
    thread.start()
    return thread
