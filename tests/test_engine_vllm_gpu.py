"""vLLM's CUDA build on the GPU, for real: a vanilla server's greedy completions with logprobs, then `coldsnap capture
--engine vllm --device cuda` in native mode (sleep level 1) and in recovery mode (sleep level 2, weights reloaded
from the pinned safetensors), each restored twice and held to the vanilla server's tokens and logprobs (±1e-3, as
vLLM's own snapshot CI holds a restore), with the GPU state in the capsule checked to be small; then sleep and wake
of a restored workload.

Needs the GPU machine: the CUDA checkpoint API, vLLM's CUDA build (packaging/device/vllm_carry.py, installed where
$COLDSNAP_VLLM_CUDA_SITE says) and a model ($COLDSNAP_TEST_VLLM_MODEL, e.g. `python -m coldsnap_reference.tinymodel
DIR --shape 1b`). packaging/device/vllm-gpu.sh does all three and runs this file. Elsewhere (CI) every case skips
and says why."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import CRIU_PREFIX, needs_root_criu

from coldsnap.contracts import CaptureRequest
from coldsnap.engines import get_adapter
from coldsnap.flows.coldstart import start_cold
from coldsnap.net import allocate_plan, destroy_network
from coldsnap.workload.process import kill_tree

pytestmark = pytest.mark.slow

SITE = os.environ.get("COLDSNAP_VLLM_CUDA_SITE", "/tmp/vllm-site")
MODEL = os.environ.get("COLDSNAP_TEST_VLLM_MODEL", "/tmp/llama-1b")
PROMPTS = ["ColdSnap says", "The server", "A checkpoint is", "Every token", "When the cache"]
CLI = [sys.executable, "-m", "coldsnap.cli"]
# What may travel as GPU state: the CUDA context, graphs and allocator pools, not the KV cache nor (recovery)
# the weights (the 8B-shape bound is 2 GB; the 1 GB model's whole weights must not fit under it either).
GPU_STATE_BOUND = 2 << 30


def needs_vllm_on_cuda() -> None:
    from coldsnap.gpu.cuda_checkpoint import CudaCheckpointAPI

    api = CudaCheckpointAPI()
    if not api.available():
        pytest.skip(f"no NVIDIA GPU with the CUDA checkpoint API here ({api.unavailable_reason()}); runs on the "
                    "GPU machine: packaging/device/vllm-gpu.sh")
    if not Path(SITE, "vllm", "__init__.py").exists():
        pytest.skip(f"no vLLM CUDA build in {SITE} ($COLDSNAP_VLLM_CUDA_SITE): packaging/device/vllm_carry.py")
    if not Path(MODEL, "config.json").exists():
        pytest.skip(f"no model at {MODEL} ($COLDSNAP_TEST_VLLM_MODEL): python -m coldsnap_reference.tinymodel "
                    f"{MODEL} --shape 1b")


def greedy(url: str, model: str) -> list[dict]:
    """Each prompt's greedy completion: its tokens and their logprobs."""
    u = urlsplit(url)
    out = []
    for prompt in PROMPTS:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1}),
            headers={"Content-Type": "application/json", "Connection": "close"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        assert resp.status == 200, data[:300]
        lp = json.loads(data)["choices"][0]["logprobs"]
        out.append({"tokens": lp["tokens"], "logprobs": lp["token_logprobs"]})
    return out


def assert_same(after: list[dict], before: list[dict], what: str) -> None:
    for a, b, prompt in zip(after, before, PROMPTS):
        assert a["tokens"] == b["tokens"], f"{what}: {prompt!r} gave other tokens"
        worst = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))
        assert worst <= 1e-3, f"{what}: {prompt!r} logprobs differ by {worst}"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    needs_root_criu()
    needs_vllm_on_cuda()
    root = tmp_path_factory.mktemp("vllm-gpu")
    return {**os.environ, "COLDSNAP_HOME": str(root / "home"), "COLDSNAP_RUN": str(root / "run"),
            "COLDSNAP_CRIU_PREFIX": CRIU_PREFIX, "COLDSNAP_VLLM_CUDA_SITE": SITE}


