"""The second snapshot driver, criu-template, for real on the CPU (reference engine, real CRIU): `capture
--snapshot-driver both` captures the engine as a pre-device template (imports, config, weights file opened; the
device untouched), resumes it once for the completion restores are held to, then captures the full workload and
names the template in its annotations. A template capsule restores (CRIU, then the engine does its device work)
and serves the same text; a full capsule that admission refuses for its GPU falls to its template, not to a cold
start, and the receipt says so; a full capsule pushed to a registry takes its template along, and a pull brings
both. On the CPU the template is the whole state; on a GPU the same code path skips the CUDA checkpoint
(packaging/device/template-bench.sh runs it on the H200). vLLM and SGLang say they do not support it yet."""

from __future__ import annotations

import json

import pytest
import requests
from conftest import CRIU_PREFIX, needs_root_criu
from registry_fixture import registry  # noqa: F401  (fixture)

from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore
from coldsnap.capsule.gc import list_capsules
from coldsnap.capsule.registry import pull, push
from coldsnap.contracts import (
    CaptureRequest,
    ColdSnapError,
    ErrorCode,
    GpuInfo,
    HostProfile,
    Policy,
    RestoreRequest,
)
from coldsnap.contracts import capsule as mt
from coldsnap.engines import get_adapter
from coldsnap.flows.admission import admit
from coldsnap.flows.capture import capture
from coldsnap.flows.restore import restore
from coldsnap.workload.process import stop_workload
from coldsnap.workload.state import list_states

NAME = "pyt-template"


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    needs_root_criu()
    root = tmp_path_factory.mktemp("template")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLDSNAP_HOME", str(root / "home"))
        mp.setenv("COLDSNAP_RUN", str(root / "run"))
        mp.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
        mp.delenv("COLDSNAP_STORE", raising=False)
        req = CaptureRequest(operation="capture", engine={"name": "reference", "options": {"compile": False}},
                             lifecycle={"name": NAME}, tag="tpl", snapshot_driver="both")
        yield capture(req)
        for ws in list_states():
            stop_workload(ws)


def _stop(name: str) -> None:
    for ws in list_states():
        if ws.name == name:
            stop_workload(ws)


def test_both_writes_a_template_and_a_full_capsule_that_names_it(both):
    result = both.receipt.result
    template = result.template
    store = CapsuleStore(settings().store)
    full = store.load(both.capsule)
    assert full.profile.snapshot_driver == "criu-process"
    assert full.manifest["annotations"][mt.ANNOTATION_TEMPLATE] == template.capsule
    tpl = store.load(template.capsule)
    assert tpl.profile.snapshot_driver == "criu-template" and tpl.profile.weights_mode == "recovery"
    assert tpl.profile.cuda_pids == 0 and "--template" in tpl.profile.launch.command
    assert template.validated_text == result.validated_text  # the resumed template served the same text
    assert {s["name"] for s in template.spans} >= {"cold-start", "criu-dump", "validate", "pack"}
    tags = {r["tag"]: r["digest"] for r in list_capsules(store)}
    assert tags["tpl-template"] == template.capsule and tags["tpl"] == both.capsule  # tagged side by side


def test_a_template_restores_then_does_its_device_work_and_serves_the_same_text(both):
    template = both.receipt.result.template.capsule
    r = restore(RestoreRequest(operation="restore", capsule=template, policy=Policy(fallback_to_cold=False)))
    try:
        assert r.state == "succeeded" and r.result.snapshot_driver == "criu-template"
        assert r.result.validated_text == both.profile.expected_text
        spans = [s.name for s in r.spans]
        assert spans[-3:] == ["criu-restore", "hydrate", "validate"]
        # the device work inside hydrate, phase by phase, as the template resumed
        phases = r.result.hydrate.engine_resume["phases"]
        assert list(phases)[:3] == ["cuda_init", "load", "build"] and "warmup" in phases
        assert sum(phases.values()) <= r.result.hydrate.engine_resume["seconds"]
    finally:
        _stop(r.result.workload)


def test_a_full_capsule_refused_for_its_gpu_falls_to_its_template_not_to_a_cold_start(both):
    # Simulated refusal: the full capsule's profile rewritten to claim a GPU this host does not have (an H200
    # capsule on a B200 host reads the same: "GPU 0 NVIDIA H200 vs NVIDIA B200 here").
    store = CapsuleStore(settings().store)
    foreign = _claiming_another_gpu(store, both.capsule)
    r = restore(RestoreRequest(operation="restore", capsule=foreign, policy=Policy(fallback_to_cold=False)))
    try:
        assert r.state == "succeeded", r.error
        assert r.result.snapshot_driver == "criu-template"
        assert r.result.capsule == both.receipt.result.template.capsule
        assert r.result.instead_of.capsule == foreign and "GPU" in r.result.instead_of.refused
        assert r.result.validated_text == both.profile.expected_text
    finally:
        _stop(r.result.workload)
    with pytest.raises(ColdSnapError) as e:  # without its template, the same refusal is a refusal
        no_template = _claiming_another_gpu(store, both.capsule, drop=mt.ANNOTATION_TEMPLATE)
        restore(RestoreRequest(operation="restore", capsule=no_template, policy=Policy(fallback_to_cold=False)))
    assert e.value.code == ErrorCode.INCOMPATIBLE


