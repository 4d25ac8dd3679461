"""Bring `lo` up in a process's network namespace, with the standard library only: runc's createRuntime hook
(coldsnap.hooks.createruntime) runs it inside `runc restore`, whose clock a heavier import (pyroute2, pydantic)
would lengthen for every container restore."""

from __future__ import annotations

import fcntl
import socket
import struct

from coldsnap.net.setns import setns

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
IFREQ = "16sH22x"  # struct ifreq on Linux: the name, then ifr_flags at the start of a 24-byte union


def loopback_up_in(pid: int) -> bool:
    """Enter pid's network namespace (this whole process: call it from a process of its own, e.g. a hook) and bring
    `lo` up there; whether it was down. Raises OSError (the errno and what failed)."""
    setns(f"/proc/{pid}/ns/net", f"setns into the network namespace of pid {pid}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # made after setns: it belongs to that namespace
        flags = struct.unpack(IFREQ, fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0)))[1]
        if flags & IFF_UP:
            return False
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))
        return True
