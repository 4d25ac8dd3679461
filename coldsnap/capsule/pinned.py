"""Weight files referenced by digest, checked before a restore relies on them (a multi-GiB file is hashed once, and
again only when it changes: coldsnap.base.digests)."""

from __future__ import annotations

import os

from coldsnap.base.digests import checked_chunks, file_sha256
from coldsnap.contracts import ColdSnapError, ErrorCode, WeightFile


def verify_weights(files: list[WeightFile]) -> None:
    """Every pinned weight file must be present with its digest before a restore may rely on it."""
    for wf in files:
        if not os.path.exists(wf.path):
            raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"weight file {wf.path} is missing on this host")
        if wf.chunks and wf.chunk_bytes:  # every piece on its own core (coldsnap.base.digests)
            if not checked_chunks(wf.path, wf.chunks, wf.chunk_bytes):
                raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"weight file {wf.path} differs from the one the capsule "
                                    f"pins (sha256 {wf.sha256[:12]}…): a piece does not match")
            continue
        actual = file_sha256(wf.path)
        if actual != wf.sha256:
            raise ColdSnapError(ErrorCode.INCOMPATIBLE,
                                f"weight file {wf.path} has sha256 {actual[:12]}…, the capsule pins {wf.sha256[:12]}…")
