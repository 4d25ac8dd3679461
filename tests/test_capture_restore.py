"""Capture and restore of the reference engine in process mode, with real CRIU (no mocks)."""

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
from conftest import CRIU_PREFIX, needs_root_criu

from coldsnap.base.paths import settings
from coldsnap.base.procfs import alive
from coldsnap.capsule import CapsuleStore
from coldsnap.contracts import CaptureRequest, ColdSnapError, ErrorCode, Policy, RestoreRequest
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.results import CaptureFacts
from coldsnap.flows.capture import capture
from coldsnap.flows.receipts import receipt_path
from coldsnap.flows.restore import restore
from coldsnap.workload.process import stop_workload
from coldsnap.workload.state import list_states, load_state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    needs_root_criu()
    root = tmp_path_factory.mktemp("cs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLDSNAP_HOME", str(root / "home"))
        mp.setenv("COLDSNAP_RUN", str(root / "run"))
        mp.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
        mp.delenv("COLDSNAP_STORE", raising=False)
        yield root


def netns_exists(name):
    return os.path.exists(f"/run/netns/coldsnap-{name}")


@pytest.fixture(scope="module")
def captured(env):
    req = CaptureRequest(operation="capture", lifecycle={"name": "pyt-ref"}, tag="pyt-ref")
    res = capture(req)
    return res


def stop(name):
    for ws in list_states():
        if ws.name == name:
            stop_workload(ws)


def test_capture_writes_a_private_verified_capsule_and_stops_the_workload(captured):
    r = captured.receipt
    assert r.state == "succeeded" and r.operation == "capture"
    assert {"cold-start", "pin-weights", "criu-dump", "pack"} <= {s.name for s in r.spans}
    # What the engine released before the dump (here the KV cache: CPU weights are file-backed) is on record.
    assert r.result.release["released"] is True and r.result.release["freed_bytes"] > 0
    assert stat.S_IMODE(os.stat(receipt_path(r.operation_id)).st_mode) == 0o600
    store = CapsuleStore(settings().store)
    cap = store.load(captured.capsule)
    store.verify(cap)
    assert cap.manifest["artifactType"] == mt.ARTIFACT_TYPE
    assert {d.media_type for d in cap.layers} >= {mt.LAYER_CRIU, mt.LAYER_WEIGHTS_MANIFEST}
    p = cap.profile
    assert p.snapshot_driver == "criu-process" and p.weights_mode == "recovery"
    assert p.expected_text and p.model and p.model.weights[0].sha256
    assert any(f.path.endswith("engine.log") for f in p.files)
    assert "--tcp-established" in p.criu_options
    # Everything that can hold process memory is private; the weights payload is a hard link of the pinned
    # (public, read-only) weights file and keeps its mode.
    weight_blobs = {d.digest.split(":")[1] for d in cap.layers if d.media_type == mt.LAYER_WEIGHTS}
    assert weight_blobs == {p.model.weights[0].sha256}
    for blob in store.blobs.iterdir():
        if blob.name not in weight_blobs:
            assert stat.S_IMODE(blob.stat().st_mode) == 0o600, blob
    # The captured workload is gone, with its namespace.
    assert not netns_exists("pyt-ref")
    assert list_states() == []


def test_restore_twice_from_one_capsule(captured):
    texts = []
    for _ in range(2):
        r = restore(RestoreRequest(operation="restore", capsule=captured.capsule,
                                   policy=Policy(fallback_to_cold=False)))
        assert r.state == "succeeded"
        res = r.result
        assert res.validated_text == captured.profile.expected_text
        assert 0 < res.time_to_first_token_s < 30
        names = [s.name for s in r.spans]
        assert names[:5] == ["admit", "stage", "network", "criu-restore", "hydrate"]
        ws = load_state(res.workload)
        assert ws.origin == "restored" and alive(ws.pid)
        texts.append(res.validated_text)
        stop_workload(ws)
        assert not alive(ws.pid) and not netns_exists("pyt-ref")
    assert texts[0] == texts[1]


def lazy_pages_daemons():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[0].endswith(b"criu") and argv[1] == b"lazy-pages":
            found.append(int(pid))
    return found


