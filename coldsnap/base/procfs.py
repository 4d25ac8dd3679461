"""The process facts ColdSnap reads from /proc: children, whole trees, liveness.

A process can vanish between opening one of its /proc files and reading it (ESRCH), so every reader here treats
any OSError as "gone"."""

from __future__ import annotations

import functools
import os
from contextlib import suppress


@functools.cache
def boot_id() -> str:
    """This boot's id (the kernel's random boot_id): what a page-cache-only write can be trusted within."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def read_children(pid: int) -> list[int]:
    """Direct children of pid: the union of /proc/<pid>/task/<tid>/children (a child belongs to the thread that
    forked it). A process that vanished has none."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        with suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
            out.extend(int(c) for c in f.read().split())
    return out


def process_tree(root_pid: int, children=read_children) -> list[int]:
    """root_pid and all its descendants, parents before children (breadth-first), each once."""
    seen: set[int] = set()
    order: list[int] = []
    todo = [int(root_pid)]
    while todo:
        pid = todo.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        order.append(pid)
        todo.extend(c for c in children(pid) if c not in seen)
    return order


def descendants(pid: int) -> list[int]:
    """Every descendant of pid, parents before children."""
    return process_tree(pid)[1:]


def alive(pid: int) -> bool:
    """Whether pid runs: it exists and is neither a zombie nor dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def session_of(pid: int) -> int | None:
    """pid's session ID as this PID namespace sees it (0 if its session leader is outside it), None if it is gone."""
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


def in_network_namespace(inode: int) -> list[int]:
    """Every process whose network namespace is the one with this inode (what a workload left behind, whatever
    its tree looks like now: reparented, its root gone)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    out.append(int(entry))
    return out
