"""Where a streamed pull's time goes, on the machine it runs on: one weights-sized blob in a registry on loopback,
fetched (1) as plain ranged GETs (the ceiling: no hashing, nothing kept), (2) by a pull by pieces to disk (`coldsnap
pull`: threads of the pulling process, into the one partial file), (3) by a restore's pull by pieces into memory
(the spool: a memfd per piece, fetched by processes of their own), each checked against its pins, with 8 and 16
connections. Prints one JSON line per variant (GB/s) and a summary line. `pull-rate.py hash` measures only what
each byte costs: sha256 and blake3 on one core and on all, and writes into memfds.

    python3 packaging/device/pull-rate.py [GIB]     (docker-registry on PATH; default 8 GiB)"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from coldsnap.base.digests import chunk_digests
from coldsnap.capsule import pieces
from coldsnap.capsule.fetcher import PlainClient
from coldsnap.contracts import WeightFile
from coldsnap_bench.coldnode import _read_range, _spans, _timed_parallel
from coldsnap_bench.registry import LocalRegistry


def hash_rates() -> dict:
    """GB/s of hashing 1 GiB in 16 MiB calls: sha256 on one thread and on a thread per core, blake3 (where its
    package is here) on one thread and on all of them; and of writing it into a memfd from a thread per core."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    data = os.urandom(16 << 20)
    total = 1 << 30
    cores = os.cpu_count() or 1
    out = {}

    def timed(fn, threads: int) -> float:
        t = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: fn(), range(threads)))
        return round(threads * total / (time.monotonic() - t) / 1e9, 2)

    def sha() -> None:
        h = hashlib.sha256()
        for _ in range(total // len(data)):
            h.update(data)

    out["sha256_1"], out[f"sha256_{cores}"] = timed(sha, 1), timed(sha, cores)
    try:
        import blake3

        def b3() -> None:
            h = blake3.blake3()
            for _ in range(total // len(data)):
                h.update(data)

        out["blake3_1"], out[f"blake3_{cores}"] = timed(b3, 1), timed(b3, cores)
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        t = time.monotonic()
        for _ in range(total // len(data)):
            h.update(data)
        out["blake3_1_auto_threads"] = round(total / (time.monotonic() - t) / 1e9, 2)
    except ImportError:
        out["blake3"] = "not installed"

    def spool() -> None:
        fd = os.memfd_create("rate")
        try:
            for k in range(total // len(data)):
                os.pwrite(fd, data, k * len(data))
        finally:
            os.close(fd)

    out[f"memfd_write_{cores}"] = timed(spool, cores)
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    out["cpu_flags"] = [x for x in ("sha_ni", "avx2", "avx512f", "vaes") if x in flags]
    return out


def main() -> None:
    print(json.dumps({"hash": hash_rates()}), flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "hash":
        return
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    size = int(gib * (1 << 30))
    tmp = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp")))
    blob = tmp / "blob"
    block = os.urandom(64 << 20)
    with open(blob, "wb") as f:
        for at in range(0, size, len(block)):
            f.write(block[:size - at])
    cb = 256 << 20
    pins = chunk_digests(blob, cb, "blake3")
    import hashlib

    h = hashlib.sha256()
    with open(blob, "rb") as f:
        while data := f.read(64 << 20):
            h.update(data)
    digest = "sha256:" + h.hexdigest()
    wf = WeightFile(path=str(tmp / "w"), sha256=digest[7:], size=size, chunks=pins, chunk_bytes=cb,
                    chunk_digest="blake3")
    reg = LocalRegistry.start(tmp / "registry")
    try:
        assert reg.hold("t/b", digest, blob)
        url = f"http://{reg}/v2/t/b/blobs/{digest}"
        _read_range(url, 0, size)  # the registry's storage in the page cache
        rows = []
        for n in (8, 16):
            rows.append({"variant": "plain ranged GETs", "connections": n,
                         "gb_per_s": round(_timed_parallel(lambda o, k: _read_range(url, o, k), _spans(size, n)), 2)})
        for n in (8, 16):
            os.environ["COLDSNAP_PULL_CONNECTIONS"] = str(n)
            for spool in ("0", "1"):
                os.environ["COLDSNAP_PULL_SPOOL"] = spool
                part = tmp / f"part-{n}-{spool}"
                arrivals = pieces.Arrivals() if spool == "1" else None
                t = time.monotonic()
                done: dict = {}
                pull = threading.Thread(target=lambda d=done, p=part, a=arrivals: d.update(
                    r=pieces.fetch_by_pieces(PlainClient, url, p, size, wf, "bench", arrivals=a, digest=digest)))
                pull.start()
                if arrivals is not None:
                    arrivals.whole(digest, timeout=600)  # every piece checked, in memory
                    took = time.monotonic() - t
                    arrivals.allow_sync()
                    pull.join()
                    written = time.monotonic() - t
                else:
                    pull.join()
                    took = written = time.monotonic() - t
                rows.append({"variant": "pull by pieces into memory (spool)" if arrivals else "pull by pieces to disk",
                             "connections": n, "gb_per_s": round(size / took / 1e9, 2),
                             "on_disk_s": round(written, 2), "checked": "r" in done})
                part.unlink(missing_ok=True)
        for row in rows:
            print(json.dumps(row), flush=True)
        print(json.dumps({"summary": {f"{r['variant']} x{r['connections']}": r["gb_per_s"] for r in rows},
                          "bytes": size, "cpus": os.cpu_count()}))
    finally:
        reg.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