def test_lazy_pages_restore_is_ready_only_once_every_page_is_in(captured, monkeypatch):
    """COLDSNAP_LAZY_PAGES=1: CRIU's lazy-pages daemon brings the memory in behind the running tree; the restore
    validates, waits for the daemon to finish cleanly, and leaves no daemon behind."""
    before = lazy_pages_daemons()
    monkeypatch.setenv("COLDSNAP_LAZY_PAGES", "1")
    r = restore(RestoreRequest(operation="restore", capsule=captured.capsule, policy=Policy(fallback_to_cold=False)))
    assert r.state == "succeeded" and r.result.validated_text == captured.profile.expected_text
    assert "--lazy-pages" in r.result.criu_options
    assert r.result.lazy_pages["all_in_s"] >= r.result.time_to_first_token_s > 0
    assert lazy_pages_daemons() == before
    ws = load_state(r.result.workload)
    stop_workload(ws)
    monkeypatch.setenv("COLDSNAP_LAZY_PAGES", "0")  # the default: CRIU copies every page before the tree runs
    r = restore(RestoreRequest(operation="restore", capsule=captured.capsule, policy=Policy(fallback_to_cold=False)))
    assert r.state == "succeeded" and "--lazy-pages" not in r.result.criu_options and not r.result.lazy_pages
    stop_workload(load_state(r.result.workload))


def test_a_lazy_pages_daemon_that_fails_fails_the_restore(tmp_path):
    """Its exit status is the restore's: pages it never brought would read as zeros."""
    from coldsnap.criu import LazyPages

    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    daemon = LazyPages(str(fake), tmp_path, tmp_path)
    assert not daemon.listening(timeout=5)  # gone without a socket: the restore copies every page instead
    with pytest.raises(ColdSnapError) as e:
        daemon.finish()
    assert e.value.code == ErrorCode.CRIU_FAILED and "lazy-pages failed" in e.value.message


def test_native_weights_travel_as_a_payload_beside_the_images(env):
    """native: the engine saves its weights as they are in memory, drops them, and the file goes beside the images
    as a content-addressed payload; a host without the file gets it back from the payload at restore."""
    res = capture(CaptureRequest(operation="capture", lifecycle={"name": "pyt-native"}, tag="pyt-native",
                                 policy={"weights_mode": "native"}))
    assert res.receipt.state == "succeeded"
    p = res.profile
    assert p.weights_mode == "native" and p.kv_discarded
    saved = p.model.weights[0]
    assert ".native-" in saved.path and stat.S_IMODE(os.stat(saved.path).st_mode) == 0o600
    store = CapsuleStore(settings().store)
    cap = store.load(res.capsule)
    # the saved weights are a layer of their own, reached from the capsule's manifest (not in its images)
    assert [d.digest for d in cap.layers if d.media_type == mt.LAYER_WEIGHTS] == ["sha256:" + saved.sha256]
    assert mt.ANNOTATION_PAYLOAD not in cap.annotations
    own = sum(d.size for d in cap.layers if d.media_type != mt.LAYER_WEIGHTS)
    assert res.receipt.facts(CaptureFacts).capsule_bytes == own  # the receipt's size is the capsule's own

    os.unlink(saved.path)  # as on a host that never had it
    r = restore(RestoreRequest(operation="restore", capsule=res.capsule, policy=Policy(fallback_to_cold=False)))
    try:
        assert r.state == "succeeded"
        assert r.result.validated_text == p.expected_text
        assert os.path.exists(saved.path)  # put back from the payload, digest verified
        reload = r.result.hydrate.engine_resume["weights_reload"]
        assert reload["bytes"] > 0.9 * saved.size  # the weights came back from that file (header and padding aside)
    finally:
        stop("pyt-native")


def test_sleep_without_cuda_is_refused_and_the_engine_serves_on(captured):
    """Engine sleep releases through the engine first; with no CUDA state to checkpoint (CPU) the sleep is refused
    and the release undone: the workload answers as before. (On the GPU machine the same path sleeps and wakes:
    bench/results/reference-cuda-sleep-wake.receipts.json.)"""
    from coldsnap.contracts import WorkloadRequest
    from coldsnap.flows.lifecycle import sleep
    from coldsnap.workload.probe import ValidationProbe

    r = restore(RestoreRequest(operation="restore", capsule=captured.capsule, policy=Policy(fallback_to_cold=False)))
    try:
        ws = load_state(r.result.workload)
        assert (ws.engine, ws.weights_mode) == ("reference", "recovery")
        with pytest.raises(ColdSnapError) as e:
            sleep(WorkloadRequest(operation="sleep", workload=ws.name, sleep_mode="engine"))
        assert e.value.code == ErrorCode.INVALID_REQUEST and "no CUDA processes" in e.value.message
        host, port = ws.url.removeprefix("http://").rsplit(":", 1)
        probe = ValidationProbe(host, int(port), captured.profile.validation)
        assert probe.complete(expected=captured.profile.expected_text).text == captured.profile.expected_text
        assert load_state(ws.name).state == "active"
    finally:
        stop("pyt-ref")


