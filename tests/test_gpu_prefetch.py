"""Weights prefetched onto the GPU during a restore (coldsnap.gpu.prefetch) and taken by the engine at resume.

The hand-over itself needs a GPU (it runs on the device machine); without one the prefetcher must still answer the
engine with its reason, and the engine must reload from the file instead: that path runs everywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from coldsnap.engines.reference.model import ModelConfig, Runner, build_model, decode, encode, shards  # noqa: E402
from coldsnap.engines.reference.weights import ensure_weights, load_prefetched, load_weights  # noqa: E402

TINY = ModelConfig(layers=1, hidden=64, heads=2, intermediate=176, max_seq=64, prefill_chunk=16)


def start_prefetcher(weights: str, gpu: str, sock: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap.gpu.prefetch", "--file", weights, "--gpu", gpu,
                             "--socket", sock, "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not __import__("os").path.exists(sock):  # it listens before it loads
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the prefetcher did not listen"
        time.sleep(0.02)
    return proc


def report_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    lines = out.decode().strip().splitlines()
    assert lines, err.decode()
    return json.loads(lines[-1])


def test_an_engine_whose_prefetch_fails_reloads_from_the_file_and_says_why(tmp_path):
    """A prefetcher that cannot load (here: no GPU with that UUID, or no GPU at all) tells the engine why over the
    socket; the engine's resume reloads from the file, gives the same output, and reports the reason."""
    path, _ = ensure_weights(tmp_path / "w.safetensors", TINY)
    runner = Runner(build_model(TINY, load_weights(path, mode="copy"), "cpu"), "cpu", kv_bytes=1 << 20)
    before = decode(list(runner.generate(encode("Hello, world!"), 8)))
    runner.release(save_to=str(tmp_path / "saved.safetensors"))  # weights dropped, to be reloaded at resume
    sock = str(tmp_path / "p.sock")
    proc = start_prefetcher(str(tmp_path / "saved.safetensors"), "GPU-00000000-0000-0000-0000-000000000000", sock)
    resumed = runner.resume(prefetched=sock)
    reload = resumed["weights_reload"]
    assert "prefetch_error" in reload and "the prefetcher failed" in reload["prefetch_error"], reload
    assert reload.get("prefetched") is None and reload["bytes"] > 0  # from the file
    assert decode(list(runner.generate(encode("Hello, world!"), 8))) == before
    report = report_of(proc)
    assert report["served"] is True and report["error"] and proc.returncode == 1
    assert not __import__("os").path.exists(sock)  # the prefetcher removed its socket


def test_the_prefetcher_refuses_a_missing_file_with_a_one_line_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "coldsnap.gpu.prefetch", "--file", str(tmp_path / "nope"),
                          "--gpu", "GPU-x", "--socket", str(tmp_path / "s"), "--timeout", "1"],
                         capture_output=True, text=True, timeout=60)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 1 and report["served"] is False and "error" in report
    assert "Traceback" not in out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the hand-over maps GPU memory")
@pytest.mark.parametrize("tp_rank", [None, 1], ids=["whole", "tp-shard"])
def test_prefetched_weights_reach_the_engine_bit_for_bit(tmp_path, tp_rank):
    cfg = ModelConfig(layers=2, hidden=512, heads=8, intermediate=1408, max_seq=64, prefill_chunk=16)
    path, _ = ensure_weights(tmp_path / "w.safetensors", cfg)
    mine = shards(cfg, 2, tp_rank) if tp_rank is not None else None
    want = load_weights(path, "cuda", shards=mine)
    params = {n: torch.zeros_like(t) for n, t in want.items()}
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    sock = str(tmp_path / "p.sock")
    proc = start_prefetcher(path, uuid, sock)
    stats = load_prefetched(path, params, sock, shards=mine)
    assert stats["prefetched"] is True and stats["bytes"] == sum(t.numel() * 4 for t in want.values())
    for n in want:
        assert torch.equal(params[n], want[n]), n
    report = report_of(proc)
    assert report["served"] is True and "error" not in report and proc.returncode == 0, report
    print(json.dumps({"engine": stats, "prefetcher": report}))


