"""A capsule is one OCI graph that standard tools copy whole: its manifest reaches every blob through descriptors,
its weights included (layers of their own), so the real `oras cp` (Debian sid's, packaging/debian/binary.sh) and
the real `skopeo copy` (Debian's, packaging/registry/ensure.sh) copy it to another repository by its tag or by its
digest, and the copy pulls and restores on a host that has neither the capsule nor its weights, its signature
included where the tool copies it (skopeo copies tags, not referrers: the signature's tag, sha256-<hex>, is copied
beside it, as for cosign's). In the local store, every blob is reachable from index.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import test_registry_restore as registry_restore
from registry_fixture import registry  # noqa: F401  (fixture)
from test_registry_restore import fast_capture

from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore
from coldsnap.capsule.registry import pull, push
from coldsnap.contracts import Policy, RestoreRequest
from coldsnap.flows.restore import restore
from coldsnap.workload.process import stop_workload
from coldsnap.workload.state import load_state

pytestmark = pytest.mark.slow
BINARY_SH = Path(__file__).resolve().parents[1] / "packaging" / "debian" / "binary.sh"
ORAS = Path("/var/lib/coldsnap/oras/bin/oras")
ENSURE = Path(__file__).resolve().parents[1] / "packaging" / "registry" / "ensure.sh"


@pytest.fixture(scope="module")
def oras():
    if os.geteuid() != 0:
        pytest.skip("Debian's oras CLI is provisioned as root (packaging/debian/binary.sh)")
    r = subprocess.run([str(BINARY_SH), "oras", "oras", str(ORAS.parent.parent), "version"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-800:]
    return ORAS


@pytest.fixture(scope="module")
def skopeo():
    if os.geteuid() != 0:
        pytest.skip("Debian's skopeo is installed as root (packaging/registry/ensure.sh)")
    r = subprocess.run([str(ENSURE), "skopeo"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-800:]
    return shutil.which("skopeo")


def unreachable_blobs(store: CapsuleStore) -> set[str]:
    """Blobs of the store that no descriptor reaches from index.json (manifests, their configs and layers, the
    manifests of an index): what an OCI tool may skip when it copies the layout, or collect."""
    seen: set[str] = set()
    todo = [m["digest"] for m in store.index()]
    while todo:
        digest = todo.pop()
        if digest in seen or not store.has_blob(digest):
            continue
        seen.add(digest)
        try:
            doc = json.loads(store.blob_path(digest).read_bytes())
        except ValueError:
            continue  # a layer
        if isinstance(doc, dict):
            todo += [d["digest"] for d in [doc.get("config") or {}, *(doc.get("layers") or []),
                                           *(doc.get("manifests") or [])] if d.get("digest")]
    return {"sha256:" + p.name for p in store.blobs.iterdir()} - seen


def origin_host(tmp_path, monkeypatch) -> None:
    """The capturing host (test_registry_restore's), with a restore policy file."""
    registry_restore.origin_host(tmp_path, monkeypatch)
    monkeypatch.setenv("COLDSNAP_POLICY_FILE", str(tmp_path / "policy.json"))


def _restores_on_a_fresh_host(registry, cap, ref, tmp_path, monkeypatch):  # noqa: F811
    """ref pulls into an empty store, weights file gone, with its weights and signature; the capsule restores."""
    weights = cap.profile.model.weights[0]
    origin = CapsuleStore(settings().store)
    assert not unreachable_blobs(origin)
    shutil.move(str(settings().store), str(tmp_path / "origin-store"))
    os.rename(weights.path, weights.path + ".gone")
    try:
        monkeypatch.setenv("COLDSNAP_STORE", str(tmp_path / "fresh-store"))
        fresh = CapsuleStore(settings().store).init()
        got = pull(fresh, ref, insecure=True, allow_unpinned=True)
        assert str(got) == cap.capsule and got.payload_bytes > 0 and got.signatures >= 1
        assert fresh.has_blob("sha256:" + weights.sha256) and not unreachable_blobs(fresh)
        r = restore(RestoreRequest(operation="restore", capsule=cap.capsule, policy=Policy(fallback_to_cold=False)))
        assert r.state == "succeeded" and r.result.validated_text == cap.profile.expected_text
        stop_workload(load_state(r.result.workload))
    finally:
        if os.path.exists(weights.path + ".gone"):
            os.replace(weights.path + ".gone", weights.path)


def test_skopeo_copy_all_carries_capsule_weights_and_signature(registry, skopeo, tmp_path,  # noqa: F811
                                                               monkeypatch):
    origin_host(tmp_path, monkeypatch)
    cap = fast_capture("pyt-skopeo", "skopeo")
    pushed = push(CapsuleStore(settings().store), cap.capsule, f"{registry}/coldsnap/src:v2", insecure=True)
    assert pushed["signatures"] == 1
    for tag in ("v2", cap.capsule.replace(":", "-")):  # the capsule's tag, then its signature's
        r = subprocess.run([skopeo, "copy", "--all", "--src-tls-verify=false", "--dest-tls-verify=false",
                            f"docker://{registry}/coldsnap/src:{tag}", f"docker://{registry}/coldsnap/scopy:{tag}"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-1500:]
    _restores_on_a_fresh_host(registry, cap, f"{registry}/coldsnap/scopy:v2", tmp_path, monkeypatch)


def test_oras_cp_r_carries_capsule_weights_and_signature(registry, oras, tmp_path, monkeypatch):  # noqa: F811
    origin_host(tmp_path, monkeypatch)
    cap = fast_capture("pyt-copy", "copy")
    origin = CapsuleStore(settings().store)
    pushed = push(origin, cap.capsule, f"{registry}/coldsnap/src:v1", insecure=True)
    assert pushed["signatures"] == 1

    r = subprocess.run([str(oras), "cp", "-r", "--from-plain-http", "--to-plain-http",
                        f"{registry}/coldsnap/src:v1", f"{registry}/coldsnap/copy:v1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    fetched = subprocess.run([str(oras), "manifest", "fetch", "--plain-http",
                              f"{registry}/coldsnap/copy@{cap.capsule}"], capture_output=True, timeout=60)
    assert fetched.returncode == 0 and fetched.stdout == origin.blob_path(cap.capsule).read_bytes()  # byte-identical

    # A host without the capsule or its weights: the copy's tag is enough.
    _restores_on_a_fresh_host(registry, cap, f"{registry}/coldsnap/copy:v1", tmp_path, monkeypatch)


def test_a_copy_by_the_capsule_digest_is_whole(registry, oras, skopeo, tmp_path, monkeypatch):  # noqa: F811
    """`oras cp -r R/a@<capsule digest> R/b:v1` and `skopeo copy` of the digest (no index involved): the weights
    come with the capsule; each copy pulls whole, and the oras copy (signature included) restores on a fresh host."""
    origin_host(tmp_path, monkeypatch)
    cap = fast_capture("pyt-bydigest", "bydigest")
    push(CapsuleStore(settings().store), cap.capsule, f"{registry}/coldsnap/dsrc:v1", insecure=True)
    r = subprocess.run([str(oras), "cp", "-r", "--from-plain-http", "--to-plain-http",
                        f"{registry}/coldsnap/dsrc@{cap.capsule}", f"{registry}/coldsnap/dcopy:v1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    r = subprocess.run([skopeo, "copy", "--src-tls-verify=false", "--dest-tls-verify=false",
                        f"docker://{registry}/coldsnap/dsrc@{cap.capsule}", f"docker://{registry}/coldsnap/scopy2:v1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    skopeo_copy = CapsuleStore(tmp_path / "skopeo-copy-store").init()
    got = pull(skopeo_copy, f"{registry}/coldsnap/scopy2@{cap.capsule}", insecure=True)
    weights = "sha256:" + cap.profile.model.weights[0].sha256
    assert got.payload_bytes > 0 and skopeo_copy.has_blob(weights) and not unreachable_blobs(skopeo_copy)
    _restores_on_a_fresh_host(registry, cap, f"{registry}/coldsnap/dcopy@{cap.capsule}", tmp_path, monkeypatch)