def _claiming_another_gpu(store: CapsuleStore, digest: str, drop: str = "") -> str:
    """Simulated refusal: the full capsule's profile rewritten to claim a GPU this host does not have (without the
    annotation `drop`)."""
    full = store.load(digest)
    gpu = GpuInfo(index=0, name="NVIDIA H200", uuid="GPU-00000000-0000-0000-0000-000000000000", memory_mib=143771,
                  compute_capability="9.0")
    claimed = full.profile.model_copy(update={"host": full.profile.host.model_copy(update={
        "gpus": [gpu], "driver_version": "580.159.04", "cuda_version": "13.0"})})
    return store.write_capsule(claimed, full.layers,
                               {k: v for k, v in full.manifest["annotations"].items() if k != drop})


def test_a_pushed_full_capsule_takes_its_template_and_a_pull_brings_both(both, registry, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    template = both.receipt.result.template.capsule
    pushed = push(CapsuleStore(settings().store), both.capsule, f"{registry}/coldsnap/tpl:one", insecure=True)
    assert pushed["template"]["digest"] == template and pushed["template"]["blobs_uploaded"]

    monkeypatch.setenv("COLDSNAP_STORE", str(tmp_path / "fresh"))  # another node's empty store
    fresh = CapsuleStore(settings().store).init()
    got = pull(fresh, f"{registry}/coldsnap/tpl@{both.capsule}", insecure=True)
    assert str(got) == both.capsule and got.template == {"digest": template, "pulled": True}
    assert fresh.load(template).profile.snapshot_driver == "criu-template"
    r = restore(RestoreRequest(operation="restore", capsule=_claiming_another_gpu(fresh, both.capsule),
                               policy=Policy(fallback_to_cold=False)))
    try:  # the pulled template is what a refused restore falls to there
        assert r.state == "succeeded" and r.result.capsule == template, r.error
        assert r.result.instead_of.refused
    finally:
        _stop(r.result.workload)

    # A registry without the template (a copy that left it behind): the capsule pulls, and the pull says so.
    gone = requests.delete(f"http://{registry}/v2/coldsnap/tpl/manifests/{template}", timeout=10)
    assert gone.status_code == 202, gone.text
    monkeypatch.setenv("COLDSNAP_STORE", str(tmp_path / "fresh2"))
    got = pull(CapsuleStore(settings().store).init(), f"{registry}/coldsnap/tpl@{both.capsule}", insecure=True)
    assert str(got) == both.capsule and got.template == {"digest": template, "pulled": False}


def _host(gpu: str, cc: str, driver: str) -> HostProfile:
    return HostProfile(arch="x86_64", cpu_model="AMD EPYC", cpu_flags=["avx2"], kernel="6.8.0", criu_version="4.2.1",
                       driver_version=driver, cuda_version="13.0",
                       gpus=[GpuInfo(index=0, name=gpu, uuid="GPU-x", memory_mib=1, compute_capability=cc)])


def test_a_template_needs_the_architecture_family_not_the_gpu_model_or_driver():
    captured = _host("NVIDIA H100 80GB HBM3", "9.0", "570.86.15")
    assert not admit(captured, _host("NVIDIA H200", "9.0", "580.159.04")).admitted  # full state: same model/driver
    assert admit(captured, _host("NVIDIA H200", "9.0", "580.159.04"), device_state=False).admitted
    other = admit(captured, _host("NVIDIA B200", "10.0", "580.159.04"), device_state=False)
    assert not other.admitted and "architecture family" in other.sentence()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_vllm_and_sglang_say_they_do_not_support_templates_yet(engine):
    with pytest.raises(ColdSnapError) as e:
        get_adapter(engine).template_launch(CaptureRequest(operation="capture", engine={"name": engine},
                                                           snapshot_driver="template"))
    assert e.value.code == ErrorCode.INVALID_REQUEST and "does not support the criu-template" in e.value.message


def test_capabilities_name_the_template_driver():
    from coldsnap.host.capabilities import capabilities

    assert "criu-template" in json.loads(capabilities().model_dump_json())["snapshot_drivers"]


@pytest.mark.parametrize("args, says", [
    (["--leave-running"], "a template capture stops its workload"),
    (["--engine", "vllm"], "does not support the criu-template"),
])
def test_a_template_capture_that_cannot_be_is_one_line_and_exit_2(tmp_path, args, says):
    import os
    import subprocess
    import sys

    needs_root_criu()
    env = {**os.environ, "COLDSNAP_HOME": str(tmp_path / "home"), "COLDSNAP_RUN": str(tmp_path / "run"),
           "COLDSNAP_CRIU_PREFIX": CRIU_PREFIX}
    r = subprocess.run([sys.executable, "-m", "coldsnap.cli", "capture", "--snapshot-driver", "template", *args],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run" / "workloads").exists() or not any((tmp_path / "run" / "workloads").iterdir())
