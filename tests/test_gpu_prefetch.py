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