def test_prepare_only_touches_no_workload(captured):
    r = restore(RestoreRequest(operation="prepare", capsule=captured.capsule))
    assert r.state == "succeeded" and r.operation == "prepare"
    assert not netns_exists("pyt-ref") and list_states() == []


def test_restore_refuses_while_the_address_is_in_use(captured):
    r = restore(RestoreRequest(operation="restore", capsule=captured.capsule))
    try:
        with pytest.raises(ColdSnapError) as e:
            restore(RestoreRequest(operation="restore", capsule=captured.capsule))
        assert e.value.code == ErrorCode.RESOURCE_BUSY
        assert alive(load_state(r.result.workload).pid)  # the running one is untouched
    finally:
        stop("pyt-ref")


def test_unpinned_reference_is_refused(captured):
    with pytest.raises(ColdSnapError) as e:
        restore(RestoreRequest(operation="restore", capsule="pyt-ref"))
    assert e.value.code == ErrorCode.CAPSULE_UNPINNED


def _copy_home(env, name):
    """A second home whose store is a copy, so a test can damage it without touching the shared capsule."""
    home = env / name
    shutil.copytree(env / "home" / "store", home / "store")
    (home / "models").symlink_to(env / "home" / "models")
    return home


def test_corrupt_blob_is_refused_and_nothing_starts(captured, env, monkeypatch):
    home = _copy_home(env, "corrupt")
    monkeypatch.setenv("COLDSNAP_HOME", str(home))
    store = CapsuleStore(settings().store)
    cap = store.load(captured.capsule)
    blob = store.blob_path(cap.layer(mt.LAYER_CRIU).digest)
    with open(blob, "r+b") as f:
        f.seek(1000)
        f.write(b"\0corrupt\0")
    with pytest.raises(ColdSnapError) as e:
        restore(RestoreRequest(operation="restore", capsule=captured.capsule))
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT
    assert e.value.receipt.state == "failed"
    assert not netns_exists("pyt-ref") and list_states() == []


def test_incompatible_profile_is_refused_or_falls_back_cold(captured, env, monkeypatch):
    home = _copy_home(env, "incompatible")
    monkeypatch.setenv("COLDSNAP_HOME", str(home))
    store = CapsuleStore(settings().store)
    cap = store.load(captured.capsule)
    foreign = cap.profile.model_copy(update={"host": cap.profile.host.model_copy(update={"kernel": "5.4.0-other"})})
    digest = store.write_capsule(foreign, cap.layers, {})

    with pytest.raises(ColdSnapError) as e:
        restore(RestoreRequest(operation="restore", capsule=digest, policy=Policy(fallback_to_cold=False)))
    assert e.value.code == ErrorCode.INCOMPATIBLE and "kernel 5.4.0-other" in e.value.message
    assert e.value.receipt.state == "refused"
    assert not netns_exists("pyt-ref")

    r = restore(RestoreRequest(operation="restore", capsule=digest))
    try:
        assert r.state == "fell-back"
        assert "kernel 5.4.0-other" in r.result.fallback_reason
        assert r.result.validated_text == captured.profile.expected_text
        assert load_state("pyt-ref").origin == "cold"
    finally:
        stop("pyt-ref")

    relaxed = restore(RestoreRequest(operation="prepare", capsule=digest, policy=Policy(compatibility="relaxed")))
    assert relaxed.state == "succeeded"


def test_a_workload_that_never_validates_times_out_and_leaves_nothing(env):
    store = CapsuleStore(settings().store).init()
    before = set(store.blobs.iterdir())
    req = CaptureRequest(operation="capture", lifecycle={"name": "pyt-never"},
                         launch={"command": ["sleep", "600.25"]}, validation={"ready_timeout_s": 1.5})
    with pytest.raises(ColdSnapError) as e:
        capture(req)
    assert e.value.code == ErrorCode.VALIDATION_TIMEOUT
    assert e.value.receipt.state == "failed"
    assert not netns_exists("pyt-never")
    assert set(store.blobs.iterdir()) == before
    out = subprocess.run(["pgrep", "-fx", "sleep 600.25"], capture_output=True, text=True)  # ours, not any sleep
    assert out.stdout.strip() == ""


def test_cli_restore_exit_codes(captured, env):
    cmd = [sys.executable, "-m", "coldsnap.cli.main"]
    r = subprocess.run(cmd + ["restore", "--capsule", "pyt-ref"], capture_output=True, text=True)
    assert r.returncode == 4 and "not pinned" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(cmd + ["restore", "--capsule", "sha256:" + "0" * 64], capture_output=True, text=True)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    r = subprocess.run(cmd + ["restore", "--capsule", captured.capsule, "--prepare-only", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "succeeded"
