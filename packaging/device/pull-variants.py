"""What a streamed pull into memory could do on the machine it runs on: one weights-sized blob in a registry on
loopback, fetched into a memfd per 256 MiB piece by fetching processes, each piece hashed as it arrives, in variants
side by side in one run: how the bytes are received (requests' chunks written with pwrite, as the pull does now, or
received straight into the memfd's mapping), which hash checks them (sha256, blake3, none: the ceiling), how the
connections are spread over processes, and whether the memfds' pages are made before the bytes arrive (first, or
beside the fetch: PREFAULT_BESIDE=1); WHERE_TIME=1: the receive alone into one reused buffer (the ceiling of
receiving), the pages made first, 2 MiB pages where the kernel allows them for shmem, 32 connections; IN_ONE=1: the
receive alone with every connection in one process (its GIL), reads of 1 or 8 MiB. Prints a JSON line per variant
(GB/s) and a summary line.

    python3 packaging/device/pull-variants.py [GIB]     (docker-registry on PATH; default 8 GiB)"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

PIECE = 256 << 20
READ = 1 << 20


def _hasher(name: str):
    if name == "sha256":
        return hashlib.sha256()
    if name == "blake3":
        import blake3
        return blake3.blake3()
    return None


def worker() -> int:
    """One fetching process: stdin {"url", "threads", "mode", "hash", "pieces": [[offset, length, pin, fd]]}."""
    import requests

    job = json.loads(sys.stdin.readline())
    local = threading.local()

    def one(p: list) -> bool:
        offset, length, pin, fd = p
        if not hasattr(local, "s"):
            local.s = requests.Session()
        h = _hasher(job["hash"])
        r = local.s.get(job["url"], headers={"Range": f"bytes={offset}-{offset + length - 1}"}, stream=True)
        with r:
            at = 0
            if job["mode"].startswith("discard"):  # into one reused buffer, nothing kept: the receive's ceiling
                size = READ * int(job["mode"].removeprefix("discard") or 1)  # discard8: 8 MiB a read
                buf = memoryview(bytearray(size))
                fp = r.raw._fp
                while at < length:
                    n = fp.readinto(buf[:min(size, length - at)])
                    if not n:
                        break
                    if h:
                        h.update(buf[:n])
                    at += n
            elif job["mode"] == "pwrite":
                for chunk in r.iter_content(READ):
                    if h:
                        h.update(chunk)
                    os.pwrite(fd, chunk, at)
                    at += len(chunk)
            else:
                m = mmap.mmap(fd, length)
                if job["mode"] == "hugemap":  # the memfd's pages made 2 MiB at a time, where shmem_enabled allows
                    m.madvise(mmap.MADV_HUGEPAGE)
                mv = memoryview(m)
                fp = r.raw._fp  # http.client's response: its readinto receives into the buffer itself (urllib3's
                try:  # reads a bytes object, then copies it in)
                    while at < length:
                        n = fp.readinto(mv[at:at + READ])
                        if not n:
                            break
                        if h:
                            h.update(mv[at:at + n])
                        at += n
                finally:
                    mv.release()
                    m.close()
        return at == length and (h is None or h.hexdigest() == pin)

    with ThreadPoolExecutor(job["threads"]) as pool:
        ok = all(pool.map(one, job["pieces"]))
    print("ok" if ok else "bad", flush=True)
    return 0


def run(url: str, size: int, pins: dict, procs: int, threads: int, mode: str, hashname: str,
        prefault: bool | str) -> dict:
    pieces = [(o, min(PIECE, size - o)) for o in range(0, size, PIECE)]
    fds = []
    for _, n in pieces:
        fds.append(os.memfd_create("v"))
        os.ftruncate(fds[-1], n)
    t = time.monotonic()
    if prefault is True:  # the pages made first (as a pull could while it waits on the network), a thread per core
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(lambda k: os.posix_fallocate(fds[k], 0, pieces[k][1]), range(len(fds))))
    t_fault = time.monotonic() - t
    t = time.monotonic()
    beside = None
    if prefault == "beside":  # the pages made while the pieces come, in the order they are asked for, on 2 threads
        # (fallocate keeps a page already written: a piece that overtakes its prefault loses nothing); timed
        beside = ThreadPoolExecutor(2)
        beside_done = beside.map(lambda k: os.posix_fallocate(fds[k], 0, pieces[k][1]), range(len(fds)))
    ps = []
    for k in range(procs):
        mine = [[o, n, pins[hashname][i], fds[i]] for i, (o, n) in enumerate(pieces) if i % procs == k]
        p = subprocess.Popen([sys.executable, __file__, "worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             pass_fds=[x[3] for x in mine])
        p.stdin.write(json.dumps({"url": url, "threads": threads, "mode": mode, "hash": hashname,
                                  "pieces": mine}).encode() + b"\n")
        p.stdin.close()
        ps.append(p)
    ok = all(p.stdout.read().strip() == b"ok" for p in ps) and all(p.wait() == 0 for p in ps)
    if beside is not None:
        list(beside_done)
        beside.shutdown()
    took = time.monotonic() - t
    for fd in fds:
        os.close(fd)
    return {"processes": procs, "threads": threads, "receive": mode, "hash": hashname, "prefault": prefault,
            "gb_per_s": round(size / took / 1e9, 2), "prefault_s": round(t_fault, 2), "ok": ok}


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        sys.exit(worker())
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from coldsnap_bench.registry import LocalRegistry

    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    size = int(gib * (1 << 30))
    tmp = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp")))
    blob = tmp / "blob"
    block = os.urandom(64 << 20)
    with open(blob, "wb") as f:
        for at in range(0, size, len(block)):
            f.write(block[:size - at])
    pins: dict = {"none": [None] * (-(-size // PIECE))}
    for name in ("sha256", "blake3"):
        try:
            pins[name] = []
            with open(blob, "rb") as f:
                while data := f.read(PIECE):
                    h = _hasher(name)
                    h.update(data)
                    pins[name].append(h.hexdigest())
        except ImportError:
            del pins[name]
    h = hashlib.sha256()
    with open(blob, "rb") as f:
        while data := f.read(64 << 20):
            h.update(data)
    digest = "sha256:" + h.hexdigest()
    reg = LocalRegistry.start(tmp / "registry")
    try:
        assert reg.hold("t/b", digest, blob)
        url = f"http://{reg}/v2/t/b/blobs/{digest}"
        run(url, size, pins, 4, 4, "pwrite", "none", False)  # the registry's storage in the page cache
        variants = [(4, 4, "pwrite", "sha256", False),  # as the pull was before the fetchers received in place
                    (4, 4, "readinto", "sha256", False),  # as it is now, with a capsule pinned by sha256
                    (4, 4, "readinto", "blake3", False),  # as it is now, with a capsule pinned by blake3
                    (4, 4, "pwrite", "blake3", False),
                    (4, 4, "readinto", "none", False),  # the ceiling: nothing hashed
                    (4, 4, "readinto", "sha256", False)]  # again, last: how much the machine drifted
        if os.environ.get("PREFAULT_BESIDE"):  # the pull as it is, with and without its pages made beside it, in turns
            variants = [(4, 4, "pwrite", "blake3", False), (4, 4, "pwrite", "blake3", "beside")] * 3
        if os.environ.get("WHERE_TIME"):  # what the receive alone moves, what making the pages costs, in turns
            variants = [(4, 4, "discard", "none", False), (4, 4, "discard", "blake3", False),
                        (4, 4, "pwrite", "blake3", False), (4, 4, "pwrite", "blake3", "beside"),
                        (4, 4, "readinto", "blake3", True), (4, 4, "hugemap", "blake3", False),
                        (8, 4, "pwrite", "blake3", False), (4, 4, "pwrite", "blake3", False)]
            for f in ("enabled", "shmem_enabled", "defrag"):
                with suppress(OSError):
                    print(f"transparent_hugepage/{f}:", Path(f"/sys/kernel/mm/transparent_hugepage/{f}").read_text()
                          .strip(), flush=True)
        if os.environ.get("IN_ONE"):  # the receive's ceiling with every connection in one process (one GIL)
            variants = [(4, 4, "discard", "blake3", False), (1, 16, "discard", "blake3", False),
                        (1, 16, "discard8", "blake3", False), (2, 8, "discard8", "blake3", False),
                        (4, 4, "discard8", "blake3", False), (1, 8, "discard8", "blake3", False),
                        (1, 16, "discard8", "none", False), (4, 4, "discard", "blake3", False)]
        if os.environ.get("ALL_VARIANTS"):
            variants += [(8, 2, "readinto", "sha256", False), (16, 1, "readinto", "sha256", False),
                         (8, 2, "readinto", "sha256", True), (8, 2, "readinto", "none", True)]
        rows = []
        for v in variants:
            if v[3] not in pins:
                continue
            rows.append(run(url, size, pins, *v))
            print(json.dumps(rows[-1]), flush=True)
        label = {False: "", True: " prefault", "beside": " prefault beside"}
        print(json.dumps({"summary": [[f"{r['processes']}x{r['threads']} {r['receive']} {r['hash']}"
                                       f"{label[r['prefault']]}", r["gb_per_s"]] for r in rows],
                          "bytes": size, "cpus": os.cpu_count()}))
    finally:
        reg.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
