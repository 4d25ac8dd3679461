"""The reference engine: seeded weights, mmap/copy loading, greedy decoding and its OpenAI-compatible server.

Everything runs on CPU with a tiny model. Servers run as subprocesses on free loopback ports; one of them
compiles with torch.compile (a cold inductor cache in tmp, so it does the whole compile: ~30-60 s here).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from coldsnap_reference.model import ModelConfig, Runner, build_model, decode, encode, param_specs  # noqa: E402
from coldsnap_reference.weights import ensure_weights, load_weights, read_header, sidecar  # noqa: E402

TINY = ModelConfig(layers=1, hidden=64, heads=2, intermediate=176, max_seq=64, prefill_chunk=16)
TINY_FLAGS = ["--layers", "1", "--hidden", "64", "--heads", "2", "--max-seq", "64", "--prefill-chunk", "16"]
PROMPTS = ["Hello, world!", "The quick brown fox jumps over the dog."]


# --- weights ---------------------------------------------------------------------------------------


def test_weights_are_seeded_byte_identical_whatever_the_piece_order(tmp_path, monkeypatch):
    """Generation runs in pieces on all cores; the bytes depend on config and seed only, and the file is a valid
    safetensors file (read back by the safetensors library itself) with values in each tensor's range."""
    import numpy as np
    from safetensors.numpy import load_file

    from coldsnap_reference import weights as weights_mod

    monkeypatch.setattr(weights_mod, "PIECE", 1000)  # many pieces per tensor, finishing in any order
    a = ensure_weights(tmp_path / "a.safetensors", TINY, seed=7)
    b = ensure_weights(tmp_path / "b.safetensors", TINY, seed=7)
    c = ensure_weights(tmp_path / "c.safetensors", TINY, seed=8)
    data = Path(a).read_bytes()
    assert data == Path(b).read_bytes() and data != Path(c).read_bytes()
    monkeypatch.setattr(weights_mod, "PIECE", 8 << 20)
    assert ensure_weights(tmp_path / "d.safetensors", TINY, seed=7)
    assert Path(tmp_path / "d.safetensors").read_bytes() != data  # the piece size is part of the stream's key
    tensors = load_file(a)
    for name, shape, std in param_specs(TINY):
        t = tensors[name]
        assert t.shape == shape and t.dtype == np.float32
        if std == 0.0:
            assert (t == 1).all()
        else:
            assert np.abs(t).max() <= std * 3**0.5 + 1e-6 and t.std() > std / 2  # uniform in ±std·√3
    side = json.loads(sidecar(a).read_text())
    assert side["config"] == TINY.to_dict() and side["size"] == len(data) and "sha256" not in side
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # atomic: no temp file left
    # An existing file is kept as it is and checked against the config.
    mtime = os.stat(a).st_mtime_ns
    assert ensure_weights(a, TINY, seed=7) == a
    assert os.stat(a).st_mtime_ns == mtime
    with pytest.raises(ValueError, match="another model config"):
        ensure_weights(a, ModelConfig(layers=2, hidden=64, heads=2, intermediate=176, max_seq=64, prefill_chunk=16))


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == path:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def test_load_mmap_and_copy_give_the_same_tensors(tmp_path):
    from safetensors.torch import load_file

    path = ensure_weights(tmp_path / "w.safetensors", TINY)
    ref = load_file(path)
    mm = load_weights(path, "cpu", "mmap")
    cp = load_weights(path, "cpu", "copy")
    assert set(mm) == set(cp) == set(ref)
    for name in ref:
        assert torch.equal(mm[name], ref[name]) and torch.equal(cp[name], ref[name])
        assert mm[name].data_ptr() % 64 == 0
    ranges = _mapped_ranges(path)
    inside = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in ranges)  # noqa: E731
    assert all(inside(t) for t in mm.values())  # views over the file's mapping
    assert not any(inside(t) for t in cp.values())  # anonymous copies
    _, header = read_header(path)
    assert header["__metadata__"]["format"] == "pt"


def test_greedy_decoding_is_deterministic_printable_and_survives_release(tmp_path):
    path = ensure_weights(tmp_path / "w.safetensors", TINY)
    runner = Runner(build_model(TINY, load_weights(path), "cpu"), "cpu", kv_bytes=1 << 20)
    assert runner.kv_bytes == 1 << 20
    first = decode(list(runner.generate(encode(PROMPTS[1]), 12)))
    assert first == decode(list(runner.generate(encode(PROMPTS[1]), 12)))
    assert len(first) == 12 and all(32 <= ord(ch) < 127 for ch in first)
    assert runner.release()["freed_bytes"] >= 1 << 20
    with pytest.raises(RuntimeError):
        list(runner.generate(encode("x"), 1))
    runner.resume()
    assert decode(list(runner.generate(encode(PROMPTS[1]), 12))) == first
    with pytest.raises(ValueError, match="exceeds the context"):
        runner.check_fits(60, 10)


