"""Atomic file replacement: the one way ColdSnap writes a file that someone else may read at any moment."""

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
