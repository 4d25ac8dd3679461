"""Distributed workloads: the tensor-parallel reference engine captured and restored as one unit.

On CPU (CI) the ranks talk over gloo and the whole path runs for real: rank 0 starts its peers, capture dumps the
tree, restore brings every rank back and a completion (which needs every rank's collectives) validates it. On a
host with two GPUs the same test runs over NCCL (tests/test_distributed.py::test_two_gpu_*), the device tool's
nvidia-h200-x2 machine runs it; elsewhere it skips and says why.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import needs_root_criu

from coldsnap.contracts import CaptureRequest, Distributed, GpuInfo, HostProfile, Launch, RestoreRequest
from coldsnap.contracts.results import Ranks
from coldsnap.flows.admission import admit

torch = pytest.importorskip("torch")

from coldsnap_reference.model import ModelConfig, local_shape, param_specs, shards  # noqa: E402
from coldsnap_reference.weights import ensure_weights, load_into, load_weights  # noqa: E402

SMALL = ModelConfig(hidden=64, layers=2, heads=4, intermediate=96, max_seq=64, prefill_chunk=16)


# --- sharding ------------------------------------------------------------------------------------------------------
def test_shards_of_all_ranks_put_together_are_the_full_weights(tmp_path):
    path = ensure_weights(tmp_path / "w.safetensors", SMALL, seed=3)
    full = load_weights(path)
    parts = [load_weights(path, shards=shards(SMALL, 2, r)) for r in range(2)]
    split = shards(SMALL, 2, 0)
    assert {n.split(".", 2)[-1] for n in split} == {"attn.wq.weight", "attn.wk.weight", "attn.wv.weight",
                                                    "attn.wo.weight", "mlp.w1.weight", "mlp.w3.weight",
                                                    "mlp.w2.weight"}
    for name, shape, _ in param_specs(SMALL):
        if name in split:
            dim = split[name].dim
            assert parts[0][name].shape == local_shape(shape, split[name])
            assert torch.equal(torch.cat([p[name] for p in parts], dim), full[name])
        else:  # replicated
            assert torch.equal(parts[0][name], full[name]) and torch.equal(parts[1][name], full[name])


@pytest.mark.parametrize("threads", [1, 3])
def test_load_into_hydrates_each_rank_in_place(tmp_path, threads):
    path = ensure_weights(tmp_path / "w.safetensors", SMALL, seed=4)
    for rank in range(2):
        mine = shards(SMALL, 2, rank)
        want = load_weights(path, shards=mine)
        params = {n: torch.zeros_like(t) for n, t in want.items()}
        addresses = {n: t.data_ptr() for n, t in params.items()}
        # A tiny chunk forces many chunks, row blocks of the dim-1 splits, and both staging buffers.
        stats = load_into(path, params, shards=mine, chunk_bytes=4096, threads=threads)
        assert stats["bytes"] == sum(t.numel() * 4 for t in want.values())
        for n in want:
            assert torch.equal(params[n], want[n]), n
            assert params[n].data_ptr() == addresses[n]  # in place: graphs pointing here stay valid


def test_nccl_settings_are_parsed_strictly_and_recorded(monkeypatch):
    from coldsnap_reference.tp import CAPTURE_SAFE_ENV, parse_nccl_env, settings_in_force

    assert parse_nccl_env("NCCL_BUFFSIZE=1048576, NCCL_MAX_NCHANNELS=2") == {"NCCL_BUFFSIZE": "1048576",
                                                                          "NCCL_MAX_NCHANNELS": "2"}
    assert parse_nccl_env(None) == {}
    for bad in ("BUFFSIZE=1", "NCCL_BUFFSIZE", "NCCL_P2P_DISABLE=0", "NCCL_X="):
        with pytest.raises(ValueError):
            parse_nccl_env(bad)
    for k in [k for k in os.environ if k.startswith("NCCL_")]:  # a GPU host's image may set its own
        monkeypatch.delenv(k)
    for k, v in CAPTURE_SAFE_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("NCCL_BUFFSIZE", "1048576")
    monkeypatch.setenv("UNRELATED", "x")
    assert settings_in_force() == {**CAPTURE_SAFE_ENV, "NCCL_BUFFSIZE": "1048576"}


def test_load_into_refuses_a_model_of_another_shape(tmp_path):
    path = ensure_weights(tmp_path / "w.safetensors", SMALL, seed=5)
    want = load_weights(path, shards=shards(SMALL, 2, 0))
    params = {n: torch.zeros_like(t) for n, t in want.items()}
    with pytest.raises(ValueError, match="bytes here"):
        load_into(path, params)  # unsharded file parts into rank-0 sized tensors


def test_tensor_parallel_size_must_divide_heads_and_mlp():
    from coldsnap_reference.model import check_tensor_parallel

    check_tensor_parallel(SMALL, 2)
    with pytest.raises(ValueError, match="multiples"):
        check_tensor_parallel(SMALL, 3)


# --- admission -----------------------------------------------------------------------------------------------------
def _host(n_gpus: int, links: list[str]) -> HostProfile:
    gpus = [GpuInfo(index=i, name="NVIDIA H200", uuid=f"GPU-{i}", memory_mib=143771, compute_capability="9.0")
            for i in range(n_gpus)]
    return HostProfile(arch="x86_64", cpu_model="x", cpu_flags=["sse2"], kernel="6.18", criu_version="4.2.1",
                       driver_version="580.159.04", cuda_version="13.0", gpus=gpus, gpu_links=links)


TP2 = Distributed(world_size=2, backend="nccl", devices=["cuda:0", "cuda:1"], settings={"NCCL_P2P_DISABLE": "1"})


def test_admission_refuses_a_distributed_capsule_on_another_gpu_count():
    captured = _host(2, ["0-1:NV18"])
    assert admit(captured, _host(2, ["0-1:NV18"]), distributed=TP2).admitted
    one = admit(captured, _host(1, []), distributed=TP2)
    assert not one.admitted and "captured with 2 ranks on a host of 2 GPU(s), this host has 1" in one.sentence()
    four = admit(captured, _host(4, ["0-1:NV18", "0-2:NV18", "0-3:NV18", "1-2:NV18", "1-3:NV18", "2-3:NV18"]),
                 distributed=TP2)
    assert not four.admitted and "this host has 4" in four.sentence()
    # A single-GPU capsule still restores on a bigger host.
    assert admit(_host(1, []), _host(4, []),).admitted


def test_admission_refuses_a_distributed_capsule_on_another_topology():
    verdict = admit(_host(2, ["0-1:NV18"]), _host(2, ["0-1:SYS"]), distributed=TP2)
    assert not verdict.admitted and "GPU topology 0-1:NV18 vs 0-1:SYS here" in verdict.sentence()
    # Relaxed compatibility does not relax what breaks a restore.
    assert not admit(_host(2, ["0-1:NV18"]), _host(2, ["0-1:SYS"]), "relaxed", TP2).admitted


# --- the whole path, for real --------------------------------------------------------------------------------------
def _capture_and_restore_twice(tmp_path_factory, monkeypatch, devices: list[str], opts: dict):
    from conftest import CRIU_PREFIX

    from coldsnap.base.procfs import alive, descendants
    from coldsnap.flows.capture import capture, engine_info
    from coldsnap.flows.restore import restore
    from coldsnap.workload.process import inner_pid, stop_workload
    from coldsnap.workload.state import list_states

    root = tmp_path_factory.mktemp("tp")
    monkeypatch.setenv("COLDSNAP_HOME", str(root / "home"))
    monkeypatch.setenv("COLDSNAP_RUN", str(root / "run"))
    monkeypatch.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
    monkeypatch.delenv("COLDSNAP_STORE", raising=False)
    req = CaptureRequest(operation="capture", engine={"name": "reference", "options": {"tensor_parallel": 2, **opts}},
                         launch=Launch(devices=devices), lifecycle={"name": "pyt-tp"}, tag="pyt-tp")
    cap = capture(req)
    profile = cap.profile
    assert profile.distributed is not None and profile.distributed.world_size == 2
    assert profile.distributed.settings["NCCL_P2P_DISABLE"] == "1"
    assert profile.launch.env["NCCL_SHM_DISABLE"] == "1"  # every rank started under it
    # On GPUs each rank's part of the weights file is recorded by GPU, for the restore's prefetchers.
    assert len(profile.prefetch_plans) == (2 if devices else 0) and set(profile.prefetch_plans) <= set(
        profile.gpus_used)
    try:
        for _ in range(2):
            r = restore(RestoreRequest(operation="restore", capsule=cap.capsule, policy={"fallback_to_cold": False}))
            assert r.state == "succeeded", r
            res = r.result
            assert res.validated_text == profile.expected_text
            assert res.ranks == Ranks(restored=2, expected=2)
            prefetch = res.hydrate.prefetch
            if devices and "skipped" not in prefetch:  # each GPU got its rank's part only
                assert all(p.get("pieces") for p in prefetch["per_gpu"].values()), prefetch
            info = engine_info(*res.url.removeprefix("http://").split(":"))
            assert len(info["tensor_parallel"]["ranks"]) == 2
            tree = [res.pid, *descendants(res.pid)]  # one tree: the peer restored as rank 0's child
            assert {inner_pid(p) for p in tree} >= {r["pid"] for r in info["tensor_parallel"]["ranks"]}
            stop_workload([w for w in list_states() if w.name == "pyt-tp"][0])
            assert not any(alive(p) for p in tree)
        return cap
    finally:
        for w in list_states():
            stop_workload(w)


@pytest.mark.slow
def test_two_ranks_on_gloo_capture_and_restore_as_one_unit(tmp_path_factory, monkeypatch):
    needs_root_criu()
    _capture_and_restore_twice(tmp_path_factory, monkeypatch, [], {})


@pytest.mark.slow
def test_two_gpu_ranks_on_nccl_capture_and_restore_as_one_unit(tmp_path_factory, monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (runs on the device tool's nvidia-h200-x2 machine; "
                    "results in bench/results/reference-cuda-tp2*)")
    needs_root_criu()
    _capture_and_restore_twice(tmp_path_factory, monkeypatch, ["cuda"], {"kv_mib": 256})


def test_uniform_generated_weights_are_not_degenerate(tmp_path):
    # The validation compares texts: make sure the small model used here does not decode to a constant.
    path = ensure_weights(tmp_path / "w.safetensors", SMALL, seed=3)
    w = load_weights(path)
    assert float(np.std(w["layers.0.attn.wq.weight"].numpy())) > 0.01


def test_last_words_name_the_first_fatal_event(tmp_path):
    from coldsnap.flows.coldstart import last_words

    log = tmp_path / "engine.log"
    log.write_text('{"event": "phase", "name": "import"}\n{"event": "fatal", "error": "bad model config: heads"}\n'
                   '{"event": "fatal", "error": "rank 1 (pid 2) exited with status 2; stopping the other ranks"}\n')
    assert last_words(log) == "bad model config: heads"
    log.write_text("Traceback (most recent call last):\n  ...\nValueError: no\nbye\n")
    assert last_words(log) == "ValueError: no"
    log.write_text('{"event": "request", "path": "/coldsnap/release"}\nunshare: sigprocmask unblock failed: x\n')
    assert last_words(log) == ""  # neither the launcher's complaint nor an event that is not fatal
    log.write_text("loading\nKilled\n")
    assert last_words(log) == "Killed"
    assert last_words(tmp_path / "missing.log") == ""


@pytest.mark.slow
def test_a_tensor_parallel_size_that_does_not_divide_the_model_is_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import CRIU_PREFIX

    needs_root_criu()
    env = {**os.environ, "COLDSNAP_HOME": str(tmp_path / "home"), "COLDSNAP_RUN": str(tmp_path / "run"),
           "COLDSNAP_CRIU_PREFIX": CRIU_PREFIX}
    r = subprocess.run([sys.executable, "-m", "coldsnap.cli.main", "capture", "--engine-opt", "tensor_parallel=3",
                        "--name", "pyt-tp3"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 9, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("coldsnap: error: workload-failed:") and "multiples of the tensor parallel size 3" in last
    assert "Traceback" not in r.stderr
    assert not os.path.exists("/run/netns/coldsnap-pyt-tp3")
