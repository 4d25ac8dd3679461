"""Weight files referenced by digest: hashing with a stat-keyed cache (hash a multi-GiB file once, not per restore)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .config import settings
from .contracts import ColdSnapError, ErrorCode, WeightFile

CHUNK = 8 << 20


def _cache_path() -> Path:
    return settings().home / "weights-digests.json"


def file_sha256(path: str) -> str:
    st = os.stat(path)
    key = f"{path}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    cache_file = _cache_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    cache = {k: v for k, v in cache.items() if not k.startswith(path + ":")}
    cache[key] = digest
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return digest


def verify_weights(files: list[WeightFile]) -> None:
    """Every pinned weight file must be present with its digest before a restore may rely on it."""
    for wf in files:
        if not os.path.exists(wf.path):
            raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"weight file {wf.path} is missing on this host")
        actual = file_sha256(wf.path)
        if actual != wf.sha256:
            raise ColdSnapError(ErrorCode.INCOMPATIBLE,
                                f"weight file {wf.path} has sha256 {actual[:12]}…, the capsule pins {wf.sha256[:12]}…")
