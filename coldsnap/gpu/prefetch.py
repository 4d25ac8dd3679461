"""Weights onto the GPU while the engine is still being restored.

The prefetcher, started when a restore begins, reads the weights file's data section (or a tensor-parallel rank's
plan: pieces of it, packed) into GPU memory it can export, while CRIU and the driver work. The engine's resume
receives that memory over the prefetcher's UNIX socket as a file descriptor (SCM_RIGHTS), maps it and copies its
parameters out device to device; anything wrong is an error on the socket, and the engine reloads from the file
(docs/gpu.md, "Weight prefetch").

Run as `python -m coldsnap.gpu.prefetch --file F --gpu GPU-UUID --socket PATH`: it listens at once, serves one
engine, prints one JSON line (what it moved, how fast) and exits; a watchdog ends it 30 s after --timeout at the
latest, whatever it is doing (it must never sit on GPU memory).

Run as `python -m coldsnap.gpu.prefetch --standby`, it is started before the restore knows what to prefetch: it
initialises CUDA (and the primary context of a lone GPU) at once, then reads its orders, stdin's first line: JSON,
the arguments above as a list (or null, or the end of stdin: dismissed, it exits). A direct pull (a cold node) thus
streams its weights onto the GPU from the moment the capsule is known, not after the prefetcher's ~0.3 s start.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import itertools
import json
import mmap
import os
import queue
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Callable, Iterable, Iterator

from coldsnap.base.files import pread_full
from coldsnap.gpu import vmm

CHUNK = 16 << 20  # bytes per read and per copy; two per thread
STANDBY_S = 600.0  # a standby prefetcher never given its orders exits after this long


class PrefetchError(RuntimeError):
    """The prefetched weights can't be used (the message says why); the engine reloads from the file instead."""


# safetensors dtype → (torch dtype name, bytes per element)
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
          "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
          "BOOL": ("bool", 1)}


def read_header(path: str | os.PathLike) -> tuple[int, dict]:
    """(offset of the data section, header) of a safetensors file; ValueError when it is not one."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: implausible safetensors header length {n}")
        header = json.loads(f.read(n))
    return 8 + n, header


def data_section(path: str) -> tuple[int, int]:
    """(offset, length) of a safetensors file's data section."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        size = os.fstat(f.fileno()).st_size
    return 8 + n, size - 8 - n


def file_identity(path: str) -> dict:
    """What tells a file from another one put in its place: the engine checks it before using the memory."""
    st = os.stat(path)
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


# A piece of the data section: rows of `width` bytes, `pitch` bytes apart, from `offset` on. A whole tensor or a
# shard split along dim 0 is one row; a shard split along dim 1 is a part of every row.
Piece = tuple[int, int, int, int]  # (offset, width, rows, pitch)
ALIGN = 256  # each piece starts on this boundary of the prefetched memory


def gpu_key(uuid: str) -> str:
    """A GPU UUID in a form both sides agree on: NVML writes GPU-8d0a62a0-…, torch 8d0a62a0-…; the hex digits."""
    return str(uuid).removeprefix("GPU-").replace("-", "").lower()


def _piece(raw) -> Piece:
    """A plan entry as a Piece; ValueError unless it is four integers."""
    offset, width, rows, pitch = (int(x) for x in raw)
    return offset, width, rows, pitch


def whole_section(length: int) -> list[Piece]:
    return [(0, length, 1, length)]


def check_pieces(pieces: list[Piece], length: int) -> None:
    """Every piece inside a data section of `length` bytes; ValueError naming the first that is not."""
    for i, (offset, width, rows, pitch) in enumerate(pieces):
        if min(offset, width, rows, pitch) < 0 or rows < 1 or width > pitch or \
                offset + pitch * (rows - 1) + width > length:
            raise ValueError(f"piece {i} {(offset, width, rows, pitch)} is not inside the {length}-byte data section")


def packed_layout(pieces: list[Piece]) -> tuple[list[int], int]:
    """Where each piece starts in the prefetched memory (its rows back to back, each piece ALIGN-aligned), and the
    memory's size. The engine finds its tensors with the same function."""
    starts, at = [], 0
    for _, width, rows, _ in pieces:
        at += -at % ALIGN
        starts.append(at)
        at += width * rows
    return starts, at


def copy_jobs(pieces: list[Piece], chunk: int = CHUNK) -> list[tuple[int, int, int, int, int]]:
    """The pieces as copies of at most `chunk` bytes read each: (offset, pitch, width, rows, dst): read
    pitch * (rows - 1) + width bytes at offset, copy `rows` rows of `width` bytes to dst, back to back."""
    jobs = []
    for (offset, width, rows, pitch), dst in zip(pieces, packed_layout(pieces)[0]):
        if rows == 1 or width == pitch:  # one contiguous range
            n = width * rows
            jobs += [(offset + k, min(chunk, n - k), min(chunk, n - k), 1, dst + k) for k in range(0, n, chunk)]
        elif pitch <= chunk:  # whole rows read, our part of each copied
            per = chunk // pitch
            jobs += [(offset + r * pitch, pitch, width, min(per, rows - r), dst + r * width)
                     for r in range(0, rows, per)]
        else:  # rows wider than a chunk: our part of each row on its own
            jobs += [(offset + r * pitch + k, min(chunk, width - k), min(chunk, width - k), 1, dst + r * width + k)
                     for r in range(rows) for k in range(0, width, chunk)]
    return jobs


