"""The prefetcher's two ways onto the GPU, side by side on one file in the page cache (GPU machine only).

`buffered` reads the file into pinned buffers and copies those; `mapped` registers the file's own pages (a read-only
shared mapping) with the driver and copies from them. Both are coldsnap.gpu.prefetch's fills, run here on a file of
--gib GiB with a safetensors-like header (so the data section starts off a page boundary), each way --repeat times
in turns, each result checked against the file at --checks places. Prints one JSON document (also to --out).

    python3 packaging/device/prefetch-modes.py --gib 10 --out $OUT/prefetch-modes-h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.getcwd())

from coldsnap.gpu.prefetch import data_section, fill_buffered, fill_mapped, whole_section  # noqa: E402
from coldsnap.gpu.vmm import Driver, ExportableBuffer  # noqa: E402

HEADER = b'{"__metadata__":{"probe":"prefetch-modes"}}'


def make_file(path: str, gib: float) -> int:
    """A file of about gib GiB: 8-byte header length, a header, then 64 MiB blocks each of its own bytes."""
    size = int(gib * (1 << 30))
    if os.path.exists(path) and os.path.getsize(path) == 8 + len(HEADER) + size:
        return size
    block = bytearray(random.Random(7).randbytes(64 << 20))
    with open(path, "wb") as f:
        f.write(len(HEADER).to_bytes(8, "little") + HEADER)
        for i in range(0, size, len(block)):
            block[:8] = i.to_bytes(8, "little")  # every block differs: a misplaced copy shows
            f.write(block[:min(len(block), size - i)])
    return size


def warm(path: str) -> float:
    t = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 << 20)
        while f.readinto(buf):
            pass
    return time.monotonic() - t


def check(driver: Driver, ptr: int, fd: int, base: int, length: int, n: int) -> int:
    """Bytes compared between the GPU and the file at n places (always both ends); raises on a difference."""
    rnd, compared = random.Random(n), 0
    places = [0, max(0, length - 4096)] + [rnd.randrange(0, length - 4096) for _ in range(n)]
    for at in places:
        want = os.pread(fd, 4096, base + at)
        got = ctypes.create_string_buffer(len(want))
        driver.call("cuMemcpyDtoH_v2", got, ptr + at, len(want))
        if got.raw != want:
            raise SystemExit(f"mismatch at data offset {at}")
        compared += len(want)
    return compared


def dma_rates(driver: Driver, ptr: int, fd: int, base: int, length: int, streams_list=(1, 4, 8)) -> list[dict]:
    """Copy rates alone (no registration on the clock): the file's mapping registered whole, a pinned allocation of
    the driver's (cuMemHostAlloc) and anonymous memory registered, each copied on 1, 4, 8 streams, twice: the best
    rate, and the first copy's (the first DMA from memory just registered)."""
    from coldsnap.gpu.prefetch import FileMapping
    from coldsnap.gpu.vmm import HOSTREGISTER_READ_ONLY, STREAM_NON_BLOCKING

    n = min(length, 4 << 30)
    out = []
    mapping = FileMapping(fd)
    addr, maplen, src = mapping.addr, n + base + 4096 - (n + base) % 4096, mapping.addr + base
    t = time.monotonic()
    driver.call("cuMemHostRegister_v2", ctypes.c_void_p(addr), maplen, HOSTREGISTER_READ_ONLY)
    sources = [("page-cache mapping", src, time.monotonic() - t)]
    host = ctypes.c_void_p()
    driver.call("cuMemHostAlloc", ctypes.byref(host), n, 0)
    ctypes.memset(host, 1, n)
    sources.append(("cuMemHostAlloc", host.value, None))
    anon_map = mmap.mmap(-1, n)
    anon = ctypes.addressof(ctypes.c_char.from_buffer(anon_map))
    ctypes.memset(anon, 1, n)
    t = time.monotonic()
    driver.call("cuMemHostRegister_v2", ctypes.c_void_p(anon), n, 0)
    sources.append(("anonymous, registered", anon, time.monotonic() - t))
    try:
        for name, at, reg_s in sources:
            for k in streams_list:
                ss = [ctypes.c_void_p() for _ in range(k)]
                for s in ss:
                    driver.call("cuStreamCreate", ctypes.byref(s), STREAM_NON_BLOCKING)
                part = n // k
                took = []
                for _ in range(2):
                    t = time.monotonic()
                    for i, s in enumerate(ss):
                        driver.call("cuMemcpyHtoDAsync_v2", ptr + i * part, at + i * part, part, s)
                    for s in ss:
                        driver.call("cuStreamSynchronize", s)
                    took.append(time.monotonic() - t)
                best = min(took)
                for s in ss:
                    driver.lib.cuStreamDestroy_v2(s)
                out.append({"source": name, "streams": k, "bytes": part * k,
                            "gb_per_s": round(part * k / best / 1e9, 2),
                            "first_copy_gb_per_s": round(part * k / took[0] / 1e9, 2),
                            **({"register_s": round(reg_s, 4)} if reg_s is not None else {})})
                print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    finally:
        driver.lib.cuMemHostUnregister(ctypes.c_void_p(addr))
        mapping.close()
        driver.lib.cuMemFreeHost(host)
        driver.lib.cuMemHostUnregister(ctypes.c_void_p(anon))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/coldsnap-probe", help="where the file goes (default /tmp/coldsnap-probe)")
    p.add_argument("--gib", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--checks", type=int, default=64)
    p.add_argument("--ways", default="buffered:8,mapped:8,mapped:4,mapped:8:256:16,mapped:8:64,mapped:8:1024",
                   help="comma-separated MODE:THREADS[:WINDOW_MIB[:COPY_MIB]] (window, copy: mapped only); "
                        "hybrid:THREADS:SHARE maps the first SHARE of the file and reads the rest with THREADS")
    p.add_argument("--dma", action="store_true", help="first, copy rates alone from each kind of host memory")
    p.add_argument("--out")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "probe.safetensors")
    t = time.monotonic()
    make_file(path, a.gib)
    made_s = time.monotonic() - t
    warm_s = warm(path)
    base, length = data_section(path)
    fs = subprocess.run(["stat", "-f", "-c", "%T", a.dir], capture_output=True, text=True).stdout.strip()
    driver = Driver()
    device = 0
    driver.use_primary_context(device)
    buf = ExportableBuffer(driver, device, length)
    driver.call("cuMemsetD8_v2", buf.ptr, 0, length)
    fd = os.open(path, os.O_RDONLY)
    runs = []
    dma = dma_rates(driver, buf.ptr, fd, base, length) if a.dma else []
    try:
        for r in range(a.repeat):
            for way in a.ways.split(","):
                mode, threads, *chunk = way.split(":")
                t = time.monotonic()
                extra: dict = {}
                if mode == "mapped":
                    kw = {"window": int(chunk[0]) << 20} if chunk else {}
                    if len(chunk) > 1:
                        kw["copy"] = int(chunk[1]) << 20
                    extra, release = fill_mapped(driver, device, buf.ptr, fd, base, whole_section(length),
                                                 int(threads), **kw)
                    extra["unregister_s"] = release()  # after the clock: a restore does it once it served
                elif mode == "hybrid":  # the first share mapped, the rest buffered, at once
                    cut = int(length * float(chunk[0])) if chunk else length // 2
                    cut -= cut % 4096
                    with ThreadPoolExecutor(2) as pool:
                        m = pool.submit(fill_mapped, driver, device, buf.ptr, fd, base, [(0, cut, 1, cut)], 2)
                        b = pool.submit(fill_buffered, driver, device, buf.ptr + cut, fd, base + cut,
                                        whole_section(length - cut), int(threads))
                        extra, release = m.result()
                        b.result()
                    extra["unregister_s"] = release()
                else:
                    fill_buffered(driver, device, buf.ptr, fd, base, whole_section(length), int(threads))
                s = time.monotonic() - t
                compared = check(driver, buf.ptr, fd, base, length, a.checks)
                runs.append({"way": way, "round": r, "s": round(s, 4), "gb_per_s": round(length / s / 1e9, 2),
                             "bytes_checked": compared, **extra})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
                driver.call("cuMemsetD8_v2", buf.ptr, 0, length)  # the next way starts from zeros
    finally:
        os.close(fd)
        buf.close()
    doc = {"command": " ".join(["python3", *sys.argv]), "kernel": platform.release(), "filesystem": fs,
           "bytes": length, "file_written_s": round(made_s, 2), "warm_read_s": round(warm_s, 2),
           "warm_read_gbs": round(length / warm_s / 1e9, 2), "dma": dma, "runs": runs}
    print(json.dumps(doc, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