# --- server ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, weights: Path, log: Path, *flags: str, timeout: float = 60.0, env: dict | None = None) -> None:
        self.port = free_port()
        self.log = log
        argv = [sys.executable, "-m", "coldsnap_reference.server", "--weights", str(weights),
                "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1", "--kv-mib", "2",
                "--warmup-tokens", "2", *TINY_FLAGS, *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited {self.proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"engine not ready in {timeout} s: {log.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def request(self, method: str, path: str, body: bytes | dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            if isinstance(body, dict):
                body = json.dumps(body).encode()
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            assert resp.getheader("Connection") == "close"
            return resp.status, data, resp.getheader("Content-Type")
        finally:
            conn.close()

    def json(self, method: str, path: str, body=None):
        status, data, _ = self.request(method, path, body)
        return status, json.loads(data)

    def complete(self, prompt: str, max_tokens: int = 16) -> str:
        status, out = self.json("POST", "/v1/completions", {"model": "coldsnap/reference-tiny", "prompt": prompt,
                                                            "max_tokens": max_tokens, "temperature": 0})
        assert status == 200, out
        return out["choices"][0]["text"]

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights") / "tiny.safetensors"  # the first engine generates it


@pytest.fixture(scope="module")
def eager(weights, tmp_path_factory):
    engine = Engine(weights, tmp_path_factory.mktemp("logs") / "eager.log", "--no-compile")
    yield engine
    engine.stop()


def test_server_reports_its_phases_and_health(eager, weights):
    names = [e["name"] for e in eager.events() if e["event"] == "phase"]
    assert names[:4] == ["import", "weights", "load", "build"] and "warmup" in names and "compile" not in names
    ready = [e for e in eager.events() if e["event"] == "ready"]
    assert ready and ready[0]["port"] == eager.port
    assert eager.json("GET", "/health") == (200, {"status": "ok"})
    status, models = eager.json("GET", "/v1/models")
    assert status == 200 and models["object"] == "list" and models["data"][0]["id"] == "coldsnap/reference-tiny"
    status, info = eager.json("GET", "/coldsnap/info")
    assert status == 200 and info["engine"] == "reference" and info["device"] == "cpu"
    assert info["weights"]["size"] == weights.stat().st_size
    assert info["weights"]["path"] == str(weights) and info["pid"] == eager.proc.pid
    assert set(info["startup_phases"]) >= {"import", "weights", "load", "build", "warmup"}


def test_completion_is_openai_shaped_nonempty_and_deterministic(eager):
    status, out = eager.json("POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0})
    assert status == 200
    assert out["object"] == "text_completion" and out["model"] == "coldsnap/reference-tiny"
    choice = out["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and len(choice["text"]) == 16
    assert out["usage"] == {"prompt_tokens": len(PROMPTS[0]) + 1, "completion_tokens": 16,
                            "total_tokens": len(PROMPTS[0]) + 17}
    assert eager.complete(PROMPTS[0]) == choice["text"]
    assert eager.complete(PROMPTS[1]) != choice["text"]


def test_streamed_chunks_concatenate_to_the_completion(eager):
    status, data, ctype = eager.request("POST", "/v1/completions",
                                        {"prompt": PROMPTS[1], "max_tokens": 10, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e[len("data: "):] for e in data.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 10 and all(len(c["choices"][0]["text"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == eager.complete(PROMPTS[1], 10)


def test_chat_completions_are_the_completion_of_the_rendered_conversation(eager):
    messages = [{"role": "user", "content": "hi"}]
    rendered = "user: hi\nassistant:"
    status, out = eager.json("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 8})
    assert status == 200 and out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": eager.complete(rendered, 8)}
    # streamed as an OpenAI client (and sparkrun's readiness probe) reads it: deltas, usage, [DONE]
    status, data, ctype = eager.request("POST", "/v1/chat/completions", {
        "messages": messages, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e[len("data: "):] for e in data.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 8
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == eager.complete(rendered, 8)
    for bad in ({"messages": []}, {"messages": [{"role": "user"}]}, {"messages": "hi"}):
        assert eager.json("POST", "/v1/chat/completions", bad)[0] == 400


@pytest.mark.parametrize("body, status", [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    ({"prompt": "x", "max_tokens": "many"}, 400),
    ({"prompt": "x", "max_tokens": 0}, 400),
    ({"prompt": 42}, 400),
    ({"prompt": "x", "stream": "yes"}, 400),
    ({"prompt": "x", "temperature": -1}, 400),
    ({"prompt": "x" * 60, "max_tokens": 16}, 400),  # past the tiny model's 64-token context
    ({"prompt": "x", "model": "someone/else"}, 404),
])
def test_bad_requests_get_a_json_error_not_a_crash(eager, body, status):
    got, out = eager.json("POST", "/v1/completions", body)
    assert got == status and out["error"]["message"]
    assert eager.json("GET", "/nope")[0] == 404
    assert eager.json("GET", "/v1/completions")[0] == 405
    assert eager.json("GET", "/health") == (200, {"status": "ok"})


def test_release_then_resume_keeps_the_output(eager):
    before = eager.complete(PROMPTS[1])
    status, rel = eager.json("POST", "/coldsnap/release")
    assert status == 200 and rel["released"] is True and rel["seconds"] >= 0 and rel["freed_bytes"] >= 2 << 20
    assert eager.json("GET", "/health")[0] == 503
    assert eager.json("POST", "/v1/completions", {"prompt": "x"})[0] == 503
    for bad in (5, ["/s"], {"GPU-a": 1}):  # a socket path or {GPU UUID: socket path}, nothing else
        status, err = eager.json("POST", "/coldsnap/resume", {"prefetched": bad})
        assert status == 400 and "prefetched" in err["error"]["message"], (bad, err)
    status, res = eager.json("POST", "/coldsnap/resume", {})
    assert status == 200 and res["released"] is False and res["seconds"] >= 0 and "kv" in res["took_s"]
    assert eager.json("GET", "/health") == (200, {"status": "ok"})
    assert eager.complete(PROMPTS[1]) == before


def test_compiled_engine_gives_the_eager_output(eager, weights, tmp_path):
    expected = [eager.complete(p) for p in PROMPTS]
    engine = Engine(weights, tmp_path / "compiled.log", "--compile", "--compile-cache", str(tmp_path / "inductor"),
                    timeout=240)
    try:
        phases = {e["name"]: e["seconds"] for e in engine.events() if e["event"] == "phase"}
        assert phases["compile"] > 0
        status, info = engine.json("GET", "/coldsnap/info")
        assert info["compile"]["enabled"] and info["compile"]["mode"] == "default"
        assert info["compile"]["cache_dir"] == str(tmp_path / "inductor")
        assert [engine.complete(p) for p in PROMPTS] == expected
        assert engine.json("POST", "/coldsnap/release")[0] == 200
        assert engine.json("POST", "/coldsnap/resume")[0] == 200
        assert engine.complete(PROMPTS[0]) == expected[0]  # no recompile needed: same tensors, new memory
    finally:
        engine.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_captures_cuda_graphs_and_survives_release(weights, tmp_path):
    plain = Engine(weights, tmp_path / "cuda-eager.log", "--device", "cuda", "--no-compile", "--no-cuda-graphs")
    try:
        expected = [plain.complete(p) for p in PROMPTS]
    finally:
        plain.stop()
    engine = Engine(weights, tmp_path / "cuda.log", "--device", "cuda", "--compile-cache", str(tmp_path / "inductor"),
                    timeout=300)
    try:
        info = engine.json("GET", "/coldsnap/info")[1]
        assert info["device"].startswith("cuda") and info["cuda_graphs"] and "cuda_graphs" in info["startup_phases"]
        assert [engine.complete(p) for p in PROMPTS] == expected
        t = time.monotonic()
        for _ in range(3):
            engine.complete(PROMPTS[1])
        per_completion = (time.monotonic() - t) / 3
        status, rel = engine.json("POST", "/coldsnap/release")
        assert status == 200 and rel["freed_bytes"] > 2 << 20  # KV cache and weights
        assert rel["cuda_stack_limit_shed"] > 0  # the stack reserve went too; resume sets it back
        status, res = engine.json("POST", "/coldsnap/resume")
        assert status == 200 and res["cuda_graphs"] == 2
        assert [engine.complete(p) for p in PROMPTS] == expected  # weights reloaded, graphs captured again
        assert engine.json("POST", "/coldsnap/release")[0] == engine.json("POST", "/coldsnap/resume")[0] == 200
        assert engine.complete(PROMPTS[0]) == expected[0]
        print(json.dumps({"phases": info["startup_phases"], "completion_s": per_completion,
                          "release": rel, "resume": res}))
    finally:
        engine.stop()


def test_saved_tensors_load_back_bit_for_bit_and_stay_releasable(tmp_path):
    """save_tensors (native weights saved at release) writes what load_into reads back, in any dtype, without
    pinning the source tensors' storage (release shrinks it to nothing afterwards)."""
    from coldsnap_reference.weights import load_into, save_tensors

    src = {"a.weight": torch.randn(33, 7, dtype=torch.bfloat16), "b.bias": torch.randn(5),
           "c.idx": torch.arange(9, dtype=torch.int64)}
    path = tmp_path / "saved.safetensors"
    size = save_tensors(path, src, {"format": "pt"})
    assert size == path.stat().st_size and os.stat(path).st_mode & 0o777 == 0o600
    back = {n: torch.zeros_like(t) for n, t in src.items()}
    load_into(path, back)
    for n in src:
        assert torch.equal(back[n], src[n]), n
        src[n].untyped_storage().resize_(0)  # still resizable after being written
