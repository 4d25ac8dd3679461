"""A weights blob fetched piece by piece: several Range requests at once, each piece checked against its pin.

An OCI digest is the sha256 of the whole blob: one stream, about 1 GB/s, whatever the link and the disk can do. A
capsule pins a large weights file piece by piece too (WeightFile.chunks, in its digest-verified profile: the same
pins a restore checks on every core), so a pull of such a blob fetches its pieces on several connections at once,
hashes each against its pin as it arrives and writes it in place, and never computes the whole-blob digest. A blob
kept that way is recorded in the digest memo with its pieces only (coldsnap.base.digests.remember_pieces), and the
store treats it as verified only for capsules that pin those pieces (registry._present_for).

Bytes a broken pull left in the partial file are kept piece by piece where they match their pins.

A pull that a restore reads while it streams (Arrivals) lands its pieces in memory first (a Spool), where the
restore's prefetchers read them at the network's pace, and files them into the partial on the node's disk once the
restore is past its first token (or when a reader of the file itself asks): a disk that has enough dirty pages
holds every writer to its own rate, and would set the restore's pace."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from coldsnap.base.digests import chunk_digest
from coldsnap.base.files import WriteBehind
from coldsnap.base.paths import settings
from coldsnap.capsule import fetcher as fetching
from coldsnap.capsule.fetcher import ATTEMPTS, FD_BATCH, NoRanges, broken, fetch_piece
from coldsnap.capsule.growing import Growing
from coldsnap.contracts import ColdSnapError, ErrorCode, WeightFile

COPY = 16 << 20  # bytes per write when a spool's pieces go to disk


def wanted() -> bool:
    """By pieces unless COLDSNAP_PULL_PIECES=0 (one stream per blob, hashed whole: for comparison)."""
    return settings().pull_pieces


def workers() -> int:
    """Connections at once in one process: receiving, hashing and writing release the GIL, but each chunk takes it
    back, so one per core up to 8, at least two; COLDSNAP_PULL_CONNECTIONS sets another number (1–64)."""
    n = settings().pull_connections
    if n.isdigit() and 1 <= int(n) <= 64:
        return int(n)
    return max(2, min(8, os.cpu_count() or 1))


class Arrivals:
    """Where the weights blobs of a pull by pieces stand, for a restore that uses them before they are whole: each
    blob's partial file (its full size from the start: CRIU can restore a process that maps it) and the pieces
    checked against their pins so far. Nothing but checked pieces is ever announced; `end` says the pull is over
    (listed, or failed), and whoever waits stops waiting.

    While a restore reads them, the pull leaves the disk alone: no write-behind, and each blob's final fsync waits
    for `allow_sync` (the restore's first token, or its end). Writing gigabytes back meanwhile made every other
    fsync on that file system (the restore's own, the staging's) wait behind them, on the restore's clock.

    It also tells how far each blob someone follows (`follow`: the capsule's CRIU images) is written."""

    SYNC_WAIT_S = 900.0  # a restore that never says (it cannot: whoever waits for the pull allows it first)

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sync_ok = threading.Event()
        self._file_ok = threading.Event()  # the spooled pieces may go into the partial files now
        self._partial: dict[str, Path] = {}  # blob digest → its partial file, once at full size
        self._spool: dict[str, Spool] = {}  # blob digest → the memory its pieces land in first (those with one)
        self._checked: dict[str, list[tuple[int, int]]] = {}  # blob digest → (offset, length) checked, in order
        self._done: set[str] = set()  # blobs fetched whole (every piece checked)
        self._filed: set[str] = set()  # blobs whose partial file holds every piece
        self.spooled: set[str] = set()  # blobs whose pieces landed in a Spool first
        self.offered: set[str] = set()  # blobs whose pieces past the head were offered to a prefetcher (direct)
        self.took: dict[str, float] = {}  # blob digest → seconds from its partial's sizing to its last piece checked
        self._sized_at: dict[str, float] = {}
        self._growing: dict[str, Growing] = {}  # blobs fetched as one stream that someone follows as they land
        self.direct_chosen: bool | None = None  # choose_direct
        self._heads: set[str] = set()  # blobs whose head is in their partial file (head_filed)
        self._direct: dict[str, dict | None] = {}  # blob digest → its pieces for a prefetcher to fetch (offer_direct)
        self._fetchers: list[Fetcher] = []  # fetching processes started ahead, for the first spooled blob
        self._blob_fetchers: list[Fetcher] = []  # and for the blobs followed (one each)
        self._starting = self._started = False  # start_fetchers was called; it has returned
        self.ended = False
        self._t0 = time.monotonic()
        self.marks: dict[str, float] = {}  # seconds from this object's start to each step of the pull (mark)

    def mark(self, step: str) -> None:
        """The pull reached `step` now (the first time counts): where a streamed pull's time went, for the
        receipt (manifest, own_blobs, provenance, weights_sized, weights_checked)."""
        with self._cond:
            self.marks.setdefault(step, round(time.monotonic() - self._t0, 4))

    def start_fetchers(self, blobs: int = 0) -> None:
        """Start the fetching processes of a streamed pull now, ahead of their work (Fetcher): a restore's pull
        calls this as it starts, before its manifest is in (coldsnap.flows.fetch). Those of a spooled weights blob
        (fetcher_count), and `blobs` more for the blobs someone follows (the CRIU images, one stream each:
        take_blob_fetcher). Only the first call starts any; those no blob takes end with the pull."""
        with self._cond:
            if self._starting or self.ended:
                return
            self._starting = True
        started: list[Fetcher] = []
        try:
            for _ in range(fetcher_count() + blobs):
                started.append(Fetcher())
        except OSError:  # the pull starts them when it needs them, and says so if it cannot
            pass
        finally:
            with self._cond:
                if len(started) == fetcher_count() + blobs and not self.ended:
                    self._blob_fetchers, self._fetchers, started = started[:blobs], started[blobs:], []
                self._started = True
                self._cond.notify_all()
            for f in started:
                f.close()

    def _wait_started(self) -> None:
        """Until the fetching processes being started are (the caller holds the condition)."""
        self._cond.wait_for(lambda: self._started or not self._starting, timeout=30)

    def take_fetchers(self) -> list[Fetcher]:
        with self._cond:
            self._wait_started()
            taken, self._fetchers = self._fetchers, []
            return taken

    def take_blob_fetcher(self, digest: str) -> Fetcher | None:
        """A fetching process for a blob someone follows, if one was started for it (else the pull's own thread
        fetches it)."""
        with self._cond:
            self._wait_started()
            return self._blob_fetchers.pop() if digest in self._growing and self._blob_fetchers else None

    def sized(self, digest: str, path: Path, spool: Spool | None = None) -> None:
        """The blob's partial file has its full size; spool: the memory holding its checked pieces (the partial
        then holds only the file's head until they are filed)."""
        with self._cond:
            self._partial[digest] = path
            self._sized_at[digest] = time.monotonic()
            self.marks.setdefault("weights_sized", round(self._sized_at[digest] - self._t0, 4))
            if spool is not None:
                self._spool[digest] = spool
                self.spooled.add(digest)
            self._cond.notify_all()

    def spool(self, digest: str) -> SpoolFds | None:
        """Descriptors of their own (the caller closes them) of the memfds where the blob's checked pieces are,
        for a prefetcher to read; None: they are in its partial file."""
        with self._cond:
            spool = self._spool.get(digest)
            return None if spool is None else SpoolFds([os.dup(fd) for fd in spool.fds], spool.piece_bytes)

    def unspooled(self, digest: str) -> None:
        """The spool is about to close (filed, or the pull failed): no descriptor of it is handed out any more."""
        with self._cond:
            self._spool.pop(digest, None)

    def mark_filed(self, digest: str) -> None:
        with self._cond:
            self._filed.add(digest)
            self._cond.notify_all()

    def file_now(self) -> None:
        """A reader of the files themselves needs them: the pull files its spooled pieces (or, direct, fetches the
        rest of its pieces) without waiting for the first token."""
        self._file_ok.set()
        with self._cond:
            self._cond.notify_all()

    def offer_direct(self, digest: str, job: dict | None) -> None:
        """The blob's pieces past its head, for a prefetcher to fetch from the registry itself (coldsnap.gpu.direct's
        job), its head in the partial already; None: the pull fetches them all (nothing left, or no ranges)."""
        with self._cond:
            self._direct[digest] = job
            if job is not None:
                self.offered.add(digest)
            self._cond.notify_all()

    def choose_direct(self, fits: bool) -> None:
        """Whether this restore has the one prefetcher to fetch the weights from the registry (the capsule's weights
        are one file for one GPU); without, the pull spools them as it would without COLDSNAP_PULL_DIRECT. Said
        before they move."""
        self.direct_chosen = fits

    def goes_direct(self) -> bool:
        """Whether the weights go to a prefetcher straight from the registry: direct_wanted, and chosen by the
        restore (COLDSNAP_PULL_DIRECT=1: unless it said no)."""
        if not direct_wanted():
            return False
        if self.direct_chosen is None:
            return settings().pull_direct == "1"
        return self.direct_chosen

    def head_filed(self, digest: str) -> None:
        """The blob's head (the pieces its header is in) is in its partial file, checked: an engine may read its
        header there."""
        with self._cond:
            self._heads.add(digest)
            self._cond.notify_all()

    def head_in(self, digest: str, timeout: float) -> bool:
        """Whether the blob's head is in its partial file (head_filed, or every piece filed), waiting up to
        `timeout` for it or the pull's end."""
        with self._cond:
            self._cond.wait_for(lambda: digest in self._heads or digest in self._filed or self.ended, timeout)
            return digest in self._heads or digest in self._filed

    def direct(self, digest: str, timeout: float) -> dict | None:
        """The job the pull offers for the blob (offer_direct), waiting for it up to `timeout`; None when it offers
        none, ends, or was asked for the files first."""
        with self._cond:
            self._cond.wait_for(lambda: digest in self._direct or self.ended or self._file_ok.is_set(), timeout)
            return None if self._file_ok.is_set() else self._direct.get(digest)

    def wait_file_allowed(self) -> None:
        self._file_ok.wait(self.SYNC_WAIT_S)

    def filed(self, digest: str, timeout: float | None = None) -> bool:
        """Whether the blob's partial file holds every piece, asking for it (file_now) and waiting up to
        `timeout` (None: until it does, or the pull ends)."""
        self.file_now()
        with self._cond:
            self._cond.wait_for(lambda: digest in self._filed or self.ended, timeout)
            return digest in self._filed

    def checked(self, digest: str, offset: int, length: int) -> None:
        with self._cond:
            self._checked.setdefault(digest, []).append((offset, length))
            self._cond.notify_all()

    def complete(self, digest: str) -> None:
        with self._cond:
            self._done.add(digest)
            if digest in self._sized_at:
                self.took[digest] = round(time.monotonic() - self._sized_at[digest], 4)
                self.marks["weights_checked"] = round(time.monotonic() - self._t0, 4)  # the last blob's
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self.ended = True
            self._cond.notify_all()
            growing = list(self._growing.values())
        for g in growing:  # those it never fetched, or not whole: whoever follows them stops
            g.broke()
        with self._cond:
            spare = self.take_fetchers()
            spare, self._blob_fetchers = spare + self._blob_fetchers, []
        for f in spare:
            f.close()

    def allow_sync(self) -> None:
        """The restore is past its first token (or over): the pull may file its spooled pieces and make its
        blobs durable now."""
        self._file_ok.set()
        self._sync_ok.set()

    def wait_sync_allowed(self) -> None:
        self._sync_ok.wait(self.SYNC_WAIT_S)

    def follow(self, digest: str) -> Growing:
        """Follow a blob the pull fetches as one stream, while it is written (coldsnap.capsule.growing); asked
        before the pull fetches it."""
        with self._cond:
            return self._growing.setdefault(digest, Growing())

    def followed(self, digest: str) -> Growing | None:
        with self._cond:
            return self._growing.get(digest)

    def partial(self, digest: str, timeout: float) -> Path | None:
        """The blob's partial file once it has its full size; None when the pull ends (or times out) first, or
        fetches this blob some other way."""
        with self._cond:
            self._cond.wait_for(lambda: digest in self._partial or self.ended, timeout)
            return self._partial.get(digest)

    def pieces(self, digest: str, timeout: float) -> Iterator[tuple[int, int]]:
        """Each checked piece of the blob, (offset, length), as it is checked; ends once every piece is (or the pull
        ends: the caller asks `whole` whether it got them all)."""
        seen = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda n=seen: len(self._checked.get(digest, ())) > n  # type: ignore[misc]
                                           or digest in self._done or self.ended, timeout):
                    return
                new = self._checked.get(digest, [])[seen:]
                over = not new and (digest in self._done or self.ended)
            if over:
                return
            seen += len(new)
            yield from new

    def whole(self, digest: str, timeout: float | None = None) -> bool:
        """Whether every piece of the blob is checked, waiting up to `timeout` (None: until it is, or the pull
        ends) for it."""
        with self._cond:
            self._cond.wait_for(lambda: digest in self._done or self.ended, timeout)
            return digest in self._done


HEAD_MAX = 8 + (100 << 20)  # a safetensors file's head (its length, then its header) lies within this many bytes


class Spool:
    """A blob's pieces in memory: a memfd per piece (each the piece's size, its pages made as it arrives), gone with
    the last process holding them, so a killed restore leaves nothing behind. One file per piece because writes to
    one file take its inode's lock in turn: 16 writers into one memfd moved 3 GB/s on the GPU machine, into one
    each 13 GB/s. The fetching processes write the pieces, a restore's prefetchers read them (both are handed the
    descriptors); `file` writes them into the partial on disk."""

    def __init__(self, size: int, piece_bytes: int) -> None:
        self.size, self.piece_bytes = size, piece_bytes
        self.fds: list[int] = []
        try:
            for offset in range(0, size, piece_bytes):
                self.fds.append(os.memfd_create(f"coldsnap-weights-{offset // piece_bytes}", os.MFD_CLOEXEC))
                os.ftruncate(self.fds[-1], min(piece_bytes, size - offset))
        except OSError:
            self.close()
            raise

    def at(self, offset: int) -> tuple[int, int]:
        """(the memfd holding the blob's byte at offset, that byte's offset in it)."""
        return self.fds[offset // self.piece_bytes], offset % self.piece_bytes

    def file(self, fd: int, ranges: list[tuple[int, int]]) -> None:
        """The ranges (whole pieces) written from here into the file `fd` at their offsets, a thread per range up
        to workers()."""
        def write(r: tuple[int, int]) -> None:
            src, at = self.at(r[0])
            _copy_range(src, fd, at, r[1], r[0] - at)

        if ranges:
            with ThreadPoolExecutor(workers()) as pool:
                list(pool.map(write, ranges))

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


@dataclass
class SpoolFds:
    """A spool as another process takes it: the descriptors of its pieces' memfds, in order, and the pieces' size."""
    fds: list[int]
    piece_bytes: int

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def _raise_fd_limit(need: int) -> bool:
    """Whether this process may hold `need` more descriptors (its soft limit raised to the hard one if needed)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + need + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard == resource.RLIM_INFINITY else max(soft, hard),
                                                        hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft == resource.RLIM_INFINITY or soft >= want


def direct_wanted() -> bool:
    """Whether a restore's prefetcher may fetch the weights' pieces from the registry itself (coldsnap.gpu.direct),
    the pull fetching them for the node's store after the first token (a second transfer): COLDSNAP_PULL_DIRECT 1
    or 0; auto (default): where this node has an NVIDIA driver and the prefetch is on (COLDSNAP_PREFETCH), for a
    restore that chooses it once the capsule's profile is in (Arrivals.choose_direct: one file for one GPU). Where
    no prefetcher takes an offer, the pull fetches the pieces at once, to disk."""
    mode = settings().pull_direct
    if mode in ("", "auto"):
        return settings().prefetch and os.path.exists("/dev/nvidiactl")
    return mode == "1"


def spool_wanted(size: int, pieces: int) -> bool:
    """COLDSNAP_PULL_SPOOL: 1 always, 0 never, auto (default) when the node has memory for the spool and the
    partial's page cache beside it, with room to spare (MemAvailable ≥ 2 × size + 4 GiB); either way only where
    this process may hold three descriptors a piece (its own, and a prefetcher's copies while it starts)."""
    mode = settings().pull_spool
    if mode == "0" or not _raise_fd_limit(3 * pieces):
        return False
    if mode == "1":
        return True
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return False
    return avail >= 2 * size + (4 << 30)


def covers(wf: WeightFile, size: int) -> bool:
    """Whether wf's pins cover exactly `size` bytes (a pull trusts them only then)."""
    n, cb = len(wf.chunks), wf.chunk_bytes or 0
    return n > 0 and cb > 0 and (n - 1) * cb < size <= n * cb


def fetch_by_pieces(new_client: Callable[[], object], url: str, part: Path, size: int, wf: WeightFile,
                    what: str, progress: Callable[[int, int], None] | None = None,
                    arrivals: Arrivals | None = None, digest: str = "") -> tuple[int, int]:
    """Bring `part` to the blob of `size` bytes that wf pins, piece by piece. Returns (bytes received, bytes kept
    from an earlier partial). Raises NoRanges (the caller fetches it as one stream) or CAPSULE_CORRUPT (a piece does
    not match its pin: the partial is removed). arrivals: told the partial once at full size, and each piece once
    checked (those kept from an earlier partial first); the pieces land in a Spool when the node has the memory
    (spool_wanted), the file's head written through to the partial (engines read it from the file), the rest
    filed once the arrivals allow it. Direct (direct_wanted): the file's head fetched into the partial, the rest
    offered to a prefetcher (Arrivals.offer_direct) and fetched here only once the arrivals allow it."""
    cb = wf.chunk_bytes
    if cb is None:  # callers check covers() first
        raise ValueError(f"{what}: the weights are not pinned by pieces")
    pieces = [(i, i * cb, min(cb, size - i * cb)) for i in range(len(wf.chunks))]
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    spool: Spool | None = None
    try:
        had = os.fstat(fd).st_size
        there = [p for p in pieces if p[1] + p[2] <= had]
        with ThreadPoolExecutor(workers()) as pool:
            ok = pool.map(lambda p: chunk_digest(fd, p[1], p[2], wf.chunk_digest) == wf.chunks[p[0]], there)
            kept = {p[0] for p, good in zip(there, ok) if good}
        os.ftruncate(fd, size)
        direct = arrivals is not None and arrivals.goes_direct()
        if arrivals is not None and not direct and spool_wanted(size, len(pieces)):
            spool = Spool(size, cb)
            for i, offset, length in pieces:  # what an earlier pull left: where the prefetchers read the rest
                if i in kept:
                    _copy_range(fd, spool.fds[i], offset, length, -offset)
        if arrivals is not None:
            arrivals.sized(digest, part, spool)
            for i, offset, length in pieces:
                if i in kept:
                    arrivals.checked(digest, offset, length)
        todo = [p for p in pieces if p[0] not in kept]
        lock, local = threading.Lock(), threading.local()
        done = [sum(p[2] for p in pieces if p[0] in kept), 0]  # bytes in place, bytes received
        head: list[int] = []  # bytes at the file's head (8 + its header's length), once its first piece is here
        early: list[tuple[int, int, int]] = []  # pieces checked before that one
        through: set[int] = set()  # pieces written through to the partial
        if spool is not None and 0 in kept:  # the head is on disk already, as far as kept pieces go
            head.append(min(HEAD_MAX, 8 + int.from_bytes(os.pread(fd, 8, 0), "little")))

        def counted(n: int) -> None:
            with lock:
                done[0] += n
                done[1] += n
                if progress:
                    progress(done[0], size)

        def announce(i: int, offset: int, length: int) -> None:
            """A checked piece, spooled: pieces in the file's head go to the partial before the first piece is
            announced (whoever reads the spool waits for that one; the engines read the head from the file)."""
            if spool is not None:
                with lock:
                    if offset == 0:
                        head.append(min(HEAD_MAX, 8 + int.from_bytes(os.pread(spool.fds[0], 8, 0), "little")))
                        now = [(i, offset, length)] + [p for p in early if p[1] < head[0]]
                    else:
                        now = [(i, offset, length)] if head and offset < head[0] else []
                        if not head:
                            early.append((i, offset, length))
                    through.update(p[0] for p in now)
                spool.file(fd, [(o, n) for _, o, n in now])
            assert arrivals is not None
            arrivals.checked(digest, offset, length)

        def fetch(piece: tuple[int, int, int]) -> bool:
            if not hasattr(local, "client"):  # a connection (and its auth) of its own per thread
                local.client = new_client()
            i, offset, length = piece
            for attempt in range(ATTEMPTS):
                try:
                    into, base = (spool.fds[i], offset) if spool else (fd, 0)
                    good = fetch_piece(local.client, url, into, offset, length, wf.chunks[i], what, counted,
                                       WriteBehind(fd, offset).wrote if arrivals is None else None, base,
                                       wf.chunk_digest, ErrorCode.CAPSULE_NOT_FOUND)
                    if good and arrivals is not None:
                        announce(i, offset, length)
                    return good
                except broken():
                    if attempt == ATTEMPTS - 1:
                        raise ColdSnapError(ErrorCode.REGISTRY, f"{what}: the connection broke {ATTEMPTS} times "
                                            f"on the piece at byte {offset}; the pieces already here are kept and "
                                            "the next pull resumes them") from None
            return False

        def spooled(i: int, offset: int, length: int) -> None:  # a piece a fetching process put in the spool
            counted(length)
            announce(i, offset, length)

        ready = arrivals.take_fetchers() if arrivals is not None else []
        if spool is None or not todo:
            for f in ready:
                f.close()
        results = _fetch_in_processes(new_client, url, spool, todo, wf, what, spooled, ready) \
            if spool is not None and todo else None
        if direct:
            assert arrivals is not None
            results = _direct_then_here(fetch, new_client, url, fd, part, todo, pieces, wf, what, arrivals, digest)
        if results is None:  # on threads of this process: to disk, or where no fetching process could start
            with ThreadPoolExecutor(workers()) as pool:
                results = list(pool.map(fetch, todo))
        if not all(results):
            bad = next(p[1] for p, good in zip(todo, results) if not good)
            part.unlink(missing_ok=True)
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"{what}: the piece at byte {bad} does not match the "
                                "pin of the capsule's weights: refused, nothing kept")
        if arrivals is not None:  # every piece checked: what streams onward has it all; the disk catches up below,
            arrivals.complete(digest)  # once the restore reading them is past its first token
            if spool is not None:
                arrivals.wait_file_allowed()
                spool.file(fd, [(o, n) for i, o, n in todo if i not in through])
                arrivals.unspooled(digest)
            arrivals.mark_filed(digest)
            arrivals.wait_sync_allowed()
        os.fsync(fd)
        return done[1], sum(p[2] for p in pieces if p[0] in kept)
    finally:
        if spool is not None:
            if arrivals is not None:
                arrivals.unspooled(digest)
            spool.close()
        os.close(fd)


def _direct_then_here(fetch: Callable[[tuple[int, int, int]], bool], new_client: Callable[[], object], url: str,
                      fd: int, part: Path, todo: list[tuple[int, int, int]], every: list[tuple[int, int, int]],
                      wf: WeightFile, what: str, arrivals: Arrivals, digest: str) -> list[bool]:
    """fetch_by_pieces' direct way: every piece of the file offered to a prefetcher at once (its data section's
    start read from the registry, to be checked by the prefetcher against the first piece's pinned bytes); the
    pieces of the file's head (its first, then those its header reaches into) fetched into the partial meanwhile,
    for the engine, which reads its header from the file; the rest fetched here once the arrivals allow it (the
    first token, or someone needing the files). Whether each piece of todo matched its pin."""
    good: dict[int, bool] = {}
    offered = False
    try:
        layout = _data_offset(new_client(), url, what, every[-1][1] + every[-1][2])
        if layout is not None:
            authorization, data_offset = layout
            arrivals.offer_direct(digest, {"url": url, "authorization": authorization, "hash": wf.chunk_digest,
                                           "partial": str(part), "data_offset": data_offset,
                                           "pieces": [[o, n, wf.chunks[i]] for i, o, n in every]})
            offered = True
        first = [p for p in todo if p[1] == 0]
        good.update((p[0], fetch(p)) for p in first)
        if not all(good.values()):
            return [good.get(p[0], False) for p in todo]
        head_end = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")
        head = [p for p in todo if 0 < p[1] < head_end]
        with ThreadPoolExecutor(workers()) as pool:
            good.update(zip((p[0] for p in head), pool.map(fetch, head)))
        if all(good.values()):
            arrivals.head_filed(digest)
        rest = [p for p in todo if p[0] not in good]
        if offered and all(good.values()) and rest:
            arrivals.wait_file_allowed()
        with ThreadPoolExecutor(workers()) as pool:
            good.update(zip((p[0] for p in rest), pool.map(fetch, rest)))
        return [good.get(p[0], False) for p in todo]
    finally:
        if not offered:
            arrivals.offer_direct(digest, None)


def _data_offset(client, url: str, what: str, size: int) -> tuple[str | None, int] | None:
    """(the authorization that got the answer, where the file's data section starts: 8 + its header's length, as
    its first 8 bytes say) from the registry, before any piece is here; None where it answers no range or a length
    past the file. Unchecked here: the prefetcher checks it against the first piece once that matched its pin."""
    ranges, authorization, head = first_bytes(client, url, what, 8)
    if not ranges:
        return None
    offset = 8 + int.from_bytes(head, "little") if len(head) == 8 else size + 1
    return (authorization, offset) if offset <= min(size, HEAD_MAX) else None


FETCHERS = 4  # processes a spooled pull spreads its connections over (each has a GIL of its own)


class Fetcher:
    """A fetching process (coldsnap.capsule.fetcher), started before it has work: its interpreter and imports
    (~0.2 s) are paid while the pull still waits on the capsule's own blobs. Its job goes to its stdin, the
    pieces' memfds over a socket of its own, its lines come on its stdout, its stderr goes to a file (a pipe
    nobody reads until the end could fill and block it)."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.err = tempfile.TemporaryFile()
        try:
            # by its path (-P: its directory not on sys.path), so that it imports nothing of the package
            self.proc = subprocess.Popen([sys.executable, "-P", fetching.__file__, "--socket", str(theirs.fileno())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                         pass_fds=[theirs.fileno()])
        except OSError:
            self.sock.close()
            self.err.close()
            raise
        finally:
            theirs.close()

    def give(self, job: dict, fds: list[int]) -> None:
        """Its job, and the descriptors of its pieces' memfds in the job's order."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.close()
        for at in range(0, len(fds), FD_BATCH):
            socket.send_fds(self.sock, [b"f"], fds[at:at + FD_BATCH])
        self.sock.close()

    def ended(self) -> str | None:
        """Waits for it; how it ended when it failed (exit status, its last line on stderr), else None."""
        try:
            if self.proc.wait() == 0:
                return None
            self.err.seek(0)
            said = self.err.read().decode(errors="replace").strip().splitlines()
            return f"exit {self.proc.returncode}" + (f": {said[-1][:200]}" if said else "")
        finally:
            self.err.close()

    def close(self, at_once: bool = False) -> None:
        """Not needed after all (or the pull failed): it ends without work, at once, on the EOF of its stdin
        (at_once: killed, for one that may have its job); reaped on a thread of its own, so that whoever closes
        it does not wait."""
        self.sock.close()
        with suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        if at_once:
            self.proc.kill()
        threading.Thread(target=self._reap, name="fetcher-reap", daemon=True).start()

    def _reap(self) -> None:
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            self.err.close()


def probe(client, url: str, what: str) -> tuple[bool, str | None]:
    """Ask the registry for the blob's first byte: (whether it answers ranges, the authorization that got the
    answer). The authorization is the first request's, before a redirect: what a fetching process sends."""
    ranges, authorization, _ = first_bytes(client, url, what, 1)
    return ranges, authorization


def first_bytes(client, url: str, what: str, n: int) -> tuple[bool, str | None, bytes]:
    """probe's question for the blob's first n bytes: (whether it answers ranges, the authorization that got the
    answer, those bytes: empty where it answers no range)."""
    r = client.request("GET", url, ok=(200, 206), what=what, headers={"Range": f"bytes=0-{n - 1}"}, stream=True,
                       not_found=ErrorCode.CAPSULE_NOT_FOUND)
    with r:
        authorization = (r.history[0] if r.history else r).request.headers.get("Authorization")
        return r.status_code == 206, authorization, r.raw.read(n) if r.status_code == 206 else b""


def fetcher_count() -> int:
    """How many fetching processes a spooled pull runs: a connection per core up to 16 in all, four to a
    process, up to FETCHERS."""
    return max(1, min(FETCHERS, _connections() // 4))


def blob_fetcher_count() -> int:
    """How many of the blobs a restore follows as they arrive (its CRIU images) its pull fetches in processes of
    their own: COLDSNAP_PULL_IMAGE_FETCHERS (0-4), none by default: on the restore's own threads a cold node was
    sooner both on 2 CPU cores (1.66 against 1.94 s) and on a GPU machine's 16 (2.27 against 2.40 s; the weights
    then come after the images; docs/benchmarks.md)."""
    n = settings().pull_image_fetchers
    return int(n) if n.isdigit() and int(n) <= 4 else 0


def weights_ahead(choosing: bool = False) -> bool:
    """Whether a restore's pull starts the weights beside its CRIU images (once the profile that pins them is in)
    rather than after them: COLDSNAP_PULL_WEIGHTS_AHEAD (0 off, auto or unset, any other value on); auto: where the
    images come by fetching processes of their own, which the weights' traffic then slows less than it slows the
    restore's own threads (docs/benchmarks.md), and where the weights may go direct: COLDSNAP_PULL_DIRECT=1, or
    `choosing`, a restore that chooses the direct way once the profile is in (registry.pull's on_profile)."""
    ahead = settings().pull_weights_ahead
    if ahead in ("", "auto"):
        return blob_fetcher_count() > 0 or settings().pull_direct == "1" or choosing
    return ahead != "0"


def _connections() -> int:
    return max(workers(), min(16, os.cpu_count() or 1))


def _fetch_in_processes(new_client: Callable[[], object], url: str, spool: Spool, todo: list[tuple[int, int, int]],
                        wf: WeightFile, what: str, spooled: Callable[[int, int, int], None],
                        ready: list[Fetcher] | None = None) -> list[bool] | None:
    """The pieces fetched into the spool by a few processes of their own (coldsnap.capsule.fetcher), one per core
    up to 16 connections in all; spooled(i, offset, length) hears of each piece there and matching its pin.
    ready: fetching processes started ahead (Arrivals.start_fetchers), used first. Returns whether each piece
    matched its pin, in todo's order; None when no process could start (the caller fetches on its own threads).
    Raises NoRanges, or REGISTRY when a piece could not be fetched."""
    ready = list(ready or [])
    try:
        ranges, authorization = probe(new_client(), url, what)
        if not ranges:
            raise NoRanges()
    except BaseException:
        for f in ready:
            f.close()
        raise
    n = max(1, min(fetcher_count(), len(todo)))
    by_offset = {offset: (i, length) for i, offset, length in todo}
    procs = ready[:n]
    for extra in ready[n:]:
        extra.close()
    try:
        while len(procs) < n:
            procs.append(Fetcher())
        for k, fetcher in enumerate(procs):
            mine = todo[k::n]
            fetcher.give({"url": url, "authorization": authorization, "threads": -(-_connections() // n),
                          "hash": wf.chunk_digest, "pieces": [[o, length, wf.chunks[i]] for i, o, length in mine]},
                         [spool.fds[i] for i, _, _ in mine])
    except OSError:
        for fetcher in procs:
            fetcher.close(at_once=True)  # some may have their job: the caller's threads fetch it all again
        return None
    good: dict[int, bool] = {}
    broken: list[int] = []
    noranges: list[bool] = []

    def read(proc) -> None:
        for raw in proc.stdout:
            word, *rest = raw.decode(errors="replace").split() or [""]
            if word == "ok" and len(rest) == 2 and int(rest[0]) in by_offset:
                offset = int(rest[0])
                spooled(by_offset[offset][0], offset, by_offset[offset][1])
                good[offset] = True
            elif word == "bad" and rest:
                good[int(rest[0])] = False
            elif word == "broken" and rest:
                broken.append(int(rest[0]))
            elif word == "noranges":
                noranges.append(True)

    readers = [threading.Thread(target=read, args=(f.proc,), daemon=True) for f in procs]
    for t in readers:
        t.start()
    ended = []  # how a fetching process that failed ended
    for t, fetcher in zip(readers, procs):
        t.join()
        if (why := fetcher.ended()) is not None:
            ended.append(why)
    if noranges:
        raise NoRanges()
    missing = sorted(set(broken) | {o for _, o, _ in todo if o not in good})
    if missing:
        why = f"the connection broke {ATTEMPTS} times" if broken else f"its fetching process ended ({ended[0]})" \
            if ended else "it never came"
        raise ColdSnapError(ErrorCode.REGISTRY, f"{what}: the piece at byte {missing[0]} is missing: {why}; the "
                            "next pull fetches it again")
    return [good[o] for _, o, _ in todo]


def _copy_range(src: int, dst: int, offset: int, length: int, shift: int = 0) -> None:
    """src's bytes [offset, offset + length) written to dst at offset + shift."""
    for at in range(offset, offset + length, COPY):
        data = os.pread(src, min(COPY, offset + length - at), at)
        if not data or os.pwrite(dst, data, at + shift) != len(data):
            raise OSError(f"could not copy the byte at {at}")
