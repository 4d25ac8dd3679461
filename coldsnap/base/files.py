"""File helpers, stdlib only: atomic replacement (the one way ColdSnap writes a file that someone else may read at
any moment), private directories, full positional reads, the host's submounts."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

KEEP_MODE = -1


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike, mode: int = 0o600, default_mode: int = 0o644,
                sync: bool = True) -> Iterator[BinaryIO]:
    """A file object whose bytes replace `path` only when the block ends without an exception: written to a temp
    file beside it (created with `mode` at once, so secrets are never readable by others), fsynced, renamed over
    `path`, the directory fsynced. Readers see the old file or the new one, never a part; a failure leaves no temp
    file. KEEP_MODE: the existing file's mode, else default_mode. sync=False skips the fsyncs, for files of
    gigabytes whose digest is checked before anyone relies on them (a crash may lose them, never corrupt a use)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == KEEP_MODE:
        mode = path.stat().st_mode & 0o7777 if path.exists() else default_mode
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o777)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)  # the umask may have narrowed it; and special bits need chmod
        os.replace(tmp, path)
        if sync:
            fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o600, default_mode: int = 0o644) -> None:
    """The one way ColdSnap writes a whole file that someone else may read at any moment (see atomic_file)."""
    with atomic_file(path, mode, default_mode) as f:
        f.write(data)


def private_dir(path: Path) -> Path:
    """Create a 0700 directory: capsules and run state hold process memory, i.e. secrets."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def submounts(top: str | os.PathLike) -> list[str]:
    """Mount points strictly below top on this host (e.g. a driver directory mounted at /usr/local/nvidia), shortest
    first. A container bind of top must bind them one by one: runc declares the spec's bind mounts external to CRIU,
    and a submount brought along by a recursive bind is not one of them (CRIU fails on a file system it can't dump)."""
    prefix = os.path.normpath(os.fspath(top)).rstrip("/") + "/"
    points = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")  # mountinfo escapes space as \040
            if point.startswith(prefix):
                points.add(point)
    return sorted(points, key=lambda p: (p.count("/"), p))


def pread_full(fd: int, view: memoryview, offset: int) -> None:
    """Fill view from the file at offset (a short read is continued; the file ending first is an error)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"the file ended {len(view) - done} bytes early")
        done += n
