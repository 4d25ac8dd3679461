"""SGLang (CPU engine) in process mode: the adapter's launch and a real cold start → capture → restore with CRIU,
checked token for token against an uncaptured server. The slow test builds /var/lib/coldsnap/venvs/sglang with
packaging/engines/sglang-setup.sh on first use (~90 s, cached); the helpers come from test_engine_vllm.py."""

from __future__ import annotations

import sys

import pytest
from test_engine_vllm import FIXTURE_MODEL, cold_capture_restore, engine_home, ensure_engine, fake_venv_and_model  # noqa: F401

from coldsnap.contracts import CaptureRequest, ColdSnapError, ErrorCode, Policy
from coldsnap.engines import get_adapter

SGLANG_VENV = "/var/lib/coldsnap/venvs/sglang"


def test_sglang_prepare_builds_a_checkpointable_launch(tmp_path, coldsnap_home):
    venv, model = fake_venv_and_model(tmp_path)
    req = CaptureRequest(operation="capture", engine={"name": "sglang", "options": {
        "venv": str(venv), "model": str(model), "max_total_tokens": 2048, "chunked_prefill_size": 512}},
        launch={"port": 30001})
    launch = get_adapter("sglang").prepare(req)
    argv = launch.argv
    assert argv[:4] == [sys.executable, "-m", "coldsnap.engines.seccomp", "--"]
    assert argv[4:7] == [str(venv / "bin/python"), "-m", "sglang.launch_server"]
    for flag, value in (("--model-path", str(model)), ("--port", "30001"), ("--device", "cpu"),
                        ("--attention-backend", "torch_native"), ("--max-total-tokens", "2048"),
                        ("--chunked-prefill-size", "512")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--sleep-on-idle" in argv and "--disable-cuda-graph" in argv
    assert launch.env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert launch.weights_mode == "native" and launch.engine_version == "0.5.23"
    assert launch.model is None and str(model / "model.safetensors") in launch.pin_ahead
    assert launch.describe_model().weights[0].path == str(model / "model.safetensors")
    with pytest.raises(ColdSnapError) as e:
        get_adapter("sglang").prepare(req.model_copy(update={"policy": Policy(weights_mode="recovery")}))
    assert e.value.code == ErrorCode.INVALID_REQUEST


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_sglang_cold_capture_restore_identical(engine_home):
    ensure_engine("sglang", SGLANG_VENV)
    out = cold_capture_restore("sglang", {"venv": SGLANG_VENV, "model": FIXTURE_MODEL}, engine_home, "pyt-sglang")
    cap = out["capture"]
    assert {"--tcp-established", "--link-remap"} <= set(cap.profile.criu_options)
    assert any(p.startswith("/dev/shm/sglang_loads_") for p in out["carried"]), out["carried"]
    for res in out["restores"]:
        assert res.time_to_first_token_s < cap.receipt.result.cold_time_to_first_token_s
