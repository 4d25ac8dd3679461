"""A weights blob fetched piece by piece: several Range requests at once, each piece checked against its pin.

An OCI digest is the sha256 of the whole blob: one stream, about 1 GB/s, whatever the link and the disk can do. A
capsule pins a large weights file piece by piece too (WeightFile.chunks, in its digest-verified profile: the same
pins a restore checks on every core), so a pull of such a blob fetches its pieces on several connections at once,
hashes each against its pin as it arrives and writes it in place, and never computes the whole-blob digest. A blob
kept that way is recorded in the digest memo with its pieces only (coldsnap.base.digests.remember_pieces), and the
store treats it as verified only for capsules that pin those pieces (registry._present_for).

Bytes a broken pull left in the partial file are kept piece by piece where they match their pins."""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import requests

from coldsnap.base.digests import chunk_sha256
from coldsnap.base.files import WriteBehind
from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode, WeightFile

READ = 1 << 20
ATTEMPTS = 3  # a piece whose connection breaks is fetched again, this many times in all
BROKEN = (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError, requests.exceptions.Timeout)


class NoRanges(Exception):
    """The registry does not answer Range requests as asked: fetch the blob as one stream instead."""


def wanted() -> bool:
    """By pieces unless COLDSNAP_PULL_PIECES=0 (one stream per blob, hashed whole: for comparison)."""
    return settings().pull_pieces


def workers() -> int:
    """Connections at once: receiving, hashing and writing all release the GIL, so one per core, at least two."""
    return max(2, min(8, os.cpu_count() or 1))


def covers(wf: WeightFile, size: int) -> bool:
    """Whether wf's pins cover exactly `size` bytes (a pull trusts them only then)."""
    n, cb = len(wf.chunks), wf.chunk_bytes or 0
    return n > 0 and cb > 0 and (n - 1) * cb < size <= n * cb


def _fetch_piece(client, url: str, fd: int, offset: int, length: int, pin: str, what: str,
                 counted: Callable[[int], None]) -> bool:
    """One piece into the file at its offset; whether its bytes match the pin."""
    last = offset + length - 1
    r = client.request("GET", url, ok=(200, 206), what=what, headers={"Range": f"bytes={offset}-{last}"},
                       stream=True, not_found=ErrorCode.CAPSULE_NOT_FOUND)
    with r:
        if r.status_code != 206 or not r.headers.get("Content-Range", "").startswith(f"bytes {offset}-{last}/"):
            raise NoRanges()
        h, behind, at = hashlib.sha256(), WriteBehind(fd, offset), offset
        for chunk in r.iter_content(READ):
            if at + len(chunk) > offset + length:
                return False  # more than asked for: not this piece
            h.update(chunk)
            os.pwrite(fd, chunk, at)
            behind.wrote(len(chunk))
            at += len(chunk)
            counted(len(chunk))
    return at == offset + length and h.hexdigest() == pin


def fetch_by_pieces(new_client: Callable[[], object], url: str, part: Path, size: int, wf: WeightFile,
                    what: str, progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """Bring `part` to the blob of `size` bytes that wf pins, piece by piece. Returns (bytes received, bytes kept
    from an earlier partial). Raises NoRanges (the caller fetches it as one stream) or CAPSULE_CORRUPT (a piece does
    not match its pin: the partial is removed)."""
    cb = wf.chunk_bytes
    if cb is None:  # callers check covers() first
        raise ValueError(f"{what}: the weights are not pinned by pieces")
    pieces = [(i, i * cb, min(cb, size - i * cb)) for i in range(len(wf.chunks))]
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        had = os.fstat(fd).st_size
        there = [p for p in pieces if p[1] + p[2] <= had]
        with ThreadPoolExecutor(workers()) as pool:
            ok = pool.map(lambda p: chunk_sha256(fd, p[1], p[2]) == wf.chunks[p[0]], there)
            kept = {p[0] for p, good in zip(there, ok) if good}
        os.ftruncate(fd, size)
        todo = [p for p in pieces if p[0] not in kept]
        lock, local = threading.Lock(), threading.local()
        done = [sum(p[2] for p in pieces if p[0] in kept), 0]  # bytes in place, bytes received

        def counted(n: int) -> None:
            with lock:
                done[0] += n
                done[1] += n
                if progress:
                    progress(done[0], size)

        def fetch(piece: tuple[int, int, int]) -> bool:
            if not hasattr(local, "client"):  # a connection (and its auth) of its own per thread
                local.client = new_client()
            i, offset, length = piece
            for attempt in range(ATTEMPTS):
                try:
                    return _fetch_piece(local.client, url, fd, offset, length, wf.chunks[i], what, counted)
                except BROKEN:
                    if attempt == ATTEMPTS - 1:
                        raise ColdSnapError(ErrorCode.REGISTRY, f"{what}: the connection broke {ATTEMPTS} times "
                                            f"on the piece at byte {offset}; the pieces already here are kept and "
                                            "the next pull resumes them") from None
            return False

        with ThreadPoolExecutor(workers()) as pool:
            results = list(pool.map(fetch, todo))
        if not all(results):
            bad = next(p[1] for p, good in zip(todo, results) if not good)
            part.unlink(missing_ok=True)
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"{what}: the piece at byte {bad} does not match the "
                                "pin of the capsule's weights: refused, nothing kept")
        os.fsync(fd)
        return done[1], sum(p[2] for p in pieces if p[0] in kept)
    finally:
        os.close(fd)
