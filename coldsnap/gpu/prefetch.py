"""Weights onto the GPU while the engine is still being restored.

A recovery-mode restore reloads the weights from their file once the engine's CUDA state is back: ~0.6 s for 11 GB
that would otherwise follow CRIU's restore and the driver's, one after the other. The prefetcher, a process of its
own started when the restore begins, reads the file's data section from the page cache (parallel reads into pinned
buffers, copies on a stream per thread) into GPU memory it can export, while CRIU and the driver work. The engine's
resume then connects to the prefetcher's UNIX socket, receives the memory as a file descriptor (SCM_RIGHTS), maps it,
and copies its parameters out device to device (milliseconds). Anything wrong on either side (no GPU memory to spare,
another file, a timeout) is an error message on the socket, and the engine reloads from the file as before.

Run as `python -m coldsnap.gpu.prefetch --file F --gpu GPU-UUID --socket PATH`: it listens at once, serves one
engine, prints one JSON line (what it moved, how fast) and exits; a watchdog ends it 30 s after --timeout at the
latest, whatever it is doing (it must never sit on GPU memory).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..fsutil import pread_full

CHUNK = 16 << 20  # bytes per read and per copy; two per thread


class PrefetchError(RuntimeError):
    """The prefetched weights can't be used (the message says why); the engine reloads from the file instead."""


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


def fill(driver, device: int, ptr: int, fd: int, base: int, length: int, threads: int) -> None:
    """GPU memory at ptr := the file's bytes [base, base + length): `threads` threads, each a contiguous part, each
    reading into two pinned buffers in turn and copying on its own stream (a read overlaps the previous copy)."""
    from .vmm import EVENT_DISABLE_TIMING, STREAM_NON_BLOCKING

    step = -(-length // threads)
    step += -step % (2 << 20)
    ctx = driver.use_primary_context(device)

    def part(lo: int, hi: int) -> None:
        driver.call("cuCtxSetCurrent", ctx)
        stream, events, bufs = ctypes.c_void_p(), [ctypes.c_void_p() for _ in range(2)], []
        driver.call("cuStreamCreate", ctypes.byref(stream), STREAM_NON_BLOCKING)
        try:
            for e in events:
                driver.call("cuEventCreate", ctypes.byref(e), EVENT_DISABLE_TIMING)
            for _ in range(2):
                p = ctypes.c_void_p()
                driver.call("cuMemHostAlloc", ctypes.byref(p), CHUNK, 0)
                bufs.append(p)
            views = [memoryview((ctypes.c_char * CHUNK).from_address(b.value)).cast("B") for b in bufs]
            off, i = lo, 0
            while off < hi:
                k, n = i % 2, min(CHUNK, hi - off)
                if i >= 2:
                    driver.call("cuEventSynchronize", events[k])  # this buffer's previous copy is done
                pread_full(fd, views[k][:n], base + off)
                driver.call("cuMemcpyHtoDAsync_v2", ptr + off, bufs[k], n, stream)
                driver.call("cuEventRecord", events[k], stream)
                off, i = off + n, i + 1
            driver.call("cuStreamSynchronize", stream)
        finally:
            for b in bufs:
                driver.lib.cuMemFreeHost(b)
            for e in events:
                if e.value:
                    driver.lib.cuEventDestroy_v2(e)
            driver.lib.cuStreamDestroy_v2(stream)

    with ThreadPoolExecutor(threads, thread_name_prefix="coldsnap-prefetch") as pool:
        for job in [pool.submit(part, a, min(a + step, length)) for a in range(0, length, step)]:
            job.result()


def serve(path: str, gpu_uuid: str, sock_path: str, threads: int, timeout: float, hold: bool = False) -> dict:
    """Listen at sock_path, load, hand the memory to the first engine that connects; return what happened.
    hold: once served, keep the memory and the context until stdin closes: freeing them (and tearing the context
    down) while the engine captures its CUDA graphs and answers its first request slowed both down."""
    from .vmm import Driver, ExportableBuffer

    t0 = time.monotonic()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    os.chmod(sock_path, 0o600)
    listener.listen(1)
    listener.settimeout(timeout)
    report: dict = {"file": path, "gpu": gpu_uuid}
    buf = None
    message: dict
    fds: list[int] = []
    try:
        try:
            driver = Driver()
            device = driver.device_by_uuid(bytes.fromhex(gpu_uuid.removeprefix("GPU-").replace("-", "")))
            driver.use_primary_context(device)
            report["cuda_init_s"] = round(time.monotonic() - t0, 4)
            base, length = data_section(path)
            buf = ExportableBuffer(driver, device, length)
            fd = os.open(path, os.O_RDONLY)
            try:
                t1 = time.monotonic()
                fill(driver, device, buf.ptr, fd, base, length, threads)
                load_s = time.monotonic() - t1
            finally:
                os.close(fd)
            fds = [buf.export_fd()]
            message = {"bytes": length, "alloc_bytes": buf.size, "offset": base, "identity": file_identity(path)}
            report.update(bytes=length, load_s=round(load_s, 4), gb_per_s=round(length / load_s / 1e9, 2),
                          threads=threads, ready_s=round(time.monotonic() - t0, 4))
        except Exception as e:  # noqa: BLE001 - whatever it is, the engine hears it and reloads from the file
            message = {"error": f"{type(e).__name__}: {e}"}
            report["error"] = message["error"]
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            report["served"] = False
            return report
        os.unlink(sock_path)  # one engine only; and the restore knows from it that this one was served
        with conn:
            conn.settimeout(timeout)
            socket.send_fds(conn, [json.dumps(message).encode()], fds)
            report["served"] = True
            conn.recv(1)  # the engine closes once it has mapped the memory; ours can go then
        report["total_s"] = round(time.monotonic() - t0, 4)
        if hold:
            sys.stdin.buffer.read()
        return report
    finally:
        for fd in fds:
            os.close(fd)
        if buf is not None:
            buf.close()
        listener.close()
        try:
            os.unlink(sock_path)
        except FileNotFoundError:
            pass


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coldsnap.gpu.prefetch", description=__doc__.split("\n\n")[0])
    p.add_argument("--file", required=True, help="the safetensors file whose data section to load")
    p.add_argument("--gpu", required=True, help="the GPU's UUID (GPU-…), as NVML names it")
    p.add_argument("--socket", required=True, help="UNIX socket path to serve the memory at (created, 0600)")
    p.add_argument("--threads", type=int, default=8, help="parallel readers (default 8)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the engine (default 120)")
    p.add_argument("--hold", action="store_true", help="once served, free nothing until stdin closes")
    a = p.parse_args(argv)
    watchdog = threading.Timer(a.timeout + 30, os._exit, args=(3,))  # never linger holding GPU memory
    watchdog.daemon = True
    watchdog.start()
    report = serve(a.file, a.gpu, a.socket, max(1, a.threads), a.timeout, a.hold)
    print(json.dumps(report), flush=True)
    return 0 if report.get("served") and "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
