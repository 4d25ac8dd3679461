"""Push/pull throughput of a large capsule against a private local registry, compared with curl.

Not a test: `python -m coldsnap_bench.registry OUT_DIR [SIZE_MIB]` (or `run(out_dir)`) writes
OUT_DIR/registry_bench.json. Every push/pull runs in a fresh subprocess that reports its own peak RSS
(ru_maxrss), so the numbers are those of one ColdSnap process doing one transfer.

Also home of LocalRegistry: a throwaway `docker-registry serve` on 127.0.0.1 (tests use it too).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ENSURE = Path(__file__).resolve().parents[1] / "packaging" / "registry" / "ensure.sh"

CONFIG = """version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
  secret: coldsnap-test-only
  headers:
    X-Content-Type-Options: [nosniff]
{auth}"""


def ensure_registry_binary() -> str:
    """docker-registry on PATH, installing it (packaging/registry/ensure.sh) when missing."""
    if not shutil.which("docker-registry"):
        subprocess.run([str(ENSURE)], check=True)
    return shutil.which("docker-registry") or "docker-registry"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRegistry(str):
    """'127.0.0.1:PORT' of a running private registry; .storage is its filesystem root (for tampering)."""

    proc: subprocess.Popen
    storage: Path
    workdir: Path
    log: Path

    @classmethod
    def start(cls, workdir: Path, htpasswd: Path | None = None, timeout: float = 30.0) -> "LocalRegistry":
        binary = ensure_registry_binary()
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        storage = workdir / "storage"
        storage.mkdir(exist_ok=True)
        auth = (f"auth:\n  htpasswd:\n    realm: coldsnap-test\n    path: {htpasswd}\n" if htpasswd else "")
        for _ in range(5):  # the free port may be taken between probing and binding: try another
            port = free_port()
            config = workdir / "config.yml"
            config.write_text(CONFIG.format(storage=storage, port=port, auth=auth))
            log = workdir / "registry.log"
            with open(log, "ab") as lf:
                proc = subprocess.Popen([binary, "serve", str(config)], stdout=lf, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
            self = cls(f"127.0.0.1:{port}")
            self.proc, self.storage, self.workdir, self.log = proc, storage, workdir, log
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    urllib.request.urlopen(f"http://{self}/v2/", timeout=1).close()
                    return self
                except urllib.error.HTTPError as e:  # 401 with auth configured: it is up
                    if e.code == 401:
                        return self
                except OSError:
                    pass
                time.sleep(0.05)
            self.stop()
        raise RuntimeError(f"docker-registry did not start; its log: {log.read_text()[-2000:]}")

    def hold(self, repo: str, digest: str, path: Path) -> bool:
        """Put a blob into the registry's storage as an upload to `repo` leaves it (distribution 2.8's layout: the
        blob's data, and the repository's link to it), by hard link: a bench with tens of GB of weights keeps one
        copy on disk instead of two, and the push finds the blob there. False when it cannot be linked."""
        algo, hexd = digest.split(":")
        v2 = self.storage / "docker" / "registry" / "v2"
        data = v2 / "blobs" / algo / hexd[:2] / hexd / "data"
        data.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, data)
        except FileExistsError:
            pass
        except OSError:
            return False
        link = v2 / "repositories" / repo / "_layers" / algo / hexd / "link"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.write_text(digest)
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "LocalRegistry":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the benchmark --------------------------------------------------------------------------------------------
def _child(argv: list[str]) -> None:
    """One transfer in this (fresh) process; prints a JSON line with seconds and peak RSS."""
    from coldsnap.capsule import registry
    from coldsnap.capsule.store import CapsuleStore

    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    op, store_dir, arg, ref = argv
    store = CapsuleStore(Path(store_dir))
    t = time.monotonic()
    if op == "push":
        res = registry.push(store, arg, ref, insecure=True)
        moved = res["bytes_transferred"]
    else:
        res = registry.pull(store, ref, insecure=True)
        moved = res.bytes_transferred
    secs = time.monotonic() - t
    print(json.dumps({"op": op, "seconds": round(secs, 3), "bytes": moved,
                      "MB_per_s": round(moved / secs / 1e6, 1),
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "rss_after_imports_mib": round(baseline_kib / 1024, 1)}))


def _settle() -> None:
    """Start every timed transfer with no dirty pages from the previous one (the disk is the slow part here)."""
    os.sync()
    time.sleep(1)


def _run_child(*args: str, env: dict | None = None) -> dict:
    _settle()
    cmd = [sys.executable, "-m", "coldsnap_bench.registry", "--child", *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **(env or {})}).stdout
    res = json.loads(out.strip().splitlines()[-1])
    res["command"] = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *cmd])
    return res


def _curl(args: list[str], settle: bool = True) -> tuple[float, str]:
    if settle:
        _settle()
    t = time.monotonic()
    out = subprocess.run(["curl", "-sS", "--fail", *args], check=True, capture_output=True, text=True).stdout
    return time.monotonic() - t, out


def _drop(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def run(out_dir, size_mib: int = 2048, repeats: int = 3) -> dict:
    """Create a capsule whose weights are one random size_mib file (pinned piece by piece, as a capture pins
    large weights), push/pull it `repeats` times, compare with curl."""
    from coldsnap.base.digests import pin_piece_bytes, pinned_digests
    from coldsnap.capsule.payload import put_weights
    from coldsnap.capsule.store import CapsuleStore, Descriptor
    from coldsnap.contracts import CapsuleProfile, HostProfile, Model, NetworkPlan, WeightFile
    from coldsnap.contracts import capsule as mt

    out = Path(out_dir).absolute()  # the weights file is pinned by its absolute path
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    _drop(work)
    work.mkdir()
    src = CapsuleStore(work / "src").init()
    weights_file = work / "model.safetensors"
    with open(weights_file, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(1 << 20))
    pinned = pinned_digests(weights_file)
    whole, chunks = pinned.sha256, pinned.chunks
    wf = WeightFile(path=str(weights_file), size=weights_file.stat().st_size, **pinned.fields())
    weights = put_weights(src, [wf])
    images = work / "images.bin"
    images.write_bytes(os.urandom(1 << 20))
    profile = CapsuleProfile(
        created="2026-11-29T00:00:00Z", snapshot_driver="criu-process",
        host=HostProfile(arch="x86_64", cpu_model="c", cpu_flags=[], kernel="k", criu_version="4.2.1"),
        engine={"name": "reference"}, weights_mode="recovery", kv_discarded=False, launch={}, validation={},
        expected_text="t", model=Model(id="bench", revision="r", weights=[wf]),
        network=NetworkPlan(netns="coldsnap-b", host_veth="csh0", workload_veth="eth0", host_address="169.254.237.1",
                            workload_address="169.254.237.2", port=8000))
    digest = src.write_capsule(profile, [src.put_file(images, mt.LAYER_CRIU, move=True), *weights],
                               {"io.coldsnap.engine": "reference"}, tag="bench")
    layer = Descriptor(mt.LAYER_WEIGHTS, "sha256:" + whole, wf.size)  # the weights blob: what the rows move
    blob = src.blob_path(layer.digest)
    result: dict = {"size_bytes": layer.size, "layer_digest": layer.digest, "manifest_digest": digest,
                    "pieces": len(chunks), "piece_bytes": pin_piece_bytes(),
                    "push": [], "pull": [], "pull_one_stream": [], "curl_put": [], "curl_get_devnull": [],
                    "curl_get_file": [], "pull_tmpfs": [], "pull_tmpfs_one_stream": []}
    shm = Path("/dev/shm") / f"coldsnap-registry-bench-{os.getpid()}"
    with LocalRegistry.start(work / "registry") as reg:
        base = f"http://{reg}/v2"
        for i in range(repeats):
            repo = f"bench/ours{i}"  # a new repository, and the blob deleted: the registry takes every byte again
            _drop(reg.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / layer.digest[7:9] /
                  layer.digest[7:])
            result["push"].append(_run_child("push", str(src.root), digest, f"{reg}/{repo}:v1"))
            # curl: monolithic upload (POST for a session, one PUT ?digest= with the whole file, streamed)
            _drop(reg.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / layer.digest[7:9] /
                  layer.digest[7:])
            _, hdrs = _curl(["-X", "POST", "-D", "-", "-o", "/dev/null", f"{base}/bench/curl{i}/blobs/uploads/"],
                            settle=False)
            loc = next(h.split(":", 1)[1].strip() for h in hdrs.splitlines() if h.lower().startswith("location:"))
            loc = loc if loc.startswith("http") else f"http://{reg}{loc}"
            cmd = ["-X", "PUT", "-H", "Content-Type: application/octet-stream", "-T", str(blob), "-o", "/dev/null",
                   f"{loc}{'&' if '?' in loc else '?'}digest={layer.digest}"]
            secs, _ = _curl(cmd)
            result["curl_put"].append({"seconds": round(secs, 3), "MB_per_s": round(layer.size / secs / 1e6, 1),
                                       "command": "curl -sS --fail " + " ".join(cmd)})
        for i in range(repeats):
            dst = work / f"dst{i}"
            # The pull (the weights by pieces, on several connections) and the same pull with one stream per blob,
            # hashed whole, in turns: first one, then the other, so neither always follows the same transfer.
            kinds = [("pull", {}), ("pull_one_stream", {"COLDSNAP_PULL_PIECES": "0"})]
            for key, env in kinds if i % 2 == 0 else kinds[::-1]:
                result[key].append(_run_child("pull", str(dst), "-", f"{reg}/bench/ours0:v1@{digest}", env=env))
                _drop(dst)
            # The same two into tmpfs: no disk, so the rate of the software itself.
            if shm.parent.is_dir() and shutil.disk_usage(shm.parent).free > 2 * layer.size:
                for key, env in (("pull_tmpfs", {}), ("pull_tmpfs_one_stream", {"COLDSNAP_PULL_PIECES": "0"})):
                    result[key].append(_run_child("pull", str(shm / f"dst{i}"), "-",
                                                  f"{reg}/bench/ours0:v1@{digest}", env=env))
                    _drop(shm / f"dst{i}")
            url = f"{base}/bench/ours0/blobs/{layer.digest}"
            secs, _ = _curl(["-o", "/dev/null", url])
            result["curl_get_devnull"].append({"seconds": round(secs, 3), "MB_per_s": round(layer.size / secs / 1e6, 1),
                                               "command": f"curl -sS --fail -o /dev/null {url}"})
            secs, _ = _curl(["-o", str(work / "curl.out"), url])
            t = time.monotonic()
            subprocess.run(["sync", str(work / "curl.out")], check=True)  # our pull fsyncs: so does this one
            secs += time.monotonic() - t
            (work / "curl.out").unlink()
            result["curl_get_file"].append({"seconds": round(secs, 3), "MB_per_s": round(layer.size / secs / 1e6, 1),
                                            "command": f"curl -sS --fail -o FILE {url} && sync FILE"})

    def best(key: str) -> float:
        return max(r["MB_per_s"] for r in result[key])

    def median(key: str) -> float:
        return statistics.median(r["MB_per_s"] for r in result[key])

    result["summary"] = {
        "push_MB_s": best("push"), "curl_put_MB_s": best("curl_put"),
        "push_vs_curl": round(best("push") / best("curl_put"), 2),
        "pull_MB_s": best("pull"), "curl_get_devnull_MB_s": best("curl_get_devnull"),
        "curl_get_file_fsynced_MB_s": best("curl_get_file"),
        "pull_vs_curl_devnull": round(best("pull") / best("curl_get_devnull"), 2),
        "pull_vs_curl_file_fsynced": round(best("pull") / best("curl_get_file"), 2),
        "pull_one_stream_MB_s": best("pull_one_stream"),
        "pull_vs_one_stream_median": round(median("pull") / median("pull_one_stream"), 2),
        "pull_tmpfs_MB_s": best("pull_tmpfs") if result["pull_tmpfs"] else None,
        "pull_tmpfs_vs_one_stream_median": (round(median("pull_tmpfs") / median("pull_tmpfs_one_stream"), 2)
                                            if result["pull_tmpfs"] else None),
        "pull_tmpfs_vs_curl_devnull": (round(best("pull_tmpfs") / best("curl_get_devnull"), 2)
                                       if result["pull_tmpfs"] else None),
        "median_MB_s": {k: median(k) for k in ("push", "curl_put", "pull", "pull_one_stream", "pull_tmpfs",
                                                "pull_tmpfs_one_stream", "curl_get_devnull", "curl_get_file")
                        if result[k]},
        "peak_rss_mib_push": max(r["peak_rss_mib"] for r in result["push"]),
        "peak_rss_mib_pull": max(r["peak_rss_mib"] for r in result["pull"] + result["pull_tmpfs"]),
    }
    result["command"] = f"coldsnap bench --registry --size-mib {size_mib} --samples {repeats} --out {out_dir}"
    _drop(work)
    _drop(shm)
    (out / "registry_bench.json").write_text(json.dumps(result, indent=1))
    _chart(result, out / "registry_bench.png")
    return result


def _chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = result["summary"]["median_MB_s"]
    labels = [k for k in ("push", "curl_put", "pull", "pull_one_stream", "pull_tmpfs", "pull_tmpfs_one_stream",
                          "curl_get_file", "curl_get_devnull") if k in med]
    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=120)
    colors = ["#2b7bba" if not k.startswith("curl") else "#9a9a9a" for k in labels]
    ax.bar(labels, [med[k] for k in labels], color=colors)
    ax.tick_params(axis="x", labelsize=8, labelrotation=15)
    for i, k in enumerate(labels):
        ax.annotate(f"{med[k]:.0f}", (i, med[k]), textcoords="offset points", xytext=(0, 4), ha="center")
    ax.set_ylabel("MB/s (median)")
    s = result["summary"]
    ax.set_title(f"{result['size_bytes'] / 2**30:.0f} GiB of weights, local registry: push {s['push_vs_curl']}x curl "
                 f"PUT, pull {s['pull_vs_curl_file_fsynced']}x curl-to-file, {s['pull_vs_one_stream_median']}x one "
                 f"stream; peak RSS {s['peak_rss_mib_push']:.0f}/"
                 f"{s['peak_rss_mib_pull']:.0f} MiB", fontsize=9)
    fig.text(0.01, 0.01, result["command"], fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
    else:
        r = run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2048)
        print(json.dumps(r["summary"], indent=1))
