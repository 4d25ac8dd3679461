"""A capsule is one OCI graph that standard tools copy whole: pushed with a weights payload, its tag names an index
of capsule and payload; the real `oras cp -r` (Debian sid's, packaging/debian/binary.sh) copies it to another
repository, and the copy pulls and restores on a host that has neither the capsule nor its weights, its signature
included."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import CRIU_PREFIX, needs_root_criu
from registry_fixture import registry  # noqa: F401  (fixture)
from test_registry_restore import fast_capture

from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore
from coldsnap.capsule.registry import pull, push
from coldsnap.contracts import Policy, RestoreRequest
from coldsnap.contracts import capsule as mt
from coldsnap.flows.restore import restore
from coldsnap.workload.process import stop_workload
from coldsnap.workload.state import load_state

pytestmark = pytest.mark.slow
BINARY_SH = Path(__file__).resolve().parents[1] / "packaging" / "debian" / "binary.sh"
ORAS = Path("/var/lib/coldsnap/oras/bin/oras")


@pytest.fixture(scope="module")
def oras():
    if os.geteuid() != 0:
        pytest.skip("Debian's oras CLI is provisioned as root (packaging/debian/binary.sh)")
    r = subprocess.run([str(BINARY_SH), "oras", "oras", str(ORAS.parent.parent), "version"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-800:]
    return ORAS


def test_oras_cp_r_carries_capsule_payload_and_signature(registry, oras, tmp_path, monkeypatch):  # noqa: F811
    needs_root_criu()
    monkeypatch.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
    monkeypatch.setenv("COLDSNAP_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "origin"))
    monkeypatch.setenv("COLDSNAP_POLICY_FILE", str(tmp_path / "policy.json"))
    cap = fast_capture("pyt-copy", "copy")
    origin = CapsuleStore(settings().store)
    payload = origin.load(cap.capsule).manifest["annotations"][mt.ANNOTATION_PAYLOAD]
    pushed = push(origin, cap.capsule, f"{registry}/coldsnap/src:v1", insecure=True)
    assert pushed["index"] and pushed["signatures"] == 1

    r = subprocess.run([str(oras), "cp", "-r", "--from-plain-http", "--to-plain-http",
                        f"{registry}/coldsnap/src:v1", f"{registry}/coldsnap/copy:v1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    fetched = subprocess.run([str(oras), "manifest", "fetch", "--plain-http",
                              f"{registry}/coldsnap/copy@{cap.capsule}"], capture_output=True, timeout=60)
    assert fetched.returncode == 0 and fetched.stdout == origin.blob_path(cap.capsule).read_bytes()  # byte-identical

    # A host without the capsule or its weights: the copy's tag is enough.
    weights = cap.profile.model.weights[0]
    shutil.move(str(settings().store), str(tmp_path / "origin-store"))
    os.rename(weights.path, weights.path + ".gone")
    try:
        monkeypatch.setenv("COLDSNAP_STORE", str(tmp_path / "fresh-store"))
        fresh = CapsuleStore(settings().store).init()
        got = pull(fresh, f"{registry}/coldsnap/copy:v1", insecure=True, allow_unpinned=True)
        assert str(got) == cap.capsule and got.payload_bytes > 0 and got.signatures >= 1
        assert fresh.has_blob(payload)
        r = restore(RestoreRequest(operation="restore", capsule=cap.capsule, policy=Policy(fallback_to_cold=False)))
        assert r.state == "succeeded" and r.result["validated_text"] == cap.profile.expected_text
        stop_workload(load_state(r.result["workload"]))
    finally:
        if os.path.exists(weights.path + ".gone"):
            os.replace(weights.path + ".gone", weights.path)
