"""Per-blob locks of the capsule store: a pull holds the lock of every blob it fetches or relies on, gc leaves locked
blobs alone. Kept apart from the registry client so that what only needs the locks (gc, a capture's cleanup)
does not load it."""

from __future__ import annotations

import contextlib
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from coldsnap.capsule.store import CapsuleStore


def lock_path(store: CapsuleStore, digest: str) -> Path:
    return store.root / "tmp" / f"{digest.split(':', 1)[1]}.lock"


def partial_path(store: CapsuleStore, digest: str) -> Path:
    return store.root / "tmp" / f"{digest.split(':', 1)[1]}.partial"


def acquire_blob_lock(path: Path, blocking: bool = True) -> int | None:
    """flock on a lock file that is unlinked by its holder: re-check that the locked inode is still the path's."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.stat(path), os.fstat(fd)):
                return fd
        os.close(fd)


def release_blob_lock(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)  # while still holding it: waiters re-check the inode
    os.close(fd)


@contextmanager
def blob_locks(store: CapsuleStore, digests: list[str]) -> Iterator[None]:
    held: list[tuple[Path, int]] = []
    try:
        for d in sorted(set(digests)):  # one global order: no deadlock between pulls sharing blobs
            p = lock_path(store, d)
            fd = acquire_blob_lock(p)
            assert fd is not None  # a blocking acquire waits, it never gives up
            held.append((p, fd))
        yield
    finally:
        for p, fd in reversed(held):
            release_blob_lock(p, fd)
