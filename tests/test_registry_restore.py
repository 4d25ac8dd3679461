"""A capsule travels through a real registry to an empty store on a 'fresh host' (no weights file, no blobs) and
restores; a second capsule of the same model moves no weight bytes."""

import os
import shutil

import pytest
from conftest import CRIU_PREFIX, needs_root_criu
from registry_fixture import registry  # noqa: F401  (fixture)

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


def fast_capture(name, tag):
    req = CaptureRequest(operation="capture", engine={"name": "reference", "options": {"compile": False}},
                         lifecycle={"name": name}, tag=tag)
    return capture(req)


def test_pull_into_an_empty_store_restores_and_shares_weights(registry, tmp_path, monkeypatch):  # noqa: F811
    needs_root_criu()
    monkeypatch.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
    monkeypatch.setenv("COLDSNAP_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "origin"))
    first = fast_capture("pyt-reg", "one")
    second = fast_capture("pyt-reg", "two")
    assert first.capsule != second.capsule
    origin = CapsuleStore(settings().store)
    payloads = {origin.load(c.capsule).manifest["annotations"][mt.ANNOTATION_PAYLOAD] for c in (first, second)}
    assert len(payloads) == 1  # one shared weights payload
    weights = first.profile.model.weights[0]
    r1 = push(origin, first.capsule, f"{registry}/coldsnap/ref:one", insecure=True)
    r2 = push(origin, second.capsule, f"{registry}/coldsnap/ref:two", insecure=True)
    assert r1["payload"]["bytes_transferred"] >= os.path.getsize(weights.path)  # weights + the empty config
    assert r2["payload"]["bytes_transferred"] == 0  # the registry already has the weights

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
    assert r.result["validated_text"] == first.profile.expected_text
    assert os.path.exists(weights.path)  # materialized from the payload, digest verified
    # linked, not copied: the pulled blob takes the pinned file's mode, and the restore did not hash it again
    assert os.path.samefile(weights.path, fresh.blob_path("sha256:" + weights.sha256))
    staging = r.result["stage_parts"]  # where staging went: the capsule's blobs, the weights, the images
    assert set(staging) == {"verify", "weights", "unpack"}
    assert sum(staging.values()) <= next(s.duration_s for s in r.spans if s.name == "stage")
    stop_workload(load_state(r.result["workload"]))

    got2 = pull(fresh, f"{registry}/coldsnap/ref@{second.capsule}", insecure=True)
    assert got2.payload_bytes == 0  # the second capsule of the same model moves no weight bytes
    assert got2.bytes_transferred > 0
