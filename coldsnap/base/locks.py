"""The one flock helper: a lock file held for the length of a block (stdlib only: the shim's paths use it too).

Held locks die with their holder (the kernel drops a flock when its fd closes), so a SIGKILLed holder never blocks
the next one."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def locked(path: str | os.PathLike, shared: bool = False) -> Iterator[None]:
    """Hold `path` (created 0600, its directory 0700) exclusively, or shared, until the block ends."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
