"""A capsule travels through a real registry to an empty store on a 'fresh host' (no weights file, no blobs) and
restores; a second capsule of the same model moves no weight bytes."""

import os
import shutil
import subprocess

import pytest
from conftest import CRIU_PREFIX, needs_root_criu
from registry_fixture import Throttle, registry  # noqa: F401  (fixture)

from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore
from coldsnap.capsule.registry import pull, push
from coldsnap.contracts import CaptureRequest, Policy, RestoreRequest
from coldsnap.contracts import capsule as mt
from coldsnap.flows.capture import capture
from coldsnap.flows.restore import restore
from coldsnap.workload.process import stop_workload
from coldsnap.workload.state import load_state

pytestmark = pytest.mark.slow


def origin_host(tmp_path, monkeypatch) -> None:
    """The capturing host: real CRIU, and a home and run dir of the test's own."""
    needs_root_criu()
    monkeypatch.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
    monkeypatch.setenv("COLDSNAP_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "origin"))


def fast_capture(name, tag):
    req = CaptureRequest(operation="capture", engine={"name": "reference", "options": {"compile": False}},
                         lifecycle={"name": name}, tag=tag)
    return capture(req)


def captured_and_pushed(registry, name, tag, repo):
    """A capture on the origin host, pushed to the registry as REPO:one; (the capture, its weights file)."""
    cap = fast_capture(name, tag)
    push(CapsuleStore(settings().store), cap.capsule, f"{registry}/coldsnap/{repo}:one", insecure=True)
    return cap, cap.profile.model.weights[0]


def become_a_fresh_host(tmp_path, monkeypatch, weights) -> None:
    """The store moved away and the weights file hidden (put back by the test): no blobs, no weights."""
    shutil.move(str(settings().store), str(tmp_path / "origin-store"))
    os.rename(weights.path, weights.path + ".gone")
    monkeypatch.setenv("COLDSNAP_STORE", str(tmp_path / "fresh-store"))


def test_pull_into_an_empty_store_restores_and_shares_weights(registry, tmp_path, monkeypatch):  # noqa: F811
    origin_host(tmp_path, monkeypatch)
    first = fast_capture("pyt-reg", "one")
    second = fast_capture("pyt-reg", "two")
    assert first.capsule != second.capsule
    origin = CapsuleStore(settings().store)
    shared = {tuple(d.digest for d in origin.load(c.capsule).layers if d.media_type == mt.LAYER_WEIGHTS)
              for c in (first, second)}
    weights = first.profile.model.weights[0]
    assert shared == {("sha256:" + weights.sha256,)}  # the weights are layers of both capsules: the same blob
    r1 = push(origin, first.capsule, f"{registry}/coldsnap/ref:one", insecure=True)
    r2 = push(origin, second.capsule, f"{registry}/coldsnap/ref:two", insecure=True)
    assert "sha256:" + weights.sha256 in r1["blobs_uploaded"] and r1["bytes_transferred"] >= weights.size
    assert "sha256:" + weights.sha256 in r2["blobs_present"]  # the registry already has the weights

    # A fresh host: an empty store and no weights file at the pinned path.
    store_dir = settings().store
    shutil.move(str(store_dir), str(tmp_path / "origin-store"))
    os.rename(weights.path, weights.path + ".gone")
    monkeypatch.setenv("COLDSNAP_STORE", str(tmp_path / "fresh-store"))
    fresh = CapsuleStore(settings().store).init()
    got = pull(fresh, f"{registry}/coldsnap/ref@{first.capsule}", insecure=True)
    assert str(got) == first.capsule and got.payload_bytes > 0
    r = restore(RestoreRequest(operation="restore", capsule=first.capsule, policy=Policy(fallback_to_cold=False)))
    assert r.state == "succeeded"
    assert r.result.validated_text == first.profile.expected_text
    assert os.path.exists(weights.path)  # materialized from the payload, digest verified
    # linked, not copied: the pulled blob takes the pinned file's mode, and the restore did not hash it again
    assert os.path.samefile(weights.path, fresh.blob_path("sha256:" + weights.sha256))
    staging = r.result.stage_parts  # where staging went: the capsule's blobs, the weights, the images, CUDA code
    assert set(staging) == {"verify", "weights", "unpack", "code"}
    assert sum(staging.values()) <= next(s.duration_s for s in r.spans if s.name == "stage")
    admission = r.result.admit_parts  # what admission took: the policy and signatures, this host's profile
    assert set(admission) == {"trust", "host", "host_criu", "host_rest"}  # the look's steps, where it ran
    assert admission["trust"] + admission["host"] <= next(s.duration_s for s in r.spans if s.name == "admit")
    assert admission["host_criu"] + admission["host_rest"] <= admission["host"] + 0.01  # looked at in admission
    stop_workload(load_state(r.result.workload))

    got2 = pull(fresh, f"{registry}/coldsnap/ref@{second.capsule}", insecure=True)
    assert got2.payload_bytes == 0  # the second capsule of the same model moves no weight bytes
    assert got2.bytes_transferred > 0


def test_a_restore_of_a_registry_reference_admits_and_stages_while_its_weights_stream_in(
        registry, tmp_path, monkeypatch):  # noqa: F811
    from coldsnap.contracts import ColdSnapError, ErrorCode

    origin_host(tmp_path, monkeypatch)
    cap, weights = captured_and_pushed(registry, "pyt-reg-ref", "one", "byref")
    become_a_fresh_host(tmp_path, monkeypatch, weights)

    ref = f"{registry}/coldsnap/byref@{cap.capsule}"
    said = []
    r = restore(RestoreRequest(operation="restore", capsule=ref, insecure_registry=True,
                               policy=Policy(fallback_to_cold=False)), progress=said.append)
    assert r.state == "succeeded" and r.result.validated_text == cap.profile.expected_text
    assert [s.name for s in r.spans][:3] == ["pull", "admit", "stage"]
    pulled = r.result.pull
    assert pulled["pulled"] and pulled["streamed"] and pulled["digest"] == cap.capsule
    assert pulled["bytes"] > os.path.getsize(weights.path)  # counted once the stream ended
    assert any("admitting and staging it while its weights arrive" in m for m in said)
    assert [s.name for s in r.spans][2:4] == ["stage", "weights"]  # staged while they arrived, placed before CRIU
    assert {"arrive", "weights", "verify", "unpack"} <= set(r.result.stage_parts)
    assert set(r.result.admit_parts) == {"trust", "host", "host_criu", "host_rest"}  # the look began beside the pull
    assert os.path.exists(weights.path)  # the stream brought the weights, checked against their pins
    assert any(m["digest"] == cap.capsule for m in CapsuleStore(settings().store).index())  # listed once whole
    stop_workload(load_state(r.result.workload))

    again = restore(RestoreRequest(operation="restore", capsule=ref, insecure_registry=True,
                                   policy=Policy(fallback_to_cold=False)))
    assert again.state == "succeeded" and again.result.pull == {"from": ref, "pulled": False}  # here already
    stop_workload(load_state(again.result.workload))

    with pytest.raises(ColdSnapError) as e:  # a tag is not a pin
        restore(RestoreRequest(operation="restore", capsule=f"{registry}/coldsnap/byref:one", insecure_registry=True,
                               policy=Policy(fallback_to_cold=False)))
    assert e.value.code == ErrorCode.CAPSULE_UNPINNED and e.value.receipt is not None


@pytest.mark.parametrize("ahead", [True, False], ids=["weights-beside-images", "weights-after-images"])
def test_a_restore_streaming_its_weights_by_pieces_restores_with_criu_while_they_arrive(
        registry, tmp_path, monkeypatch, ahead):  # noqa: F811
    """Weights pinned piece by piece (1 MiB pieces here, so that the test's small model has several): the pull
    fetches them by pieces into a partial file of full size, the restore links it at the weights' path and CRIU
    restores the engine while the pieces still arrive (through a throttling proxy); the CRIU images, in several
    layers (4 MiB each here), are unpacked side by side while they arrive, two fetched by processes of their own,
    the weights moving after them (or beside them: COLDSNAP_PULL_WEIGHTS_AHEAD=1); the pieces land in memory first
    (the spool) and, this engine reading its file itself (no prefetcher on CPU), reach the file once all are
    checked; the engine resumes then, the disk's sync and the store's listing catching up behind; after the restore
    its file is the store's listed blob."""
    origin_host(tmp_path, monkeypatch)
    monkeypatch.setenv("COLDSNAP_PIN_PIECE_MIB", "1")
    monkeypatch.setenv("COLDSNAP_PULL_SPOOL", "1")
    monkeypatch.setenv("COLDSNAP_IMAGES_LAYER_MIB", "4")
    monkeypatch.setenv("COLDSNAP_PULL_WEIGHTS_AHEAD", "1" if ahead else "0")
    cap, weights = captured_and_pushed(registry, "pyt-reg-pieces", "one", "pieces")
    assert len(weights.chunks) >= 3 and weights.chunk_digest == "blake3", weights  # a capture's pins
    images = CapsuleStore(settings().store).load(cap.capsule).layers_of(mt.LAYER_CRIU)
    assert len(images) == 4, images  # the images' layers, at most 4
    become_a_fresh_host(tmp_path, monkeypatch, weights)
    from coldsnap.capsule import registry as registry_client

    monkeypatch.setenv("COLDSNAP_PULL_IMAGE_FETCHERS", "2")  # two layers in processes, two on the pull's threads
    by_process: list = []  # (digest, what a fetching process brought) for each image blob given to one
    real = registry_client._download_by_fetcher
    monkeypatch.setattr(registry_client, "_download_by_fetcher",
                        lambda fetcher, client, desc, *rest: by_process.append(
                            (desc.digest, real(fetcher, client, desc, *rest))) or by_process[-1][1])
    slow = Throttle(registry, rate=max(weights.size // 3, 1 << 20))  # the weights take ~3 s
    try:
        ref = f"{slow.address}/coldsnap/pieces@{cap.capsule}"
        r = restore(RestoreRequest(operation="restore", capsule=ref, insecure_registry=True,
                                   policy=Policy(fallback_to_cold=False)))
    finally:
        slow.close()
    try:
        assert r.state == "succeeded" and r.result.validated_text == cap.profile.expected_text
        names = [s.name for s in r.spans]
        assert "weights" not in names, names  # nothing waited for them before CRIU
        criu = next(s for s in r.spans if s.name == "criu-restore")
        assert criu.start_s + criu.duration_s < r.result.pull["seconds"], (r.spans, r.result.pull)  # mid-stream
        assert r.result.hydrate.weights_wait_s > 0  # the engine's resume waited for the rest
        assert r.result.pull.get("spooled") == 1, r.result.pull  # in memory first, filed for the engine's reads
        assert r.result.stage_parts.get("unpack_early"), r.result.stage_parts  # the images unpacked as they came
        sizes = {d.digest: d.size for d in images}
        assert len(by_process) == 2, by_process  # in processes of their own
        assert all(got == (sizes[d], True) for d, got in by_process), by_process  # whole, digest checked
        steps = r.result.pull["steps_s"]  # where the pull's time went, in the order it went
        for order in (["started", "manifest", "own_blobs", "provenance"],
                      ["manifest", "weights_sized", "own_blobs"] if ahead else ["provenance", "weights_sized"],
                      ["weights_sized", "weights_checked"]):
            assert [steps[k] for k in order] == sorted(steps[k] for k in order), (order, steps)
        assert steps["weights_checked"] - steps["weights_sized"] > 1.0, steps  # the throttled weights, ~3 s
        store = CapsuleStore(settings().store)
        assert any(m["digest"] == cap.capsule for m in store.index())
        assert os.path.samefile(weights.path, store.blob_path("sha256:" + weights.sha256))
    finally:
        stop_workload(load_state(r.result.workload))
        os.replace(weights.path + ".gone", weights.path)


@pytest.mark.parametrize("pieces", [False, True, "direct"], ids=["one-stream", "by-pieces", "by-pieces-direct"])
def test_a_streamed_restore_whose_weights_fail_their_pin_fails_and_lists_nothing(registry, tmp_path,  # noqa: F811
                                                                                 monkeypatch, pieces):
    """A weights blob altered in the registry: the restore, already admitted and staged while the weights came,
    fails with exit 4 (no cold start: the capsule is what is wrong), leaves no workload, and the store lists
    nothing and keeps no blob. By pieces, CRIU has restored the engine meanwhile: the engine never resumes, and
    the link at the weights' path goes with it. Direct (COLDSNAP_PULL_DIRECT=1), no prefetcher takes the pieces on
    CPU: the pull fetches them itself, and refuses the same."""
    from test_registry import registry_blob_file

    from coldsnap.contracts import ColdSnapError, ErrorCode
    from coldsnap.workload.state import list_states

    origin_host(tmp_path, monkeypatch)
    if pieces:
        monkeypatch.setenv("COLDSNAP_PIN_PIECE_MIB", "1")
    if pieces == "direct":
        monkeypatch.setenv("COLDSNAP_PULL_DIRECT", "1")
    cap, weights = captured_and_pushed(registry, "pyt-reg-bad", "bad", "badweights")
    blob = registry_blob_file(registry, "sha256:" + weights.sha256)
    original = blob.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    become_a_fresh_host(tmp_path, monkeypatch, weights)
    try:
        with pytest.raises(ColdSnapError) as e:
            restore(RestoreRequest(operation="restore", capsule=f"{registry}/coldsnap/badweights@{cap.capsule}",
                                   insecure_registry=True, policy=Policy(fallback_to_cold=True)))
        assert e.value.code == ErrorCode.CAPSULE_CORRUPT and e.value.exit_code == 4, e.value
        assert e.value.receipt is not None and e.value.receipt.state == "failed"
        fresh = CapsuleStore(settings().store)
        assert fresh.index() == [] and not fresh.has_blob("sha256:" + weights.sha256)
        assert not fresh.has_blob(cap.capsule) and not os.path.exists(weights.path)
        assert not [w for w in list_states() if w.name == "pyt-reg-bad"]
        assert "coldsnap-pyt-reg-bad" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                            text=True).stdout
    finally:
        blob.write_bytes(original)
        os.replace(weights.path + ".gone", weights.path)


@pytest.mark.parametrize("ahead", ["auto", "0"], ids=["declined-at-its-profile", "offer-declined"])
def test_a_direct_streamed_restore_nobody_prefetches_fetches_its_weights_itself_and_validates(
        registry, tmp_path, monkeypatch, ahead):  # noqa: F811
    """COLDSNAP_PULL_DIRECT=1 where no GPU prefetcher can take the pieces (a CPU engine: no GPU to load onto). Its
    profile first (the weights beside the images, by default with the direct way): the restore declines the direct
    way before the weights move, and they are spooled as without it. With the weights after the images
    (COLDSNAP_PULL_WEIGHTS_AHEAD=0) the pull offers them, the restore declines the offer, and the pull fetches the
    rest straight into the partial (no spool). Either way CRIU restores meanwhile, the engine reads its file once
    every piece is there: validated, the file the store's listed blob after."""
    origin_host(tmp_path, monkeypatch)
    monkeypatch.setenv("COLDSNAP_PIN_PIECE_MIB", "1")
    monkeypatch.setenv("COLDSNAP_PULL_DIRECT", "1")
    monkeypatch.setenv("COLDSNAP_PULL_SPOOL", "1")
    monkeypatch.setenv("COLDSNAP_PULL_WEIGHTS_AHEAD", ahead)
    cap, weights = captured_and_pushed(registry, "pyt-reg-direct", "direct", "direct")
    become_a_fresh_host(tmp_path, monkeypatch, weights)
    from coldsnap.flows import streaming

    known: list = []  # (capsule, the pull's steps so far) when the restore heard of its profile
    real = streaming.PrefetchAhead.profile_in
    monkeypatch.setattr(streaming.PrefetchAhead, "profile_in", lambda self, capsule, arrivals: known.append(
        (capsule.digest, dict(arrivals.marks))) or real(self, capsule, arrivals))
    r = restore(RestoreRequest(operation="restore", capsule=f"{registry}/coldsnap/direct@{cap.capsule}",
                               insecure_registry=True, policy=Policy(fallback_to_cold=False)))
    try:
        assert r.state == "succeeded" and r.result.validated_text == cap.profile.expected_text
        assert r.result.pull.get("streamed"), r.result.pull
        if ahead == "auto":  # its profile known before its images were in, and the direct way declined then
            assert [d for d, _ in known] == [cap.capsule], known
            assert "manifest" in known[0][1] and "own_blobs" not in known[0][1], known
            assert r.result.pull.get("spooled") == 1 and "direct_offered" not in r.result.pull, r.result.pull
        else:
            assert known == []
            assert "spooled" not in r.result.pull, r.result.pull  # not in memory
            assert r.result.pull.get("direct_offered") == 1, r.result.pull  # offered, and declined
        assert "weights" not in [s.name for s in r.spans]  # CRIU did not wait for them
        assert "no CUDA process" in (r.result.hydrate.prefetch or {}).get("skipped", ""), r.result.hydrate
        store = CapsuleStore(settings().store)
        assert os.path.samefile(weights.path, store.blob_path("sha256:" + weights.sha256))
    finally:
        stop_workload(load_state(r.result.workload))
        os.replace(weights.path + ".gone", weights.path)


@pytest.mark.parametrize("fetchers,ahead", [("0", "0"), ("4", "1")], ids=["threads", "processes-weights-ahead"])
def test_a_restore_whose_images_layer_fails_its_digest_keeps_nothing(registry, tmp_path, monkeypatch,  # noqa: F811
                                                                     fetchers, ahead):
    """One of the CRIU images' layers altered in the registry (the others, and the profile, arrive whole; the
    images unpack while they come), fetched on the pull's threads, or by fetching processes of their own while the
    weights (pinned by pieces) already move beside them: the restore fails with exit 4 before admitting anything,
    naming the blob, the weights' fetch ends with it, and the store keeps no blob, the weights' included."""
    from test_registry import registry_blob_file

    from coldsnap.contracts import ColdSnapError, ErrorCode

    origin_host(tmp_path, monkeypatch)
    monkeypatch.setenv("COLDSNAP_PIN_PIECE_MIB", "1")
    monkeypatch.setenv("COLDSNAP_IMAGES_LAYER_MIB", "4")
    monkeypatch.setenv("COLDSNAP_PULL_IMAGE_FETCHERS", fetchers)
    monkeypatch.setenv("COLDSNAP_PULL_WEIGHTS_AHEAD", ahead)
    cap, weights = captured_and_pushed(registry, "pyt-reg-badimg", "bad", "badimages")
    layers = CapsuleStore(settings().store).load(cap.capsule).layers_of(mt.LAYER_CRIU)
    assert len(layers) > 1 and len(weights.chunks) >= 3, (layers, weights)
    blob = registry_blob_file(registry, layers[-1].digest)
    original = blob.read_bytes()
    blob.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    become_a_fresh_host(tmp_path, monkeypatch, weights)
    try:
        with pytest.raises(ColdSnapError) as e:
            restore(RestoreRequest(operation="restore", capsule=f"{registry}/coldsnap/badimages@{cap.capsule}",
                                   insecure_registry=True, policy=Policy(fallback_to_cold=True)))
        assert e.value.code == ErrorCode.CAPSULE_CORRUPT and e.value.exit_code == 4, e.value
        assert layers[-1].digest in str(e.value), e.value  # the blob that failed is named
        fresh = CapsuleStore(settings().store)
        assert fresh.index() == [] and not list(fresh.blobs.iterdir()), list(fresh.blobs.iterdir())
        assert not os.path.exists(weights.path)
    finally:
        blob.write_bytes(original)
        os.replace(weights.path + ".gone", weights.path)


@pytest.mark.parametrize("pieces", [False, True], ids=["one-stream", "by-pieces"])
def test_a_restore_killed_while_its_weights_stream_lists_nothing_and_the_next_one_works(
        registry, tmp_path, monkeypatch, pieces):  # noqa: F811
    """`coldsnap restore` of a registry reference SIGKILLed in the middle of its weights: the store lists neither
    the capsule nor the weights blob, no workload is left; the next restore completes the pull and validates. By
    pieces, CRIU has restored the engine by then, with the partial linked at the weights' path: what the next
    command does first (coldsnap.flows.recovery) stops it and removes the link."""
    import signal
    import sys
    import time

    from coldsnap.flows.recovery import recover
    from coldsnap.workload.state import list_states

    origin_host(tmp_path, monkeypatch)
    if pieces:
        monkeypatch.setenv("COLDSNAP_PIN_PIECE_MIB", "1")
    cap, weights = captured_and_pushed(registry, "pyt-reg-kill", "kill", "killed")
    become_a_fresh_host(tmp_path, monkeypatch, weights)
    slow = Throttle(registry, rate=max(weights.size // 4, 1 << 20))  # the weights take ~4 s
    try:
        ref = f"{slow.address}/coldsnap/killed@{cap.capsule}"
        proc = subprocess.Popen([sys.executable, "-m", "coldsnap.cli.main", "restore", "--capsule", ref, "--insecure",
                                 "--no-fallback", "--json"], env=dict(os.environ), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        part = tmp_path / "fresh-store" / "tmp" / f"{weights.sha256}.partial"
        deadline = time.monotonic() + 120
        # on their way; by pieces, the partial (full size at once) linked where CRIU restores the engine from
        while not (os.path.exists(weights.path) if pieces else part.exists() and part.stat().st_size > 0):
            assert proc.poll() is None and time.monotonic() < deadline, "the restore ended before its weights came"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert part.exists() and (pieces or part.stat().st_size < weights.size)  # killed mid-stream
        if pieces:
            assert os.path.samefile(weights.path, part)
            assert any("interrupted" in line for line in recover())
        fresh = CapsuleStore(settings().store)
        assert fresh.index() == [] and not fresh.has_blob("sha256:" + weights.sha256)
        assert not os.path.exists(weights.path) and not [w for w in list_states() if w.name == "pyt-reg-kill"]

        # the next restore, straight from the registry (the same capsule by digest): it completes the pull
        r = restore(RestoreRequest(operation="restore", capsule=f"{registry}/coldsnap/killed@{cap.capsule}",
                                   insecure_registry=True, policy=Policy(fallback_to_cold=False)))
        try:
            assert r.state == "succeeded" and r.result.validated_text == cap.profile.expected_text
            assert r.result.pull["pulled"] and fresh.has_blob("sha256:" + weights.sha256) and not part.exists()
            assert any(m["digest"] == cap.capsule for m in fresh.index())
        finally:
            stop_workload(load_state(r.result.workload))
    finally:
        slow.close()
        if os.path.exists(weights.path + ".gone"):
            os.replace(weights.path + ".gone", weights.path)
