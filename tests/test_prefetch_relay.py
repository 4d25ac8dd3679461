"""Prefetched weights handed into a container (coldsnap.gpu.relay), on the CPU: the GPU memory's file descriptor is
a memfd here (a stand-in for the prefetcher's exported GPU memory, which needs a GPU); everything else is real: the
"container" is a process in a mount namespace of its own with a private /tmp, the engine side is ColdSnap's own
prefetch.Session, and the relay's socket is made in the container's /tmp through /proc/PID/root."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coldsnap.gpu import relay
from coldsnap.gpu.prefetch import file_identity

ENGINE_SIDE = r"""
import os, sys
from coldsnap.gpu.prefetch import Session
print("ready", flush=True)
path, weights = sys.stdin.readline().split()
s = Session(path, weights)
data = os.pread(s.fd, 64, 0)
os.close(s.fd)
s.release()  # returns once the prefetcher has freed its copy
print(data.decode(), flush=True)
"""


def stand_in_prefetcher(sock_path: str, weights: Path, events: list) -> threading.Thread:
    """Serves one engine the way prefetch.serve does: the memory's fd with its description, then waits for the
    engine's release before it frees its copy and closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(1)
    listener.settimeout(60)

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
            fd = os.memfd_create("weights")
            os.write(fd, b"the weights, on the device")
            with conn:
                message = {"bytes": 26, "alloc_bytes": 4096, "offset": 8, "identity": file_identity(str(weights))}
                socket.send_fds(conn, [json.dumps(message).encode()], [fd])
                os.close(fd)
                conn.recv(1)
                events.append("freed")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


REPO = Path(__file__).resolve().parents[1]


def in_a_mount_namespace(model_dir: Path) -> subprocess.Popen:
    """The engine side in a "container": a private tmpfs on /tmp, with the model directory (and this checkout and
    its venv, when they live under /tmp, as a CI clone does) bound at their own paths."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a mount namespace with a private /tmp stands for the container")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    binds = [p for p in (model_dir, REPO, Path(sys.prefix)) if p.is_relative_to("/tmp")]
    binds = [p for p in binds if not any(p != q and p.is_relative_to(q) for q in binds)]  # the outermost
    setup = "set -e; m=$(mktemp -d /run/ctr-tmp.XXXXXX); mount -t tmpfs ctr-tmp $m; " + "".join(
        f"mkdir -p $m/{p.relative_to('/tmp')}; mount --bind {p} $m/{p.relative_to('/tmp')}; " for p in binds) + \
        "mount --move $m /tmp; rmdir $m 2>/dev/null || true"
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             f"{setup}; exec {sys.executable} -c '{ENGINE_SIDE}'"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def test_the_engine_in_a_container_takes_the_prefetched_memory_through_the_relay(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 64)
    events: list[str] = []
    upstream = str(tmp_path / "prefetch.sock")
    served = stand_in_prefetcher(upstream, weights, events)
    engine = in_a_mount_namespace(tmp_path)
    try:
        with relay.into_container(engine.pid, {str(weights): upstream}) as inside:
            (key, path), = inside.items()
            assert key == str(weights) and path.startswith("/tmp/") and path != upstream
            assert not os.path.exists(path), "the relay's socket is in the container's /tmp, not the host's"
            assert Path(f"/proc/{engine.pid}/root{path}").is_socket()
            engine.stdin.write(f"{path} {weights}\n")
            engine.stdin.flush()
            out, err = engine.communicate(timeout=60)
        assert engine.returncode == 0, err
        assert out.strip() == "the weights, on the device"
        # the prefetcher freed its copy before the engine's release returned (the KV cache takes the room next)
        assert events == ["freed"]
        served.join(10)
    finally:
        engine.kill()
        engine.wait()


def test_no_socket_in_the_container_means_no_prefetch_not_a_failure(tmp_path):
    """A process gone (or a container without a writable /tmp): the engine is given nothing and reads the weights
    itself."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    with relay.into_container(proc.pid, str(tmp_path / "prefetch.sock")) as inside:
        assert inside is None
    with relay.into_container(os.getpid(), None) as inside:
        assert inside is None
