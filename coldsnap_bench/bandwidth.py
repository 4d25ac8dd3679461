"""Bandwidths that bound a restore, measured in the same run as the benchmark (the physical limit beside each
figure): host memcpy, reading a file from page cache, from disk (cold-cache benches), pinned host→device copies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
out = {}
def parallel_read_gbs(path, threads, chunk):  # `threads` threads reading the whole file, `chunk` preads each
    size = os.path.getsize(path); fd = os.open(path, os.O_RDONLY)
    bufs = [bytearray(chunk) for _ in range(threads)]
    def part(i):
        mv = memoryview(bufs[i])
        for off in range(i * chunk, size, threads * chunk):
            os.preadv(fd, [mv], off)
    with ThreadPoolExecutor(threads) as readers:
        t = time.perf_counter(); list(readers.map(part, range(threads)))
    os.close(fd)
    return size / (time.perf_counter() - t) / 1e9
def best_read_gbs(path):  # a limit must be the best the host does: the best of a few ways, each twice
    ways = {(threads, 64 << 20), (threads, 8 << 20), (min(2 * threads, os.cpu_count() or 1), 8 << 20)}
    rate, way = max((parallel_read_gbs(path, n, c), (n, c)) for n, c in sorted(ways) for _ in range(2))
    out["page_cache_read_parallel_way"] = {"threads": way[0], "read_mib": way[1] >> 20}
    return rate
threads = max(1, min(8, os.cpu_count() or 1))  # what the weight hydrate uses (coldsnap_reference/weights.load_into)
pool = ThreadPoolExecutor(threads)
n = 1 << 30
a = np.ones(n, dtype=np.uint8); b = np.empty_like(a)
np.copyto(b, a); t = time.perf_counter(); np.copyto(b, a); out["host_memcpy_gbs"] = n / (time.perf_counter() - t) / 1e9
step = n // threads
t = time.perf_counter()
list(pool.map(lambda i: np.copyto(b[i * step:(i + 1) * step], a[i * step:(i + 1) * step]), range(threads)))
out["host_memcpy_parallel_gbs"] = step * threads / (time.perf_counter() - t) / 1e9
path = sys.argv[1] if len(sys.argv) > 1 else ""
if path and os.path.exists(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:  # read once first: the timed reads are from page cache
        while f.read(64 << 20): pass
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 << 20); mv = memoryview(buf)
        while f.readinto(mv): pass
    out["page_cache_read_gbs"] = size / (time.perf_counter() - t) / 1e9
    out["page_cache_read_parallel_gbs"] = best_read_gbs(path)
cold = sys.argv[2] if len(sys.argv) > 2 else ""
if cold and os.path.exists(cold):  # from disk: the page cache dropped first, then the same parallel reads
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    out["disk_read_parallel_gbs"] = parallel_read_gbs(cold, threads, 64 << 20)
    out["disk_read_bytes"] = os.path.getsize(cold)
out["threads"] = threads
try:
    import torch
    if torch.cuda.is_available():
        m = 4 << 30
        h = torch.empty(m, dtype=torch.uint8).pin_memory(); d = torch.empty(m, dtype=torch.uint8, device="cuda")
        d.copy_(h); torch.cuda.synchronize()
        t = time.perf_counter(); d.copy_(h, non_blocking=True); torch.cuda.synchronize()
        out["pinned_h2d_gbs"] = m / (time.perf_counter() - t) / 1e9
except Exception as e:
    out["h2d_error"] = str(e)
print(json.dumps(out))
"""


def measure(sample_file: Path | None = None, cold_file: Path | None = None) -> dict:
    """sample_file: read from page cache (twice, timing the second). cold_file: read from disk, after dropping the
    page cache (root only; for benches whose samples run with the cache dropped)."""
    r = subprocess.run([sys.executable, "-c", PROBE, str(sample_file or ""), str(cold_file or "")],
                       capture_output=True, text=True, timeout=600)
    try:
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in json.loads(r.stdout).items()}
    except ValueError:
        return {"error": (r.stderr or r.stdout)[-300:]}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def restore_limit(bw: dict, images_bytes: int, weights_bytes: int, weights_in_images: bool,
                  from_disk: bool = False) -> dict:
    """Lower bound of a restore's data movement: CRIU's images pass through host memory once (page cache →
    process pages, a memcpy); GPU state then crosses PCIe (pinned H2D). With the weights in the images (native,
    an engine that cannot save them) the GPU state is inside the images (counted for both); with the weights apart
    (recovery's pinned file, native's saved payload) their file is read from page cache and copied to the GPU.
    Host copies count at the parallel rate (several threads), since a restore may use several: the hydrate does.
    from_disk (page cache dropped before each sample): every byte, images and weights, is first read from disk at
    the parallel disk rate measured; without that rate there is no limit to give."""
    memcpy = bw.get("host_memcpy_parallel_gbs") or bw.get("host_memcpy_gbs") or 0
    read = bw.get("page_cache_read_parallel_gbs") or memcpy
    h2d = bw.get("pinned_h2d_gbs") or 0
    if from_disk:
        read = bw.get("disk_read_parallel_gbs") or 0
        if not read:
            return {}
        memcpy = min(memcpy, read) if memcpy else read
    if not memcpy:
        return {}
    host_s = images_bytes / (memcpy * 1e9)
    gpu_bytes = images_bytes if weights_in_images else weights_bytes
    gpu_s = gpu_bytes / (min(h2d, memcpy, read) * 1e9) if h2d else 0.0
    return {"images_bytes": images_bytes, "gpu_bytes_upper": gpu_bytes, "host_s": round(host_s, 3),
            "gpu_s": round(gpu_s, 3), "limit_s": round(host_s + gpu_s, 3),
            "source": "disk (parallel reads, page cache dropped)" if from_disk else "page cache",
            "assumption": "bytes / measured bandwidth (host copies at the parallel rate); weights in the images "
                          "count all image bytes as GPU bytes (an upper bound)"}
