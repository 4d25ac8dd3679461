"""File helpers: atomic replacement (the one way ColdSnap writes a file that someone else may read at any moment),
full positional reads, the host's submounts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

KEEP_MODE = -1


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o600, default_mode: int = 0o644) -> None:
    """Write to a temp file beside `path`, fsync, set `mode` (KEEP_MODE: the existing file's, else default_mode),
    rename over `path`, fsync the directory. Readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == KEEP_MODE:
        mode = path.stat().st_mode & 0o7777 if path.exists() else default_mode
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
