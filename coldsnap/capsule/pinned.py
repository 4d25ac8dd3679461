"""Weight files referenced by digest, checked before a restore relies on them (a multi-GiB file is hashed once, and
again only when it changes: coldsnap.base.digests)."""

from __future__ import annotations

import os

from coldsnap.base.digests import checked_chunks, file_sha256
from coldsnap.contracts import ColdSnapError, ErrorCode, WeightFile


def mismatch(path: str | os.PathLike, wf: WeightFile) -> str | None:
    """Why the file at `path` is not the bytes `wf` pins, or None when it is. Chunk pins are checked on every core
    at once (coldsnap.base.digests): they were hashed in the same read as the whole-file digest, so matching pieces
    are the pinned file."""
    if wf.chunks and wf.chunk_bytes:
        if not checked_chunks(path, wf.chunks, wf.chunk_bytes, wf.chunk_digest):
            return f"differs from the one the capsule pins (sha256 {wf.sha256[:12]}…): a piece does not match"
        return None
    actual = file_sha256(path)
    return None if actual == wf.sha256 else f"has sha256 {actual[:12]}…, the capsule pins {wf.sha256[:12]}…"


def verify_weights(files: list[WeightFile]) -> None:
    """Every pinned weight file must be present with its digest before a restore may rely on it."""
    for wf in files:
        if not os.path.exists(wf.path):
            raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"weight file {wf.path} is missing on this host")
        if why := mismatch(wf.path, wf):
            raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"weight file {wf.path} {why}")