def cli(env, *args, timeout=1800):
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def vanilla(env):
    """A vanilla server (the adapter's own launch, started cold and never captured): the answers restores owe."""
    with pytest.MonkeyPatch.context() as mp:
        for key in ("COLDSNAP_HOME", "COLDSNAP_RUN", "COLDSNAP_CRIU_PREFIX"):
            mp.setenv(key, env[key])
        req = CaptureRequest(operation="capture", engine={"name": "vllm", "options": {"model": MODEL, "site": SITE}},
                             launch={"devices": ["cuda:0"]}, lifecycle={"name": "vllm-vanilla"})
        launch = get_adapter("vllm").prepare(req)
        plan = allocate_plan("vllm-vanilla", req.launch.port)
        cold = start_cold("vllm-vanilla", plan, launch.argv, launch.env, launch.cwd, req.validation)
        try:
            answers = greedy(f"http://{plan.workload_address}:{plan.port}", launch.model_id)
        finally:
            kill_tree(cold.state.pid)
            destroy_network(plan)
    assert len({tuple(a["tokens"]) for a in answers}) > 1, answers  # not degenerate
    return {"answers": answers, "model": launch.model_id, "cold_ttft_s": cold.time_to_first_token}


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("mode", ["native", "recovery"])
def test_vllm_on_cuda_captures_small_and_restores_token_identical(env, vanilla, mode):
    name = f"vllm-{mode}"
    r = cli(env, "capture", "--engine", "vllm", "--device", "cuda", "--weights-mode", mode, "--name", name,
            "--engine-opt", f"model={MODEL}", "--engine-opt", f"site={SITE}", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    captured = json.loads(r.stdout)["result"]
    assert captured["release"]["sleep_level"] == {"native": 1, "recovery": 2}[mode]
    assert captured["cuda_processes"] >= 1  # the engine core (API server and engine core are separate processes)
    inspect = json.loads(cli(env, "inspect", captured["capsule"]).stdout)
    gpu_state = sum(inspect["profile"]["gpu_memory"].values()) if inspect["profile"].get("gpu_memory") else None
    print(f"{mode}: capsule {captured['capsule'][:19]} GPU memory while serving {gpu_state}; receipt "
          f"{json.dumps({k: captured.get(k) for k in ('criu_stats', 'release')})}")
    for i in range(2):
        r = cli(env, "restore", "--capsule", captured["capsule"], "--no-fallback", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads(r.stdout)["result"]
        try:
            resume = res["hydrate"]["engine_resume"]
            assert resume, res["hydrate"]  # woken: the sleep mode's steps, timed
            if mode == "recovery":  # reloaded by ColdSnap's worker extension, not vLLM's fallback loader, from
                assert "reload_fallback" not in resume, resume  # the copies prefetched during the restore
                files = len(list(Path(MODEL).glob("*.safetensors")))
                assert resume["reload"]["prefetched"] == files and "errors" not in resume["reload"], \
                    (resume, res["hydrate"].get("prefetch"))
                assert resume["reload"]["bytes"] >= sum(p.stat().st_size for p in Path(MODEL).glob("*.safetensors")) \
                    - (1 << 20) * 10, resume
            assert_same(greedy(res["url"], vanilla["model"]), vanilla["answers"], f"{mode} restore {i + 1}")
            assert res["time_to_first_token_s"] < vanilla["cold_ttft_s"]
        finally:
            assert cli(env, "stop", res["workload"]).returncode == 0
    images = (captured["criu_stats"].get("pages_written") or 0) * 4096  # CRIU's count of dumped pages
    if mode == "recovery" and images:
        weights = sum(p.stat().st_size for p in Path(MODEL).glob("*.safetensors"))
        assert images < weights + GPU_STATE_BOUND, f"the dump holds {images} bytes: the weights travelled"


@pytest.mark.timeout(3600)
def test_vllm_on_cuda_sleeps_and_wakes(env, vanilla):
    r = cli(env, "capture", "--engine", "vllm", "--device", "cuda", "--weights-mode", "recovery", "--name",
            "vllm-sleepy", "--leave-running", "--engine-opt", f"model={MODEL}", "--engine-opt", f"site={SITE}",
            "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        sleep = cli(env, "sleep", "vllm-sleepy", "--json")
        assert sleep.returncode == 0, sleep.stderr
        wake = cli(env, "wake", "vllm-sleepy", "--json")
        assert wake.returncode == 0, wake.stderr
        url = next(w["url"] for w in json.loads(cli(env, "status", "--json").stdout)["workloads"]
                   if w["name"] == "vllm-sleepy")
        assert_same(greedy(url, vanilla["model"]), vanilla["answers"], "after sleep and wake")
    finally:
        cli(env, "stop", "vllm-sleepy")