def read_bytes(job: tuple[int, int, int, int, int]) -> int:
    _, pitch, width, rows, _ = job
    return pitch * (rows - 1) + width


def cut_at_windows(jobs: list, base: int, window: int) -> list:
    """The jobs, none reading across a multiple of `window` in the file (base: the data section's offset there),
    for a copy must come from one registration. Rows that fit below the boundary stay one job; a row across it
    becomes two. Each job must read at most `window` bytes (copy_jobs with chunk <= window)."""
    out = []
    for offset, pitch, width, rows, dst in jobs:
        r = 0
        while r < rows:
            start = base + offset + r * pitch
            end = (start // window + 1) * window
            fit = 0 if start + width > end else min(rows - r, (end - start - width) // pitch + 1)
            if fit:
                out.append((offset + r * pitch, pitch if fit > 1 else width, width, fit, dst + r * width))
                r += fit
            else:
                k = end - start
                out += [(offset + r * pitch, k, k, 1, dst + r * width),
                        (offset + r * pitch + k, width - k, width - k, 1, dst + r * width + k)]
                r += 1
    return out


def split_jobs(jobs: list, threads: int) -> list[list]:
    """Consecutive runs of jobs with about the same bytes to read each (a thread reads on through the file)."""
    total = sum(read_bytes(j) for j in jobs)
    groups: list[list] = [[]]
    done = 0
    for job in jobs:
        if done >= total * len(groups) / threads and groups[-1]:
            groups.append([])
        groups[-1].append(job)
        done += read_bytes(job)
    return groups


def _copy_async(driver, d, src: int, job: tuple[int, int, int, int, int], ptr: int, stream) -> None:
    """Queue one job's copy from host memory at src (its read range) to the GPU: one range, or a part of each row
    as a 2D copy (d: a CUDA_MEMCPY2D this job may use until its copy is done)."""
    _, pitch, width, rows, dst = job
    if rows == 1:
        driver.call("cuMemcpyHtoDAsync_v2", ptr + dst, src, width, stream)
        return
    ctypes.memset(ctypes.byref(d), 0, ctypes.sizeof(d))
    d.srcMemoryType, d.srcHost, d.srcPitch = vmm.MEMORYTYPE_HOST, src, pitch
    d.dstMemoryType, d.dstDevice, d.dstPitch = vmm.MEMORYTYPE_DEVICE, ptr + dst, width
    d.WidthInBytes, d.Height = width, rows
    driver.call("cuMemcpy2DAsync_v2", ctypes.byref(d), stream)


def _on_threads(driver, device: int, groups: list, run) -> None:
    """run(jobs, stream) on a thread per group, each with the device's primary context current and its own stream."""
    ctx = driver.use_primary_context(device)

    def thread(jobs: list) -> None:
        driver.call("cuCtxSetCurrent", ctx)
        stream = ctypes.c_void_p()
        driver.call("cuStreamCreate", ctypes.byref(stream), vmm.STREAM_NON_BLOCKING)
        try:
            run(jobs, stream)
            driver.call("cuStreamSynchronize", stream)
        finally:
            driver.lib.cuStreamDestroy_v2(stream)

    with ThreadPoolExecutor(len(groups), thread_name_prefix="coldsnap-prefetch") as pool:
        for job in [pool.submit(thread, g) for g in groups]:
            job.result()


def fill_buffered(driver, device: int, ptr: int, fd: int, base: int, pieces: list[Piece], threads: int) -> None:
    """GPU memory at ptr := the pieces of the file's data section at base, packed (packed_layout): `threads`
    threads, each a run of copy_jobs, each reading into two pinned buffers in turn and copying on its own stream (a
    read overlaps the previous copy). Each byte crosses host memory three times: read, written, read by the DMA."""
    _on_threads(driver, device, split_jobs(copy_jobs(pieces), threads),
                _pinned_copies(driver, ptr, _reader(fd), base))


def _reader(fd: int) -> Callable[[memoryview, int], None]:
    """read(view, offset): fill view from the file at offset."""
    return lambda view, offset: pread_full(fd, view, offset)


def spool_reader(fds: list[int], piece_bytes: int) -> Callable[[memoryview, int], None]:
    """read(view, offset) of a blob spooled a memfd per piece (coldsnap.capsule.pieces.Spool): a read stays inside
    one piece (the arriving ranges are pieces, and their jobs are cut inside them)."""
    def read(view: memoryview, offset: int) -> None:
        piece, at = divmod(offset, piece_bytes)
        if at + len(view) > piece_bytes:
            raise PrefetchError(f"a read at byte {offset} crosses the spool's piece {piece}")
        pread_full(fds[piece], view, at)

    return read


def fill_arriving(driver, device: int, ptr: int, read: Callable[[memoryview, int], None], base: int,
                  pieces: Iterable[Piece], threads: int) -> None:
    """GPU memory at ptr := each piece of the data section at its own offset there, as `pieces` yields them (a
    streamed pull's pieces, each once it is checked), read by read(view, file offset): fill_buffered's threads and
    pinned buffers, set up once, take the pieces' copy jobs from one queue as they come."""
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    failed: list[BaseException] = []

    def copy() -> None:
        try:
            _on_threads(driver, device, [iter(jobs.get, None) for _ in range(threads)],
                        _pinned_copies(driver, ptr, read, base))
        except BaseException as e:  # noqa: BLE001 - raised below, once the feeding stops
            failed.append(e)

    copier = threading.Thread(target=copy, name="coldsnap-prefetch-arriving", daemon=True)
    copier.start()
    try:
        for piece in pieces:
            for offset, pitch, width, rows, dst in copy_jobs([piece]):
                jobs.put((offset, pitch, width, rows, dst + piece[0]))  # at the piece's place, not packed
            if failed:
                break
    finally:
        for _ in range(threads):
            jobs.put(None)
        copier.join()
    if failed:
        raise failed[0]


class SectionArrivals:
    """File ranges checked as a streamed pull brings them, as pieces of the file's data section: the section starts
    after the header, so ranges that come before the head of the file (its first 8 bytes and the header they size)
    are held until it is here. The ranges never overlap (a pull's pieces)."""

    def __init__(self, size: int, header_length: Callable[[], int]) -> None:
        self.size, self._header_length = size, header_length
        self.base: int | None = None
        self.covered = 0  # bytes of the data section given out as pieces
        self._held: list[tuple[int, int]] = []

    def add(self, offset: int, length: int) -> list[Piece]:
        """The pieces of the data section this range makes loadable (the held ones too, once the head is here)."""
        if self.base is not None:
            return self._cut(offset, length)
        self._held.append((offset, length))
        prefix = 0
        for start, n in sorted(self._held):
            if start > prefix:
                break
            prefix = max(prefix, start + n)
        if prefix < 8 or prefix < 8 + self._header_length():
            return []
        self.base = 8 + self._header_length()
        held, self._held = self._held, []
        return [p for start, n in held for p in self._cut(start, n)]

    def _cut(self, offset: int, length: int) -> list[Piece]:
        assert self.base is not None
        start, end = max(offset, self.base), min(offset + length, self.size)
        if end <= start:
            return []
        self.covered += end - start
        return [(start - self.base, end - start, 1, end - start)]

    @property
    def complete(self) -> bool:
        return self.base is not None and self.covered == self.size - self.base


class _PinnedPair:
    """Two pinned host buffers of `size` bytes for one thread's copies to the GPU on its stream, used in turn: one
    is filled while the other's copy runs. buffer(k) waits until buffer k's last copy is done; copied(k) marks a
    copy from it queued; close() waits for the stream and frees them."""

    def __init__(self, driver, size: int, stream) -> None:
        self.driver, self.size, self.stream = driver, size, stream
        self.events = [ctypes.c_void_p() for _ in range(2)]
        self.bufs: list[ctypes.c_void_p] = []
        self.used = [False, False]
        try:
            for e in self.events:
                driver.call("cuEventCreate", ctypes.byref(e), vmm.EVENT_DISABLE_TIMING)
            for _ in range(2):
                p = ctypes.c_void_p()
                driver.call("cuMemHostAlloc", ctypes.byref(p), size, 0)
                self.bufs.append(p)
        except BaseException:
            self.close()
            raise
        self.views = [memoryview((ctypes.c_char * size).from_address(p.value or 0)).cast("B") for p in self.bufs]

    def buffer(self, k: int) -> memoryview:
        if self.used[k]:
            self.driver.call("cuEventSynchronize", self.events[k])  # its previous copy is done
        return self.views[k]

    def addr(self, k: int) -> int:
        return self.bufs[k].value or 0

    def copied(self, k: int) -> None:
        self.driver.call("cuEventRecord", self.events[k], self.stream)
        self.used[k] = True

    def close(self) -> None:
        lib = self.driver.lib
        try:
            if any(self.used):
                lib.cuStreamSynchronize(self.stream)  # no copy may still read what is freed
        finally:
            for p in self.bufs:
                lib.cuMemFreeHost(p)
            self.bufs = []
            for e in self.events:
                if e.value:
                    lib.cuEventDestroy_v2(e)


def _pinned_copies(driver, ptr: int, read: Callable[[memoryview, int], None], base: int):
    """A thread's work for fill_buffered and fill_arriving: its jobs read into two pinned buffers in turn, each
    copied to the GPU on the thread's stream while the next is read."""
    def run(jobs, stream) -> None:
        descs = [vmm.CUDA_MEMCPY2D(), vmm.CUDA_MEMCPY2D()]
        pair = _PinnedPair(driver, CHUNK, stream)
        try:
            for i, job in enumerate(jobs):
                k = i % 2
                read(pair.buffer(k)[:read_bytes(job)], base + job[0])
                _copy_async(driver, descs[k], pair.addr(k), job, ptr, stream)
                pair.copied(k)
            driver.call("cuStreamSynchronize", stream)
        finally:
            pair.close()

    return run


WINDOW = 256 << 20  # bytes of the file registered with the driver at a time: copies start once the first is in
RESIDENT = 0.9  # below this share of the needed pages in the page cache, fill_buffered (parallel reads) is faster
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype, _libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                            ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


class NotResident(RuntimeError):
    """Too little of the file is in the page cache for the mapped fill to pay."""


class FileMapping:
    """The whole file mapped read-only and shared: the page cache's own pages, nothing copied."""

    def __init__(self, fd: int) -> None:
        self.length = -(-os.fstat(fd).st_size // mmap.PAGESIZE) * mmap.PAGESIZE
        addr = _libc.mmap(None, self.length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {self.length} bytes: {os.strerror(err)}")
        self.addr = addr

    def resident(self, start: int, end: int) -> float:
        """The share of the pages of file bytes [start, end) that are in the page cache (mincore)."""
        lo, hi = start - start % mmap.PAGESIZE, min(self.length, end)
        pages = -(-(hi - lo) // mmap.PAGESIZE)
        vec = ctypes.create_string_buffer(pages)
        if pages == 0 or _libc.mincore(self.addr + lo, hi - lo, vec) != 0:
            return 0.0
        return 1 - vec.raw[:pages].count(0) / pages  # a page in the cache is 1 (the other bits are reserved, 0)

    def close(self) -> None:
        _libc.munmap(self.addr, self.length)


def fill_mapped(driver, device: int, ptr: int, fd: int, base: int, pieces: list[Piece], threads: int,
                window: int = WINDOW, copy: int | None = None) -> tuple[dict, Callable[[], float]]:
    """The same result as fill_buffered, with the GPU reading the page cache itself, so each byte crosses host
    memory once: the file is mapped read-only, `threads` threads register the windows of it that the pieces touch
    with the driver (which pins the pages where they are), in file order, and the copies of each job go out on one
    stream as soon as the window under it is in. On the H200 machine the copies run at the PCIe rate (55 GB/s) but
    registering at 33–43 GB/s whatever the threads, barely overlapped: no faster than fill_buffered.
    Returns (what it measured, release): release() unregisters and unmaps, once the copies are done, and returns
    the seconds that took. copy: bytes per copy (default: a window). Raises NotResident when the page cache holds
    too little of the file (parallel reads do better from disk) and CudaError when the driver can't register a
    file's pages; either way nothing is held."""
    jobs = cut_at_windows(copy_jobs(pieces, min(copy or window, window)), base, window)
    spans = [(base + j[0], base + j[0] + read_bytes(j)) for j in jobs]  # file bytes each job reads
    mapping = FileMapping(fd)
    wanted = sorted({w for a, b in spans for w in range(a // window, (b - 1) // window + 1)})
    resident = min((mapping.resident(w * window, (w + 1) * window) for w in wanted), default=1.0)
    if resident < RESIDENT:
        mapping.close()
        raise NotResident(f"{resident:.0%} of a window of the file is in the page cache")
    done = {w: threading.Event() for w in wanted}
    registered: list[int] = []
    failed: list[BaseException] = []
    lock = threading.Lock()
    order = iter(wanted)
    t0 = time.monotonic()
    reg_end = [t0]

    def fail(e: BaseException) -> None:  # the issuing thread raises it; nothing waits on a window after
        failed.append(e)
        for event in done.values():
            event.set()

    def register() -> None:
        try:
            driver.call("cuCtxSetCurrent", ctx)
        except BaseException as e:  # noqa: BLE001
            fail(e)
        while not failed:
            with lock:
                w = next(order, None)
            if w is None:
                return
            lo = w * window
            try:
                driver.call("cuMemHostRegister_v2", ctypes.c_void_p(mapping.addr + lo),
                            min(window, mapping.length - lo), vmm.HOSTREGISTER_READ_ONLY)
            except BaseException as e:  # noqa: BLE001
                fail(e)
                return
            with lock:
                registered.append(lo)
                reg_end[0] = max(reg_end[0], time.monotonic())
            done[w].set()

    def release() -> float:
        t = time.monotonic()
        for lo in registered:
            driver.lib.cuMemHostUnregister(ctypes.c_void_p(mapping.addr + lo))
        registered.clear()
        mapping.close()
        return round(time.monotonic() - t, 4)

    stream, workers = ctypes.c_void_p(), []
    descs = [vmm.CUDA_MEMCPY2D() for j in jobs if j[3] > 1]  # each 2D copy's own, alive until the stream is done
    try:
        ctx = driver.use_primary_context(device)  # current on this thread; register() makes it current on its own
        driver.call("cuStreamCreate", ctypes.byref(stream), vmm.STREAM_NON_BLOCKING)
        workers = [threading.Thread(target=register, name="coldsnap-prefetch-register", daemon=True)
                   for _ in range(max(1, min(threads, len(wanted))))]
        for t in workers:
            t.start()
        for job, (a, _) in zip(jobs, spans):
            done[a // window].wait()  # the one window it reads from (cut_at_windows)
            if failed:
                raise failed[0]
            _copy_async(driver, descs.pop() if job[3] > 1 else None, mapping.addr + a, job, ptr, stream)
        driver.call("cuStreamSynchronize", stream)
    except BaseException:
        fail(vmm.CudaError("abandoned"))
        for t in workers:
            t.join()
        if stream.value:
            driver.lib.cuStreamSynchronize(stream)
            driver.lib.cuStreamDestroy_v2(stream)
        release()
        raise
    driver.lib.cuStreamDestroy_v2(stream)
    return {"windows": len(wanted), "register_s": round(reg_end[0] - t0, 4), "resident": round(resident, 3)}, release


def plan_digest(pieces: list[Piece]) -> str:
    """What names a plan on the socket: the engine computes its own plan and checks it is the one loaded."""
    return hashlib.sha256(json.dumps([list(p) for p in pieces], separators=(",", ":")).encode()).hexdigest()


MODES = ("buffered", "mapped")


def serve(path: str, gpu_uuid: str, sock_path: str, threads: int, timeout: float, hold: bool = False,
          pieces: list[Piece] | None = None, mode: str = "buffered", arrivals: Iterable[str] | None = None,
          linger: bool = False, spool: tuple[list[int], int] | None = None,
          direct: Callable[[], object] | None = None, driver: vmm.Driver | None = None) -> dict:
    """Listen at sock_path, load, hand the memory to the first engine that connects; return what happened.
    pieces: load only these parts of the data section, packed (a tensor-parallel rank's shards); default all of it.
    mode: "buffered" (fill_buffered) or "mapped" (fill_mapped; fill_buffered where it can't be, the report says
    why). For one file on the H200 machine the mapped fill is no faster; for several files loaded side by side
    beside CRIU it is (less host memory traffic): see docs/benchmarks.md.
    hold: once served, keep the memory and the context until stdin closes: freeing them (and tearing the context
    down) while the engine captures its CUDA graphs and answers its first request slowed both down.
    linger: once served, free the memory at once (the engine maps its KV cache there next) but keep the context
    until stdin closes: its teardown then happens after the first token, not beside the engine's mapping.
    arrivals: the file is still arriving (a streamed pull's partial, linked at its path at full size): "OFFSET
    LENGTH" lines name each range once checked against its pin, "end" (or the lines' end) that no more come. Each is
    loaded as it comes, and only those: a data section not wholly named is an error (the engine reads the file).
    spool: with arrivals, (descriptors, piece size) of the memory holding the checked ranges (the pull's Spool: a
    memfd per piece), read instead of the file, whose pieces reach the disk later.
    direct: returns the job (coldsnap.gpu.direct's), asked once the GPU is ready: every piece of the file, fetched
    from the registry onto the GPU here, the data section's start checked against the first piece's pinned bytes;
    the engine's file (which it checks is the one loaded) is the job's "partial" (the blob's partial file, which
    the restore links at `path` later), else `path`.
    driver: CUDA, initialised already (a standby prefetcher's: main's --standby).
    Once the memory is loaded (or can't be), one line says so before the engine is awaited: {"loaded": true} or
    {"loaded": false, "error": ...}; the restore lets the engine take the memory only after the first."""
    t0 = time.monotonic()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    os.chmod(sock_path, 0o600)
    listener.listen(1)
    listener.settimeout(timeout)
    report: dict = {"file": path, "gpu": gpu_uuid}
    buf = None
    release = None  # of the mapped fill's registrations, once its copies are done
    message: dict
    fds: list[int] = []
    source = path  # the file whose identity the engine checks: where the bytes came from
    try:
        try:
            driver = driver or vmm.Driver()
            device = driver.device_by_uuid(bytes.fromhex(gpu_uuid.removeprefix("GPU-").replace("-", "")))
            driver.use_primary_context(device)
            report["cuda_init_s"] = round(time.monotonic() - t0, 4)
            if direct is not None:  # from the registry, each piece checked against its pin here
                report["mode"] = "direct"
                job = direct()
                if not isinstance(job, dict):
                    raise PrefetchError("the pull offered no pieces: it fetches them itself")
                source = str(job.get("partial") or path)  # the same inode as `path`, once linked there
                buf, base, size, load_s = _load_direct(driver, device, job, threads)
            elif arrivals is not None:  # still arriving: each piece as it is checked
                report["mode"] = "arriving"
                buf, base, size, load_s = _load_arriving(driver, device, path, arrivals, threads, spool)
            else:
                base, length = data_section(path)
                if pieces is not None:
                    check_pieces(pieces, length)
                plan = pieces or whole_section(length)
                size = packed_layout(plan)[1]
                buf = vmm.ExportableBuffer(driver, device, size)
                fd = os.open(path, os.O_RDONLY)
                try:
                    t1 = time.monotonic()
                    report["mode"] = mode
                    if mode == "mapped":
                        try:
                            report["mapped"], release = fill_mapped(driver, device, buf.ptr, fd, base, plan, threads)
                        except (vmm.CudaError, NotResident, OSError) as e:  # e.g. a cold page cache: parallel reads
                            report.update(mode="buffered", mapped_error=str(e))
                    if report["mode"] == "buffered":
                        fill_buffered(driver, device, buf.ptr, fd, base, plan, threads)
                    load_s = time.monotonic() - t1
                finally:
                    os.close(fd)
            fds = [buf.export_fd()]
            message = {"bytes": size, "alloc_bytes": buf.size, "offset": base,
                       **({"plan": plan_digest(pieces)} if pieces is not None else {})}
            if direct is None:  # the file the bytes were read from, as it was then: one changed since is refused
                message["identity"] = file_identity(source)
            report.update(bytes=size, load_s=round(load_s, 4), gb_per_s=round(size / load_s / 1e9, 2),
                          threads=threads, ready_s=round(time.monotonic() - t0, 4),
                          **({"pieces": len(pieces)} if pieces is not None else {}))
        except Exception as e:  # noqa: BLE001 - whatever it is, the engine hears it and reloads from the file
            message = {"error": f"{type(e).__name__}: {e}"}
            report["error"] = message["error"]
        print(json.dumps({"loaded": "error" not in message, **({"error": message["error"]} if "error" in message
                                                                else {})}), flush=True)
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            report["served"] = False
            return report
        os.unlink(sock_path)  # one engine only; and the restore knows from it that this one was served
        if "error" not in message and direct is not None:
            # A direct load's bytes came from the registry, each checked against its pin, not from its file (the
            # blob's partial), whose head the pull may write after the load is done: the file is the one the engine
            # finds now (the same inode), whatever its mtime was at the load's end.
            try:
                message["identity"] = file_identity(source)
            except OSError as e:
                message = {"error": f"the weights file is gone: {e}"}
        with conn:
            conn.settimeout(timeout)
            socket.send_fds(conn, [json.dumps(message).encode()], fds)
            if release is not None:  # the pages go back to the page cache's care while the engine maps the memory
                report["mapped"]["unregister_s"], release = release(), None
            report["served"] = True
            conn.recv(1)  # the engine closes once it has mapped the memory; ours can go then
            if not hold:  # let go of it before the engine hears the connection close (Session.release waits)
                for fd in fds:
                    os.close(fd)
                fds = []
                if buf is not None:
                    buf.close()
                    buf = None
        report["total_s"] = round(time.monotonic() - t0, 4)
        if hold or linger:
            sys.stdin.buffer.read()
        return report
    finally:
        if release is not None:
            release()
        for fd in fds:
            os.close(fd)
        if buf is not None:
            buf.close()
        listener.close()
        with suppress(FileNotFoundError):
            os.unlink(sock_path)


def _load_arriving(driver, device: int, path: str, arrivals: Iterable[str], threads: int,
                   spool: tuple[list[int], int] | None = None):
    """serve's load of a file still arriving: (buffer, section offset, bytes, seconds). spool: descriptors of the
    memory the pull puts its checked pieces in (a memfd per piece) and the pieces' size, read instead of the file."""
    fd = os.open(path, os.O_RDONLY)
    buf = None
    try:
        t1 = time.monotonic()
        read = _reader(fd) if spool is None else spool_reader(*spool)

        def header_length() -> int:
            head = bytearray(8)
            read(memoryview(head), 0)
            return struct.unpack("<Q", head)[0]

        section = SectionArrivals(os.fstat(fd).st_size, header_length)

        def pieces() -> Iterator[Piece]:
            for line in arrivals:
                if line.strip() == "end":
                    return
                offset, length = (int(x) for x in line.split())
                yield from section.add(offset, length)

        coming = pieces()
        first = next(coming, None)
        if first is None or section.base is None:
            raise PrefetchError("the weights stopped arriving before their data did")
        length = section.size - section.base
        buf = vmm.ExportableBuffer(driver, device, length)
        fill_arriving(driver, device, buf.ptr, read, section.base, itertools.chain([first], coming), threads)
        if not section.complete:
            raise PrefetchError(f"the weights stopped arriving: {section.covered} of {length} bytes checked")
        return buf, section.base, length, time.monotonic() - t1
    except BaseException:
        if buf is not None:
            buf.close()
        raise
    finally:
        os.close(fd)
        for spooled in spool[0] if spool else []:  # the pull keeps its own until the pieces are filed
            os.close(spooled)


def direct_extent(pieces: list) -> int:
    """The size of the file a direct job's pieces make up: they must run from its first byte to its last without a
    gap. PrefetchError otherwise."""
    at = 0
    for offset, n, _ in sorted(pieces, key=lambda p: int(p[0])):
        if int(offset) != at:
            raise PrefetchError(f"the registry's pieces leave a gap at byte {at}")
        at += int(n)
    return at


def _load_direct(driver, device: int, job: dict, threads: int):
    """serve's load of a file whose pieces come from the registry (coldsnap.gpu.direct): (buffer, section offset,
    bytes, seconds). The data section starts at the job's data_offset (the registry's word, before any piece was
    checked): the pieces' bytes from there on go onto the GPU, and the first piece, once it matched its pin, must
    say the same (its first 8 bytes: the header's length)."""
    from coldsnap.gpu.direct import receive_pieces

    t1 = time.monotonic()
    size = direct_extent(job["pieces"])
    base = int(job["data_offset"])
    if not 8 <= base <= size:
        raise PrefetchError(f"the data section would start at byte {base} of a {size}-byte file")
    head: dict[str, bytes] = {}  # the file's first 8 bytes, as the first piece brought them
    buf = vmm.ExportableBuffer(driver, device, size - base)
    try:
        ctx = driver.use_primary_context(device)
        receive_pieces(job, threads, lambda: _GpuSink(driver, ctx, buf.ptr, base, head), lambda piece: None)
        if 8 + int.from_bytes(head.get("first", b""), "little") != base:  # every piece matched its pin by now
            raise PrefetchError(f"the file's header says its data starts elsewhere than at byte {base}, where the "
                                "registry's answer put it")
    except BaseException:
        buf.close()
        raise
    return buf, base, size - base, time.monotonic() - t1


class _GpuSink:
    """coldsnap.gpu.direct's Sink on the GPU: a stream of this thread's and a _PinnedPair of direct.CHUNK, each
    buffer's bytes of the file's data section (from byte `base` on) copied to the GPU buffer at `to` + their place
    in it, the header's bytes skipped; `head` gets the file's first 8 bytes as they pass ("first")."""

    def __init__(self, driver, ctx, to: int, base: int, head: dict[str, bytes]) -> None:
        from coldsnap.gpu.direct import CHUNK

        self.driver, self.to, self.base, self.head = driver, to, base, head
        driver.call("cuCtxSetCurrent", ctx)
        self.stream = ctypes.c_void_p()
        driver.call("cuStreamCreate", ctypes.byref(self.stream), vmm.STREAM_NON_BLOCKING)
        try:
            self.pair = _PinnedPair(driver, CHUNK, self.stream)
        except BaseException:
            driver.lib.cuStreamDestroy_v2(self.stream)
            raise

    def buffer(self, k: int) -> memoryview:
        return self.pair.buffer(k)

    def send(self, k: int, n: int, offset: int) -> None:
        if offset == 0:
            self.head["first"] = bytes(self.pair.views[k][:min(8, n)])
        skip = min(n, max(0, self.base - offset))  # the header's bytes in this buffer
        if skip < n:
            self.driver.call("cuMemcpyHtoDAsync_v2", self.to + offset + skip - self.base, self.pair.addr(k) + skip,
                             n - skip, self.stream)
        self.pair.copied(k)

    def finish(self) -> None:
        try:
            self.driver.call("cuStreamSynchronize", self.stream)
        finally:
            self.pair.close()
            self.driver.lib.cuStreamDestroy_v2(self.stream)


class Session:
    """Engine side of one hand-over: connect, receive the memory's fd and description, close when mapped."""

    def __init__(self, sock_path: str, path: str, timeout: float = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(sock_path)
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
        except OSError as e:
            self.sock.close()
            raise PrefetchError(f"no prefetched weights at {sock_path}: {e}") from None
        try:
            self.message = json.loads(data or b"{}")
            if "error" in self.message:
                raise PrefetchError(f"the prefetcher failed: {self.message['error']}")
            if not fds:
                raise PrefetchError("the prefetcher sent no memory")
            if self.message.get("identity") != file_identity(path):
                raise PrefetchError(f"the prefetcher loaded another file than {path}")
        except BaseException:
            for fd in fds:
                os.close(fd)
            self.sock.close()
            raise
        self.fd = fds[0]

    def close(self) -> None:
        self.sock.close()

    def release(self) -> None:
        """Done with the memory (unmapped): tell the prefetcher, and wait until it has freed its copy (one run
        without --hold frees it before closing), so that GPU memory is there for what the engine maps next."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.recv(1)
        except OSError:
            pass  # gone already: nothing of it holds the memory
        finally:
            self.sock.close()


def stand_by() -> tuple[vmm.Driver | None, list[str] | None]:
    """--standby: CUDA initialised, and a lone GPU's primary context made, before there are orders; then the orders
    (stdin's first line). (driver or None where CUDA failed: serve tries again and says why; the arguments, or None:
    dismissed)."""
    watchdog = threading.Timer(STANDBY_S, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    driver = None
    with suppress(vmm.CudaError):
        driver = vmm.Driver()
        count, device = ctypes.c_int(), ctypes.c_int()
        driver.call("cuDeviceGetCount", ctypes.byref(count))
        if count.value == 1:  # the GPU it will be ordered onto: its context costs as much as CUDA's start
            driver.call("cuDeviceGet", ctypes.byref(device), 0)
            driver.use_primary_context(device.value)
    line = sys.stdin.readline()
    watchdog.cancel()
    try:
        orders = json.loads(line) if line.strip() else None
    except ValueError:
        orders = None
    ok = isinstance(orders, list) and all(isinstance(x, str) for x in orders)
    return driver, orders if ok else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    driver = None
    if argv == ["--standby"]:
        driver, orders = stand_by()
        if orders is None:
            return 0
        argv = orders
    p = argparse.ArgumentParser(prog="python -m coldsnap.gpu.prefetch", description=__doc__.split("\n\n")[0],
                                epilog="--standby alone: start CUDA now, read these arguments (a JSON list) from "
                                       "stdin's first line")
    p.add_argument("--file", required=True, help="the safetensors file whose data section to load")
    p.add_argument("--gpu", required=True, help="the GPU's UUID (GPU-…), as NVML names it")
    p.add_argument("--socket", required=True, help="UNIX socket path to serve the memory at (created, 0600)")
    p.add_argument("--threads", type=int, default=8, help="parallel readers (default 8)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the engine (default 120)")
    p.add_argument("--mode", choices=MODES, default="buffered",
                   help="buffered: read into pinned buffers, copied from there (default); mapped: the GPU copies "
                        "from the file's own pages in the page cache, registered with the driver (buffered where "
                        "they can't be)")
    p.add_argument("--hold", action="store_true", help="once served, free nothing until stdin closes")
    p.add_argument("--linger", action="store_true",
                   help="once served, free the memory but keep the CUDA context (exit) until stdin closes")
    p.add_argument("--arrivals", action="store_true",
                   help="the file is still arriving: stdin names each range checked against its pin, as 'OFFSET "
                        "LENGTH' lines, then 'end'; only those are loaded, as they come")
    p.add_argument("--spool-fds",
                   help="with --arrivals: inherited descriptors, comma-separated, of the memfds the pull puts the "
                        "file's pieces in, in order (read instead of --file, whose ranges reach the disk later)")
    p.add_argument("--spool-piece-bytes", type=int, default=0, help="with --spool-fds: the pieces' size")
    p.add_argument("--direct", action="store_true",
                   help="the file's pieces past its head come from the registry, fetched here: stdin's first line "
                        "is the job, JSON (coldsnap.gpu.direct; null: none), read once the GPU is ready; the head "
                        "is read from --file")
    p.add_argument("--plan", help="JSON file: [[offset, width, rows, pitch], ...] of the data section to load, "
                                  "packed (a tensor-parallel rank's part); default the whole data section")
    a = p.parse_args(argv)
    watchdog = threading.Timer(a.timeout + 30, os._exit, args=(3,))  # never linger holding GPU memory
    watchdog.daemon = True
    watchdog.start()
    try:
        pieces = [_piece(p) for p in json.loads(open(a.plan).read())] if a.plan else None
    except (OSError, ValueError, TypeError) as e:
        print(json.dumps({"served": False, "error": f"--plan {a.plan}: {e}"}), flush=True)
        return 1
    direct = (lambda: json.loads(sys.stdin.readline())) if a.direct else None  # read once the GPU is ready
    report = serve(a.file, a.gpu, a.socket, max(1, a.threads), a.timeout, a.hold, pieces, a.mode,
                   sys.stdin if a.arrivals and not a.direct else None, a.linger,
                   ([int(fd) for fd in a.spool_fds.split(",")], a.spool_piece_bytes)
                   if a.arrivals and a.spool_fds and a.spool_piece_bytes > 0 else None, direct, driver)
    print(json.dumps(report), flush=True)
    return 0 if report.get("served") and "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
