"""SHA-256 of files, and of files already checked: the one place ColdSnap hashes what it verifies.

Hashing a capsule's layers (hundreds of MB) or a weights file (GBs) takes from a tenth of a second to many seconds,
and a restore checks them every time. `checked_sha256` remembers a digest together with the file's version: device,
inode, size, mtime and ctime. Any write to the file moves its ctime, and no system call sets a ctime back, so a file
changed after its check is hashed again before use. A file changed within a second before its check is not
remembered: timestamps advance by clock ticks, so a second change in the same tick could leave the same ctime (git's
"racily clean" index entries, the same answer). (Not caught: a write to the disk underneath the file system. The
store is as safe as the disk that holds it.) The memo lives in $COLDSNAP_HOME/digests.json, mode 0600.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from coldsnap.base.files import atomic_write
from coldsnap.base.paths import settings

CHUNK = 8 << 20
SETTLED_NS = 1_000_000_000  # a file changed less than this before its check is hashed again next time


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """("sha256:HEX", size) of the file's bytes, read now."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


def _version(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _memo_path() -> Path:
    return settings().home / "digests.json"


def _read_memo() -> dict:
    try:
        memo = json.loads(_memo_path().read_text())
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def checked_sha256(path: str | os.PathLike) -> tuple[str, int]:
    """sha256_file, hashing only when the file is new to the memo or changed since it was last hashed."""
    key = os.path.abspath(os.fspath(path))
    before = os.stat(key)
    entry = _read_memo().get(key)
    if isinstance(entry, dict) and entry.get("version") == _version(before):
        return entry["sha256"], before.st_size
    started_ns = time.time_ns()
    digest, size = sha256_file(key)
    if _version(os.stat(key)) != _version(before) or started_ns - before.st_ctime_ns < SETTLED_NS:
        return digest, size  # changed while we read, or too recently to tell a later change by its ctime
    memo = {p: e for p, e in _read_memo().items() if os.path.exists(p)}  # forget files that are gone
    memo[key] = {"version": _version(before), "sha256": digest}
    try:
        atomic_write(_memo_path(), json.dumps(memo).encode())
    except OSError:
        pass  # no memo: the next check hashes again
    return digest, size


def file_sha256(path: str | os.PathLike) -> str:
    """The file's sha256 as 64 hex digits (how weight files are pinned), hashed only when it changed since its last
    check."""
    return checked_sha256(path)[0].removeprefix("sha256:")
