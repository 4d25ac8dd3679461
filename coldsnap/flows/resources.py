"""Resource errors are environment errors: a full disk, a quota or the file-descriptor limit ends an operation with
exit 12 and one line naming the path and the room it needed, not as an internal error."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from coldsnap.contracts import ColdSnapError, ErrorCode

RESOURCE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
                   errno.EMFILE: "too many open files", errno.ENFILE: "too many open files on this host"}


def _bytes_in(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _free(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            continue
    return None


def out_of_room(e: OSError, where: Path, source: Path | None = None) -> Exception:
    """The ColdSnapError(ENVIRONMENT) for a resource error while writing under `where` (`source`: what was being
    written, for the room it needs); any other OSError is returned as it is, for the caller to raise."""
    what = RESOURCE_ERRNOS.get(e.errno) if e.errno is not None else None  # OSError("...") has no errno
    if what is None:
        return e
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return ColdSnapError(ErrorCode.ENVIRONMENT, f"{what} writing under {where} (raise the open-files limit)")
    if getattr(e, "filename2", None) and e.filename and Path(e.filename).is_file():
        source = Path(e.filename)  # a copy: its source is what needed the room
    need = f"about {_bytes_in(source) / 2**20:.0f} MiB needed, " if source is not None else ""
    free = _free(where)
    room = f"{free / 2**20:.0f} MiB free" if free is not None else "free space unknown"
    return ColdSnapError(ErrorCode.ENVIRONMENT, f"{what} on the file system of {where}: {need}{room}")
