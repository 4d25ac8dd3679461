"""Capsule trust, for real: a capture is signed with the host's key and Debian's cosign (`cosign verify --key`)
accepts it in a registry the tests start; a capsule signed with `cosign sign --key` is accepted where the restore
policy trusts that key; a capsule pulled unsigned, or signed by a key no rule trusts, is refused; a container whose
image digest differs from the capture, or whose namespace a rule does not name, is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import CRIU_PREFIX, needs_root_criu
from registry_fixture import registry  # noqa: F401  (fixture)
from test_registry_restore import fast_capture

from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore, signing
from coldsnap.capsule.registry import pull, push
from coldsnap.contracts import ColdSnapError, ErrorCode, Policy, RestoreRequest
from coldsnap.flows.admission import admit_capsule
from coldsnap.flows.restore import restore

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
COSIGN_SH = REPO / "packaging" / "trust" / "cosign.sh"
COSIGN = Path("/var/lib/coldsnap/cosign/bin/cosign")


@pytest.fixture(scope="module")
def cosign():
    if os.geteuid() != 0:
        pytest.skip("Debian's cosign is provisioned as root (packaging/trust/cosign.sh)")
    r = subprocess.run([str(COSIGN_SH)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-800:]
    return COSIGN


def run_cosign(cosign, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(cosign), *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "COSIGN_PASSWORD": "", "HOME": str(cwd or "/tmp")})


@pytest.fixture(scope="module")
def origin(registry, tmp_path_factory, cosign):  # noqa: F811
    """A capsule captured (and signed) on an 'origin' host, pushed to the registry."""
    needs_root_criu()
    base = tmp_path_factory.mktemp("trust")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
        mp.setenv("COLDSNAP_RUN", str(base / "run"))
        mp.setenv("COLDSNAP_HOME", str(base / "origin"))
        mp.setenv("COLDSNAP_POLICY_FILE", str(base / "no-policy.json"))
        cap = fast_capture("pyt-trust", "signed")
        store = CapsuleStore(settings().store)
        pushed = push(store, cap.capsule, f"{registry}/coldsnap/trust:signed", insecure=True)
        key = settings().home / "keys" / "capsule.pub"
        yield {"capsule": cap.capsule, "pushed": pushed, "key": key, "base": base, "receipt": cap.receipt}


@pytest.fixture
def fresh_host(origin, tmp_path, monkeypatch):
    """Another host: its own ColdSnap home (its own key), an empty store, a policy file it controls."""
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "fresh"))
    monkeypatch.setenv("COLDSNAP_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("COLDSNAP_POLICY_FILE", str(tmp_path / "policy.json"))
    return tmp_path


def write_policy(path: Path, policy: dict) -> None:
    path.write_text(json.dumps({"format": 1, **policy}))


def prepare(capsule: str):
    return restore(RestoreRequest(operation="prepare", capsule=capsule, policy=Policy(fallback_to_cold=False)))


def test_a_capture_is_signed_and_cosign_verifies_it_in_the_registry(origin, registry, cosign):  # noqa: F811
    assert origin["receipt"].result.signed_by == signing.key_id(signing.load_public_key(origin["key"]))
    assert origin["pushed"]["signatures"] == 1
    r = run_cosign(cosign, "verify", "--key", str(origin["key"]), "--allow-http-registry",
                   "--insecure-ignore-tlog=true", f"{registry}/coldsnap/trust@{origin['capsule']}", cwd=origin["base"])
    assert r.returncode == 0, r.stderr[-1500:]
    assert origin["capsule"].split(":")[1] in r.stdout
    # and it can fail: another key does not verify it
    other = origin["base"] / "other"
    other.mkdir(exist_ok=True)
    assert run_cosign(cosign, "generate-key-pair", cwd=other).returncode == 0
    r = run_cosign(cosign, "verify", "--key", str(other / "cosign.pub"), "--allow-http-registry",
                   "--insecure-ignore-tlog=true", f"{registry}/coldsnap/trust@{origin['capsule']}", cwd=other)
    assert r.returncode != 0


def test_pulled_capsules_restore_only_when_a_trusted_key_signed_them(origin, registry, cosign, fresh_host):  # noqa: F811
    ref = f"{registry}/coldsnap/trust@{origin['capsule']}"
    store = CapsuleStore(settings().store).init()
    got = pull(store, ref, insecure=True)
    assert got.signatures == 1  # the origin's bundle came along
    # Signed, but by the origin's key, which nothing on this host trusts.
    with pytest.raises(ColdSnapError) as e:
        prepare(origin["capsule"])
    assert e.value.code == ErrorCode.UNTRUSTED and "pulled from" in e.value.message
    # A rule naming the origin's key for this repository: admitted.
    write_policy(fresh_host / "policy.json", {"trust": [{"match": f"{registry}/coldsnap/*", "keys": [
        str(origin["key"])]}]})
    assert prepare(origin["capsule"]).state == "succeeded"
    # A rule for another repository does not apply.
    write_policy(fresh_host / "policy.json", {"trust": [{"match": f"{registry}/elsewhere/*", "keys": [
        str(origin["key"])]}]})
    with pytest.raises(ColdSnapError) as e:
        prepare(origin["capsule"])
    assert e.value.code == ErrorCode.UNTRUSTED

    # Signed with `cosign sign --key` by someone this host trusts: pulled again, the cosign signature comes along.
    keys = fresh_host / "cosign"
    keys.mkdir()
    assert run_cosign(cosign, "generate-key-pair", cwd=keys).returncode == 0
    r = run_cosign(cosign, "sign", "--key", str(keys / "cosign.key"), "--allow-http-registry",
                   "--use-signing-config=false", "--tlog-upload=false", "-y", ref, cwd=keys)
    assert r.returncode == 0, r.stderr[-1500:]
    assert pull(store, ref, insecure=True).signatures >= 1  # cosign lists its own (it may replace the index)
    write_policy(fresh_host / "policy.json", {"trust": [{"match": f"{registry}/coldsnap/trust*", "keys": [
        str(keys / "cosign.pub")]}]})
    assert prepare(origin["capsule"]).state == "succeeded"


def test_an_unsigned_capsule_from_a_registry_is_refused(origin, registry, fresh_host, tmp_path):  # noqa: F811
    # Pushed from the origin's store with its signatures removed: the registry holds no signature for it.
    origin_store = CapsuleStore(origin["base"] / "origin" / "store")
    sigs = signing.signatures_dir(origin_store.root, origin["capsule"])
    shutil.move(str(sigs), str(tmp_path / "kept"))
    try:
        assert push(origin_store, origin["capsule"], f"{registry}/coldsnap/unsigned:v1", insecure=True)[
            "signatures"] == 0
    finally:  # the origin's signature back, for the other tests
        shutil.move(str(tmp_path / "kept"), str(sigs))
    store = CapsuleStore(settings().store).init()
    assert pull(store, f"{registry}/coldsnap/unsigned@{origin['capsule']}", insecure=True).signatures == 0
    with pytest.raises(ColdSnapError) as e:
        prepare(origin["capsule"])
    assert e.value.code == ErrorCode.UNTRUSTED and "not signed by a trusted key" in e.value.message
    write_policy(fresh_host / "policy.json", {"pulled": "any"})  # the policy may let unsigned pulls restore
    assert prepare(origin["capsule"]).state == "succeeded"


def test_container_rules_hold_image_digest_and_namespace(origin, fresh_host):
    """Admission of a capsule for a container: the policy's first matching container rule decides."""
    store = CapsuleStore(origin["base"] / "origin" / "store")
    cap = store.load(origin["capsule"])
    image = "sha256:" + "1" * 64
    tagged = store.write_capsule(cap.profile.model_copy(update={"image_digest": image}), cap.layers, {},
                                 tag="team-a/server")
    os.environ["COLDSNAP_STORE"] = str(store.root)
    try:
        capsule = store.load(tagged)
        spec = {"annotations": {"io.kubernetes.cri.sandbox-namespace": "team-a"}}
        write_policy(fresh_host / "policy.json", {"containers": [
            {"match": "team-a/*", "namespaces": ["team-a"], "image_digest": "must-match"}]})

        def refusal(image_digest, namespace="team-a"):
            s = {"annotations": {"io.kubernetes.cri.sandbox-namespace": namespace}}
            a = admit_capsule(capsule, Policy(compatibility="relaxed"), "criu-process", image_digest, s)
            return None if a.admitted else (a.untrusted, a.sentence())

        assert refusal(image) is None
        untrusted, why = refusal("sha256:" + "2" * 64)
        assert untrusted and "is not the captured image" in why and "containers[0]" in why
        untrusted, why = refusal(None)
        assert untrusted and "io.coldsnap.image-digest" in why
        untrusted, why = refusal(image, namespace="team-b")
        assert untrusted and "team-b" in why
        assert admit_capsule(capsule, Policy(compatibility="relaxed"), "criu-process", image, spec).admitted
    finally:
        del os.environ["COLDSNAP_STORE"]


