"""How much a busy thread slows a restore's pull of its capsule's own blobs, and what the GIL's switch interval does
about it: BLOBS blobs of MIB MiB (random, like compressed CRIU images) in a registry on loopback, fetched side by
side by ColdSnap's own blob download (requests, the hashing and writing threads), with 0 or 1 thread computing in
pure Python beside them (as an import or an admission does), at Python's default switch interval (5 ms) and at
the one a pull sets (coldsnap.flows.fetch.PULL_SWITCH_INTERVAL_S). Best of 3 each; prints a JSON line per case.

    python3 packaging/device/pull-gil.py [MIB] [BLOBS]     (docker-registry on PATH; default 85 MiB x 4)"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from coldsnap.capsule.registry import _download
from coldsnap.capsule.remote import Client, parse_remote
from coldsnap.capsule.store import Descriptor
from coldsnap.flows.fetch import PULL_SWITCH_INTERVAL_S
from coldsnap_bench.registry import LocalRegistry


def _blobs(reg: str, count: int, size: int) -> list[Descriptor]:
    descs = []
    for _ in range(count):
        data = os.urandom(size)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        location = requests.post(f"http://{reg}/v2/gil/blobs/uploads/", timeout=30).headers["Location"]
        location = location if location.startswith("http") else f"http://{reg}{location}"
        sep = "&" if "?" in location else "?"
        requests.put(f"{location}{sep}digest={digest}", data=data, timeout=60).raise_for_status()
        descs.append(Descriptor("application/octet-stream", digest, size))
    return descs


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(1000))


def _case(reg: str, work: Path, descs: list[Descriptor], busy: int, interval: float) -> dict:
    default = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    stop = threading.Event()
    hogs = [threading.Thread(target=_busy, args=(stop,)) for _ in range(busy)]
    for h in hogs:
        h.start()
    times = []
    try:
        for _ in range(3):
            parts = [work / f"part{i}" for i in range(len(descs))]
            for p in parts:
                p.unlink(missing_ok=True)
            t0 = time.monotonic()
            threads = [threading.Thread(target=_download, args=(Client(parse_remote(f"{reg}/gil@{d.digest}"), True),
                                                                d, p, None)) for d, p in zip(descs, parts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times.append(time.monotonic() - t0)
    finally:
        stop.set()
        for h in hogs:
            h.join()
        sys.setswitchinterval(default)
    total = sum(d.size for d in descs)
    return {"busy_threads": busy, "switch_interval_ms": interval * 1000, "best_s": round(min(times), 4),
            "gb_per_s": round(total / min(times) / 1e9, 2), "samples_s": [round(t, 4) for t in times]}


def main() -> int:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 85
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    work = Path(tempfile.mkdtemp(prefix="pull-gil-"))
    reg = LocalRegistry.start(work / "registry")
    try:
        descs = _blobs(reg, count, mib << 20)
        for busy in (0, 1):
            for interval in (sys.getswitchinterval(), PULL_SWITCH_INTERVAL_S):
                print(json.dumps({"blobs": count, "mib": mib, "cpus": os.cpu_count(),
                                  **_case(reg, work, descs, busy, interval)}), flush=True)
    finally:
        reg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
