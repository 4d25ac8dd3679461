#!/usr/bin/env python3
"""Device probe: can the CUDA driver checkpoint a real vLLM engine once sleep mode has released its GPU memory?

Runs on the GPU machine with vLLM's CUDA build on PYTHONPATH (packaging/device/vllm-carry.sh makes the carry).
It starts `vllm serve` with its defaults (torch.compile, CUDA graphs) plus --enable-sleep-mode, records a greedy
completion with logprobs, then for sleep level 1 (weights offloaded to host memory, KV cache dropped) and level 2
(weights dropped, reloaded from the safetensors through vLLM's reload_weights): sleep → lock + checkpoint every
process that holds a CUDA context → restore + unlock → wake → the same completion again, token for token.
Writes probe.json (every step with its time and the device memory seen) to OUT as it goes, so a run cut short
still says how far it got.

usage: vllm-sleep-probe.py MODEL_DIR OUT_DIR [--port 8011] [--deadline-s 170]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

RESULT: dict = {"steps": []}
T0 = time.monotonic()


def note(step: str, **fields) -> None:
    entry = {"step": step, "t": round(time.monotonic() - T0, 3), **fields}
    RESULT["steps"].append(entry)
    print(json.dumps(entry), flush=True)
    Path(ARGS.out, "probe.json").write_text(json.dumps(RESULT, indent=1))


def http(method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{ARGS.port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def completion() -> dict:
    status, text = http("POST", "/v1/completions", {
        "model": ARGS.model, "prompt": "w1 w2 w3 w4 w5 w6", "max_tokens": 16, "temperature": 0,
        "logprobs": 1, "seed": 0})
    if status != 200:
        return {"status": status, "error": text[:300]}
    choice = json.loads(text)["choices"][0]
    lp = choice.get("logprobs") or {}
    return {"status": status, "text": choice["text"], "tokens": lp.get("tokens"),
            "logprobs": lp.get("token_logprobs")}


def gpu_apps() -> list[dict]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    apps = []
    for line in out.strip().splitlines():
        pid, mem = (p.strip() for p in line.split(","))
        apps.append({"pid": int(pid), "mib": int(mem)})
    return apps


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[0])


def tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int(Path(d, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def describe(pid: int) -> dict:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS"))
        nv = sum("/dev/nvidia" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    except (OSError, StopIteration):
        return {"pid": pid, "gone": True}
    return {"pid": pid, "comm": comm, "rss_mib": rss // 1024, "nvidia_maps": nv}


class Driver:
    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        assert self.cu.cuInit(0) == 0

    def call(self, fn: str, pid: int, arg=None) -> tuple[int, float]:
        t = time.monotonic()
        rc = getattr(self.cu, fn)(ctypes.c_int(pid), arg)
        return rc, round(time.monotonic() - t, 3)

    def lock(self, pid: int) -> tuple[int, float]:
        class LockArgs(ctypes.Structure):
            _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                        ("reserved1", ctypes.c_uint64 * 7)]
        args = LockArgs()
        args.timeoutMs = 20000
        return self.call("cuCheckpointProcessLock", pid, ctypes.byref(args))


def checkpoint_cycle(drv: Driver, pids: list[int], label: str) -> bool:
    ok = True
    for verb in ("lock", "checkpoint"):
        for pid in pids:
            rc, dt = drv.lock(pid) if verb == "lock" else drv.call("cuCheckpointProcessCheckpoint", pid)
            note(f"{label}:{verb}", pid=pid, rc=rc, s=dt)
            ok = ok and rc == 0
    note(f"{label}:checkpointed", gpu_used_mib=gpu_used_mib(), procs=[describe(p) for p in pids])
    for verb, fn in (("restore", "cuCheckpointProcessRestore"), ("unlock", "cuCheckpointProcessUnlock")):
        for pid in pids:
            rc, dt = drv.call(fn, pid)
            note(f"{label}:{verb}", pid=pid, rc=rc, s=dt)
            ok = ok and rc == 0
    return ok


def main() -> int:
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", ARGS.model, "--port", str(ARGS.port),
            "--enable-sleep-mode", "--gpu-memory-utilization", "0.05", "--max-model-len", "1024",
            "--compilation-config", json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 8]})]
    note("launch", argv=argv[1:], gpu_used_mib=gpu_used_mib())
    server = subprocess.Popen(argv, env=env, stdout=open(out / "serve.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        while time.monotonic() - T0 < ARGS.deadline_s:
            if server.poll() is not None:
                note("server-exited", rc=server.returncode)
                return 3
            try:
                if http("GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            note("not-healthy-in-time")
            return 4
        note("healthy", gpu_used_mib=gpu_used_mib(), apps=gpu_apps(), procs=[describe(p) for p in tree(server.pid)])
        cold = completion()
        note("cold-completion", **cold)
        drv = Driver()
        for level in (1, 2):
            t = time.monotonic()
            status, text = http("POST", f"/sleep?level={level}")
            note(f"L{level}:sleep", status=status, s=round(time.monotonic() - t, 3), gpu_used_mib=gpu_used_mib(),
                 apps=gpu_apps())
            cuda_pids = [a["pid"] for a in gpu_apps()] or [p for p in tree(server.pid)
                                                           if describe(p).get("nvidia_maps")]
            checkpoint_cycle(drv, cuda_pids, f"L{level}")
            t = time.monotonic()
            if level == 1:
                note("L1:wake", status=http("POST", "/wake_up")[0], s=round(time.monotonic() - t, 3))
            else:
                note("L2:wake-weights", status=http("POST", "/wake_up?tags=weights")[0],
                     s=round(time.monotonic() - t, 3))
                t = time.monotonic()
                status, text = http("POST", "/collective_rpc", {"method": "reload_weights"})
                note("L2:reload-weights", status=status, body=text[:300], s=round(time.monotonic() - t, 3))
                t = time.monotonic()
                note("L2:wake-kv", status=http("POST", "/wake_up?tags=kv_cache")[0],
                     s=round(time.monotonic() - t, 3))
            warm = completion()
            note(f"L{level}:completion", identical=warm.get("tokens") == cold.get("tokens"),
                 logprobs_max_diff=max((abs(a - b) for a, b in zip(warm.get("logprobs") or [],
                                                                    cold.get("logprobs") or [])), default=None),
                 gpu_used_mib=gpu_used_mib(), **warm)
        return 0
    finally:
        os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--deadline-s", type=float, default=170)
    ARGS = parser.parse_args()
    sys.exit(main())