# --- when a restore prefetches, and reaping the prefetchers ----------------------------------------------------
def _profile(**over):
    from types import SimpleNamespace as NS

    base = dict(engine=NS(name="reference"), cuda_pids=1, gpus_used=["GPU-a"], distributed=None,
                model=NS(weights=[NS(path="/models/w.safetensors", size=10 << 30)]))
    return NS(**{**base, **over})


def test_a_restore_prefetches_only_where_it_can_help_and_says_why_not(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from coldsnap.gpu_support import _prefetch_refusal, start_prefetch, start_prefetch_soon

    assert _prefetch_refusal(_profile(), True) is None
    assert "does not reload weights" in _prefetch_refusal(_profile(), False)
    assert "no CUDA process" in _prefetch_refusal(_profile(cuda_pids=0), True)
    assert "not one GPU a rank" in _prefetch_refusal(_profile(distributed=NS(world_size=2)), True)
    assert _prefetch_refusal(_profile(distributed=NS(world_size=2), gpus_used=["GPU-a", "GPU-b"]), True) is None
    two_files = NS(weights=[NS(path="a", size=1), NS(path="b", size=1)])
    assert "not one file" in _prefetch_refusal(_profile(model=two_files), True)
    monkeypatch.setenv("COLDSNAP_PREFETCH", "0")
    assert start_prefetch(_profile(), True, {}, tmp_path).skipped == "COLDSNAP_PREFETCH=0"
    monkeypatch.delenv("COLDSNAP_PREFETCH")
    # Room for a second copy is checked on the GPU the restore maps to (NVML); no answer means no prefetch.
    monkeypatch.setattr("coldsnap.gpu.nvml.free_bytes", lambda gpu: 64 << 30 if gpu == "GPU-big" else 4 << 30)
    assert "not enough free memory on GPU-a" in start_prefetch(_profile(), True, {}, tmp_path).skipped
    assert "GPU-small" in start_prefetch(_profile(), True, {"GPU-a": "GPU-small"}, tmp_path).skipped
    # The restore starts them on a thread of its own and takes the same answer when it needs it.
    assert "GPU-small" in start_prefetch_soon(_profile(), True, {"GPU-a": "GPU-small"}, tmp_path)().skipped
    monkeypatch.setattr("coldsnap.gpu.nvml.free_bytes", lambda gpu: 1 / 0)  # whatever goes wrong, no traceback
    assert "division by zero" in start_prefetch_soon(_profile(), True, {}, tmp_path)().skipped


def test_the_engine_gets_a_socket_for_one_gpu_and_a_map_for_ranks():
    from coldsnap.gpu_support import Prefetch

    assert Prefetch().for_engine() is None
    assert Prefetch(sockets={"GPU-a": "/s/a"}).for_engine() == "/s/a"
    assert Prefetch(sockets={"GPU-a": "/s/a", "GPU-b": "/s/b"}).for_engine() == {"GPU-a": "/s/a", "GPU-b": "/s/b"}


def test_a_prefetcher_no_engine_took_is_killed_and_its_socket_removed(tmp_path):
    from coldsnap.gpu_support import Prefetch, finish_prefetch

    path, _ = ensure_weights(tmp_path / "w.safetensors", TINY)
    sock = str(tmp_path / "p.sock")
    proc = start_prefetcher(path, "GPU-00000000-0000-0000-0000-000000000000", sock)  # waits for an engine
    t = time.monotonic()
    report = finish_prefetch(Prefetch(sockets={"GPU-a": sock}, procs=[proc]))
    assert time.monotonic() - t < 5 and proc.returncode is not None  # killed, not waited out
    assert "reported nothing" in report["error"] and not __import__("os").path.exists(sock)


def test_a_rank_takes_only_the_prefetcher_on_its_own_gpu(tmp_path):
    """{GPU UUID: socket}: a CPU engine (no GPU of its own) takes none of them and reloads from the file quietly."""
    path, _ = ensure_weights(tmp_path / "w.safetensors", TINY)
    runner = Runner(build_model(TINY, load_weights(path, mode="copy"), "cpu"), "cpu", kv_bytes=1 << 20)
    runner.release(save_to=str(tmp_path / "saved.safetensors"))
    reload = runner.resume(prefetched={"GPU-00000000-0000-0000-0000-000000000000": str(tmp_path / "none.sock")})
    assert reload["weights_reload"]["bytes"] > 0 and "prefetch_error" not in reload["weights_reload"]
