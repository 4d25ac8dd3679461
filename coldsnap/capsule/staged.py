"""The staging area: capsules unpacked for restore, one directory per capsule digest under COLDSNAP_STAGED
(default $COLDSNAP_HOME/staged: a restore's images are GBs, and /run is often RAM). Bounded: after each staging,
and at gc, the least recently used directories go until the area fits its cap (COLDSNAP_STAGED_MAX_GIB, default a
quarter of its file system); a capsule removed from the index (`coldsnap rm`, then gc) loses its directory too.
A directory an operation in flight uses (its journal names the capsule) is never removed."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from coldsnap.base import journal
from coldsnap.base.locks import locked
from coldsnap.base.paths import settings

COMPLETE = ".complete"


@dataclass
class StagedDirectory:
    digest: str
    path: Path
    bytes: int
    last_used: float  # when a restore last used it (the .complete marker's mtime)


def root() -> Path:
    return settings().staged


def path_of(digest: str) -> Path:
    return root() / digest.split(":", 1)[1]


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512  # sparse images: what they hold
    return total


def entries() -> list[StagedDirectory]:
    out = []
    for path in sorted(root().iterdir()) if root().is_dir() else []:
        marker = path / COMPLETE
        if path.is_dir() and marker.exists() and len(path.name) == 64:
            out.append(StagedDirectory("sha256:" + path.name, path, _size(path), marker.stat().st_mtime))
    return out


def restoring(digest: str):
    """One restore of this capsule at a time in the block (putting its files back for CRIU, CRIU reading them)."""
    return locked(root() / f".{digest.split(':', 1)[1]}.restore.lock")


def used(digest: str) -> None:
    """A restore uses it: it is the most recently used now."""
    with contextlib.suppress(FileNotFoundError):
        os.utime(path_of(digest) / COMPLETE)


def in_flight() -> set[str]:
    """Capsules an operation that still runs is staging or restoring."""
    return {j.about["capsule"] for j in journal.entries()
            if j.owner_alive() and isinstance(j.about.get("capsule"), str)}


def cap_bytes() -> int:
    configured = settings().staged_max_gib
    if configured:
        return int(float(configured) * 2**30)
    probe = root() if root().exists() else root().parent
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_blocks * st.f_frsize // 4


def remove(digest: str) -> int:
    """Remove one capsule's directory (never one in use); the bytes freed."""
    if digest in in_flight():
        return 0
    path = path_of(digest)
    freed = _size(path) if path.exists() else 0
    shutil.rmtree(path, ignore_errors=True)
    return freed


def evict(cap: int | None = None, keep: frozenset[str] = frozenset()) -> list[str]:
    """Least recently used first, until the area fits cap; keep and capsules in use stay. The digests removed."""
    cap = cap_bytes() if cap is None else cap
    staged = sorted(entries(), key=lambda e: e.last_used)
    total = sum(e.bytes for e in staged)
    spare = keep | in_flight()
    gone = []
    for e in staged:
        if total <= cap:
            break
        if e.digest in spare:
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        total -= e.bytes
        gone.append(e.digest)
    return gone