def test_a_policy_that_does_not_parse_refuses_every_restore(origin, fresh_host):
    (fresh_host / "policy.json").write_text('{"format": 1, "trust": [{"match": "*"}]}')  # keys missing
    os.environ["COLDSNAP_STORE"] = str(origin["base"] / "origin" / "store")
    try:
        with pytest.raises(ColdSnapError) as e:
            prepare(origin["capsule"])
        assert e.value.code == ErrorCode.ENVIRONMENT and "policy.json" in e.value.message
    finally:
        del os.environ["COLDSNAP_STORE"]


def test_environment_values_never_leave_and_secret_names_are_flagged(origin, tmp_path, monkeypatch):
    """A capture whose workload has a token in its environment: the value is in no receipt, log or inspect output;
    the name is recorded, and inspect warns that it travelled."""
    import sys

    from coldsnap.contracts import CaptureRequest
    from coldsnap.flows.capture import capture

    monkeypatch.setenv("COLDSNAP_HOME", str(origin["base"] / "origin"))
    secret = "hf_s3cr3t-do-not-print-" + os.urandom(4).hex()
    cap = capture(CaptureRequest(operation="capture", engine={"name": "reference", "options": {"compile": False}},
                                 lifecycle={"name": "pyt-secret"}, tag="secret", launch={"env": {"HF_TOKEN": secret}}))
    store = CapsuleStore(settings().store)
    assert "HF_TOKEN" in store.load(cap.capsule).manifest["annotations"]["io.coldsnap.env-names"].split(",")
    r = subprocess.run([sys.executable, "-m", "coldsnap.cli", "inspect", cap.capsule], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["secret_like_env"] == ["HF_TOKEN"] and "HF_TOKEN" in r.stderr and "warning" in r.stderr
    assert out["trust"]["provenance"] == "capture" and out["trust"]["signed_by"]
    for text in [r.stdout, r.stderr, *(p.read_text(errors="replace") for p in settings().receipts.rglob("*")
                                      if p.is_file())]:
        assert secret not in text
