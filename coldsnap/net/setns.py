"""Entering a network namespace, with the standard library only (runc's createRuntime hook uses it inside every
container restore; coldsnap.net.enter and coldsnap.net.netns build on it)."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000
libc = ctypes.CDLL(None, use_errno=True)


def check_rc(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(path: str, what: str = "") -> None:
    """The calling thread enters the network namespace at path."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        check_rc(libc.setns(fd, CLONE_NEWNET), what or f"setns({path})")
    finally:
        os.close(fd)
