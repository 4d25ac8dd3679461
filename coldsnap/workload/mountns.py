"""The first program of a workload: run as PID 1 of its new PID and mount namespaces (`unshare --pid --fork --mount
--mount-proc --propagation private`), it detaches the mounts that belong to other workloads, opens its standard
streams again from inside (a file opened outside is on a mount of the host's namespace, which CRIU cannot name),
becomes a session leader and execs the workload.

Why a mount namespace: a private /proc that matches the PID namespace (the NVIDIA driver fails with CUDA error 304
in a PID namespace that sees the host's /proc), so GPU and CPU workloads alike get PIDs of their own and a restore
never depends on which PIDs the host uses. The namespace is a private copy of the host's mounts; CRIU treats every
mount the host also has as external and binds it back from the host at restore (CriuOptions.host_mounts).

Why detach: the copy would otherwise hold other workloads' network namespaces (their nsfs mounts) alive after
`ip netns del`, and container runtimes' overlay and shm mounts, which are gone by the time a capsule restores.
Detaching happens in the copy only (propagation private): the host keeps its mounts.

Usage: python -m coldsnap.workload.mountns LOG ARGV...   (stdout and stderr append to LOG, stdin is /dev/null)
"""

from __future__ import annotations

import ctypes
import os
import sys

# Mount points under these belong to other workloads (network namespaces, container runtimes, kubelet volumes).
TRANSIENT_ROOTS = ("/run/netns", "/var/run/netns", "/run/docker", "/var/run/docker", "/var/lib/docker",
                   "/run/containers", "/var/lib/containers", "/run/containerd", "/var/lib/containerd",
                   "/var/lib/kubelet", "/run/user")
MNT_DETACH = 2


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def transient_mounts(mountinfo: str) -> list[str]:
    """Mount points to detach, deepest first: nsfs mounts anywhere, and every mount under TRANSIENT_ROOTS."""
    out = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        point, fstype = _unescape(fields[4]), fields[fields.index("-") + 1]
        if fstype == "nsfs" or any(point == r or point.startswith(r + "/") for r in TRANSIENT_ROOTS):
            out.append(point)
    return sorted(set(out), key=lambda p: (-p.count("/"), p))


def detach(points: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for point in points:
        libc.umount2(point.encode(), MNT_DETACH)  # gone already (under a detached parent) is fine


def reopen_streams(log: str) -> None:
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, log, os.O_WRONLY | os.O_APPEND | os.O_CREAT),
                            (2, log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)):
        new = os.open(path, flags, 0o600)
        os.dup2(new, fd)
        os.close(new)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m coldsnap.workload.mountns LOG ARGV...")
    log, argv = argv[0], argv[1:]
    with open("/proc/self/mountinfo") as f:
        detach(transient_mounts(f.read()))
    reopen_streams(log)
    os.setsid()
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.exit(f"coldsnap: cannot run {argv[0]}: {e.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
