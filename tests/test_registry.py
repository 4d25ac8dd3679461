"""Capsules in a real OCI registry (Debian's docker-registry 2.8): push/pull, verification, resume, dedup, gc."""

import base64
import hashlib
import json
import mmap
import os
import threading
import time
import warnings

import pytest
import requests
from registry_fixture import ensure_registry, registry  # noqa: F401  (pytest fixture)

from coldsnap.capsule import CapsuleStore, bloblocks, remote
from coldsnap.capsule import gc as capsule_gc
from coldsnap.capsule import registry as reg_mod
from coldsnap.capsule.registry import pull, push
from coldsnap.contracts import CapsuleProfile, CapturedFile, ColdSnapError, ErrorCode, HostProfile, NetworkPlan
from coldsnap.contracts import capsule as mt
from coldsnap_bench.registry import LocalRegistry, free_port

MIB = 1 << 20


def profile(engine="reference"):
    return CapsuleProfile(
        created="2026-11-29T00:00:00Z", snapshot_driver="criu-process",
        host=HostProfile(arch="x86_64", cpu_model="c", cpu_flags=[], kernel="k", criu_version="4.2.1"),
        engine={"name": engine}, weights_mode="native", kv_discarded=False, launch={}, validation={},
        expected_text="t",
        network=NetworkPlan(netns="coldsnap-a", host_veth="csh0", workload_veth="eth0", host_address="169.254.237.1",
                            workload_address="169.254.237.2", port=8000))


def random_layer(store, tmp_path, size, media_type=mt.LAYER_CRIU):
    path = tmp_path / f"layer-{os.urandom(4).hex()}"
    with open(path, "wb") as f:
        for left in range(size, 0, -MIB):
            f.write(os.urandom(min(MIB, left)))
    return store.put_file(path, media_type, move=True)


def make_capsule(store, tmp_path, layers=None, tag="demo", engine="reference", annotations=None):
    layers = layers if layers is not None else [random_layer(store, tmp_path, 20 * MIB)]
    digest = store.write_capsule(profile(engine), layers, {mt.ANNOTATION_ENGINE: engine, **(annotations or {})},
                                 tag=tag)
    return digest, layers


def blob_sizes(store, digest):
    m = json.loads(store.blob_path(digest).read_bytes())
    return {d["digest"]: d["size"] for d in [m["config"], *m["layers"]]}


@pytest.fixture
def src(tmp_path):
    return CapsuleStore(tmp_path / "src").init()


@pytest.fixture
def dst(tmp_path):
    return CapsuleStore(tmp_path / "dst").init()


@pytest.fixture(autouse=True)
def no_ambient_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("COLDSNAP_REGISTRY_USER", raising=False)
    monkeypatch.delenv("COLDSNAP_REGISTRY_PASSWORD", raising=False)


def registry_blob_file(registry, digest):  # noqa: F811
    hexd = digest.split(":")[1]
    return registry.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexd[:2] / hexd / "data"


def store_files(store):
    return sorted(p.name for p in store.blobs.iterdir()), sorted(p.name for p in (store.root / "tmp").iterdir())


# --- push / pull ------------------------------------------------------------------------------------------------
def test_round_trip_is_byte_identical(registry, src, dst, tmp_path):  # noqa: F811
    small = src.put_bytes(b'{"files": []}', mt.LAYER_WEIGHTS_MANIFEST)
    digest, _ = make_capsule(src, tmp_path, [random_layer(src, tmp_path, 20 * MIB), small])
    sizes = blob_sizes(src, digest)
    ref = f"{registry}/coldsnap/roundtrip:v1"
    res = push(src, digest, ref, insecure=True)
    assert res["digest"] == digest and res["bytes_transferred"] == sum(sizes.values())
    assert sorted(res["blobs_uploaded"]) == sorted(sizes)
    # The registry holds the stored manifest bytes unchanged (same digest), artifactType included.
    r = requests.get(f"http://{registry}/v2/coldsnap/roundtrip/manifests/v1",
                     headers={"Accept": mt.MANIFEST_MEDIA_TYPE})
    assert r.content == src.blob_path(digest).read_bytes()
    assert r.headers["Docker-Content-Digest"] == digest
    assert r.json()["artifactType"] == mt.ARTIFACT_TYPE
    # Pushing again moves nothing.
    again = push(src, digest, ref, insecure=True)
    assert again["bytes_transferred"] == 0 and sorted(again["blobs_present"]) == sorted(sizes)

    got = pull(dst, f"{registry}/coldsnap/roundtrip:v1@{digest}", insecure=True)
    assert got == digest and isinstance(got, str)
    assert got.bytes_transferred == sum(sizes.values())
    assert store_files(dst)[0] == store_files(src)[0]
    for p in src.blobs.iterdir():
        assert (dst.blobs / p.name).read_bytes() == p.read_bytes()
    assert store_files(dst)[1] == []  # no partials or locks left behind
    cap = dst.load(digest)
    dst.verify(cap)
    assert dst.resolve(f"{registry}/coldsnap/roundtrip:v1", allow_unpinned=True) == digest
    # Pulling again moves nothing; an unpinned pull (allowed) resolves the same capsule.
    assert pull(dst, f"{registry}/coldsnap/roundtrip@{digest}", insecure=True).bytes_transferred == 0
    assert pull(dst, ref, insecure=True, allow_unpinned=True) == digest


def test_unpinned_pull_is_refused(registry, dst):  # noqa: F811
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/roundtrip:v1", insecure=True)
    assert e.value.code == ErrorCode.CAPSULE_UNPINNED


@pytest.mark.parametrize("how", ["same-size", "truncated"])
def test_tampered_blob_is_refused_and_nothing_kept(registry, src, dst, tmp_path, how):  # noqa: F811
    digest, (layer,) = make_capsule(src, tmp_path)
    push(src, digest, f"{registry}/coldsnap/tamper-{how}:v1", insecure=True)
    data = registry_blob_file(registry, layer.digest)
    data.write_bytes(os.urandom(layer.size) if how == "same-size" else data.read_bytes()[: layer.size // 2])
    before = dst.index()
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/tamper-{how}@{digest}", insecure=True)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT and layer.digest in e.value.message
    assert dst.index() == before
    assert store_files(dst) == ([], [])


def test_interrupted_pull_resumes(registry, src, dst, tmp_path):  # noqa: F811
    digest, (layer,) = make_capsule(src, tmp_path)
    ref = f"{registry}/coldsnap/resume@{digest}"
    push(src, digest, f"{registry}/coldsnap/resume:v1", insecure=True)

    class Interrupted(Exception):
        pass

    def cut_after_first_chunk(blob, done, total):
        if blob == layer.digest:
            raise Interrupted

    with pytest.raises(Interrupted):
        pull(dst, ref, insecure=True, progress=cut_after_first_chunk)
    part = dst.root / "tmp" / f"{layer.digest[7:]}.partial"
    kept = part.stat().st_size
    assert 0 < kept < layer.size
    assert not dst.has_blob(layer.digest) and not dst.has_blob(digest) and dst.index() == []

    seen = []
    got = pull(dst, ref, insecure=True, progress=lambda b, d, t: seen.append((b, d)))
    assert got == digest
    assert got.bytes_transferred == layer.size - kept < layer.size
    config = json.loads(src.blob_path(digest).read_bytes())["config"]
    assert got.resumed_bytes == kept + config["size"]  # the config came whole in the first pull: staged, verified
    assert seen[0] == (layer.digest, kept + min(reg_mod.READ_CHUNK, layer.size - kept))
    assert dst.blob_path(layer.digest).read_bytes() == src.blob_path(layer.digest).read_bytes()
    assert not part.exists()


def test_a_pulled_blob_is_written_back_as_it_arrives(registry, src, dst, tmp_path, monkeypatch):  # noqa: F811
    """The disk writes a pulled blob while the rest arrives (coldsnap.base.files.WriteBehind), from where a resumed
    pull continues: the final fsync waits for the last windows, not for gigabytes at the disk's rate."""
    from coldsnap.base import files

    digest, (layer,) = make_capsule(src, tmp_path)
    push(src, digest, f"{registry}/coldsnap/writeback:v1", insecure=True)
    monkeypatch.setattr(files, "WRITEBACK_WINDOW", 4 * MIB)
    calls, real = [], files._sync_file_range
    monkeypatch.setattr(files, "_sync_file_range", lambda fd, o, n, fl: calls.append((o, n, fl, real(fd, o, n, fl))))
    part = dst.root / "tmp" / f"{layer.digest[7:]}.partial"
    part.write_bytes(src.blob_path(layer.digest).read_bytes()[:3 * MIB])  # a partial from an earlier pull
    pull(dst, f"{registry}/coldsnap/writeback@{digest}", insecure=True)
    assert dst.blob_path(layer.digest).read_bytes() == src.blob_path(layer.digest).read_bytes()
    started = [(o, n) for o, n, fl, _ in calls if fl == 2]  # SYNC_FILE_RANGE_WRITE: start, do not wait
    assert started[0][0] == 3 * MIB and all(n >= 4 * MIB for _, n in started)  # from the resumed end, by windows
    assert all(a + n == b for (a, n), (b, _) in zip(started, started[1:]))  # in order, nothing skipped
    assert layer.size - (started[-1][0] + started[-1][1]) < 4 * MIB  # only the tail is left to the fsync
    assert {rc for *_, rc in calls} == {0}  # the kernel took every call on this file system


def test_write_behind_can_be_left_to_the_kernel(tmp_path, monkeypatch):
    from coldsnap.base import files

    calls = []
    monkeypatch.setattr(files, "_sync_file_range", lambda *a: calls.append(a) or 0)
    for mib, expected in (("0", 0), ("1", 3), ("not a number", 0)):  # the default window is 32 MiB: not reached
        monkeypatch.setenv("COLDSNAP_WRITEBACK_MIB", mib)
        calls.clear()
        behind = files.WriteBehind(0)
        for _ in range(3):
            behind.wrote(MIB)
        assert len(calls) == expected, mib


def test_resume_restarts_when_the_server_ignores_range(registry, src, dst, tmp_path, monkeypatch):  # noqa: F811
    digest, (layer,) = make_capsule(src, tmp_path)
    push(src, digest, f"{registry}/coldsnap/norange:v1", insecure=True)
    part = dst.root / "tmp" / f"{layer.digest[7:]}.partial"
    part.write_bytes(b"garbage that is not a prefix")  # a stale partial: the server's 200 replaces it
    send = remote.Client._send

    def drop_range(self, method, url, headers=None, **kw):
        return send(self, method, url, headers={k: v for k, v in (headers or {}).items() if k != "Range"}, **kw)

    monkeypatch.setattr(remote.Client, "_send", drop_range)
    got = pull(dst, f"{registry}/coldsnap/norange@{digest}", insecure=True)
    assert got.bytes_transferred == sum(blob_sizes(src, digest).values())
    dst.verify(dst.load(digest))


def test_corrupt_partial_is_redownloaded(registry, src, dst, tmp_path):  # noqa: F811
    digest, (layer,) = make_capsule(src, tmp_path)
    push(src, digest, f"{registry}/coldsnap/badpartial:v1", insecure=True)
    part = dst.root / "tmp" / f"{layer.digest[7:]}.partial"
    part.write_bytes(os.urandom(3 * MIB))  # resumable-looking, but wrong bytes
    got = pull(dst, f"{registry}/coldsnap/badpartial@{digest}", insecure=True)
    assert got.bytes_transferred == sum(blob_sizes(src, digest).values()) + layer.size - 3 * MIB
    dst.verify(dst.load(digest))


def test_shared_layer_moves_once(registry, src, dst, tmp_path):  # noqa: F811
    shared = random_layer(src, tmp_path, 20 * MIB)
    own_a, own_b = random_layer(src, tmp_path, MIB), random_layer(src, tmp_path, MIB)
    a, _ = make_capsule(src, tmp_path, [shared, own_a], tag="a", engine="vllm")
    b, _ = make_capsule(src, tmp_path, [shared, own_b], tag="b", engine="sglang")
    push(src, a, f"{registry}/coldsnap/shared:a", insecure=True)
    pb = push(src, b, f"{registry}/coldsnap/shared:b", insecure=True)
    assert shared.digest in pb["blobs_present"]  # the registry already had it
    first = pull(dst, f"{registry}/coldsnap/shared@{a}", insecure=True)
    second = pull(dst, f"{registry}/coldsnap/shared@{b}", insecure=True)
    config_b = json.loads(src.blob_path(b).read_bytes())["config"]
    assert first.bytes_transferred == sum(blob_sizes(src, a).values())
    assert second.bytes_transferred == own_b.size + config_b["size"]
    assert shared.digest in second.blobs_present and shared.digest not in second.blobs_fetched
    for d in (a, b):
        dst.verify(dst.load(d))


def test_concurrent_pulls_of_one_capsule(registry, src, dst, tmp_path):  # noqa: F811
    digest, _ = make_capsule(src, tmp_path)
    push(src, digest, f"{registry}/coldsnap/concurrent:v1", insecure=True)
    results, errors = [], []

    def one():
        try:
            results.append(pull(CapsuleStore(dst.root), f"{registry}/coldsnap/concurrent@{digest}", insecure=True))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [digest] * 3
    assert sum(r.bytes_transferred for r in results) == sum(blob_sizes(src, digest).values())
    dst.verify(dst.load(digest))
    assert store_files(dst)[1] == []


# --- errors -------------------------------------------------------------------------------------------------------
def test_connection_refused_is_a_registry_error(src, dst, tmp_path):
    digest, _ = make_capsule(src, tmp_path, [src.put_bytes(b"x", mt.LAYER_CRIU)])
    host = f"127.0.0.1:{free_port()}"
    t = time.monotonic()
    for call in (lambda: push(src, digest, f"{host}/coldsnap/x:v1", insecure=True),
                 lambda: pull(dst, f"{host}/coldsnap/x@{digest}", insecure=True)):
        with pytest.raises(ColdSnapError) as e:
            call()
        assert e.value.code == ErrorCode.REGISTRY and "connection refused" in e.value.message
    assert time.monotonic() - t < 5  # no retry-with-sleep loop


def test_not_found_and_foreign_artifacts(registry, src, dst, tmp_path):  # noqa: F811
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/nothing-here:v1", insecure=True, allow_unpinned=True)
    assert e.value.code == ErrorCode.CAPSULE_NOT_FOUND
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/nothing-here@sha256:{'0' * 64}", insecure=True)
    assert e.value.code == ErrorCode.CAPSULE_NOT_FOUND
    # An OCI artifact that is not a capsule is refused before any blob moves.
    base = f"http://{registry}/v2/coldsnap/foreign"
    loc = requests.post(f"{base}/blobs/uploads/").headers["Location"]
    requests.put(f"{loc}&digest=sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", data=b"{}")
    foreign = {"schemaVersion": 2, "mediaType": mt.MANIFEST_MEDIA_TYPE, "artifactType": "application/x-other",
               "config": {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                          "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"},
               "layers": []}
    assert requests.put(f"{base}/manifests/v1", data=json.dumps(foreign),
                        headers={"Content-Type": mt.MANIFEST_MEDIA_TYPE}).status_code == 201
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/foreign:v1", insecure=True, allow_unpinned=True)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT and "not a ColdSnap capsule" in e.value.message
    assert store_files(dst) == ([], [])
    with pytest.raises(ColdSnapError) as e:
        push(src, "sha256:" + "1" * 64, f"{registry}/coldsnap/x:v1", insecure=True)
    assert e.value.code == ErrorCode.CAPSULE_NOT_FOUND


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    ensure_registry()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt
    work = tmp_path_factory.mktemp("auth-registry")
    htpasswd = work / "htpasswd"
    htpasswd.write_text(f"alice:{crypt.crypt('s3cret', crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n")
    reg = LocalRegistry.start(work, htpasswd=htpasswd)
    try:
        yield reg
    finally:
        reg.stop()


def test_credentials(auth_registry, src, dst, tmp_path, monkeypatch):
    digest, _ = make_capsule(src, tmp_path, [random_layer(src, tmp_path, 2 * MIB)])
    ref = f"{auth_registry}/coldsnap/private:v1"
    with pytest.raises(ColdSnapError) as e:
        push(src, digest, ref, insecure=True)
    assert e.value.code == ErrorCode.REGISTRY and "needs credentials" in e.value.message
    monkeypatch.setenv("COLDSNAP_REGISTRY_USER", "alice")
    monkeypatch.setenv("COLDSNAP_REGISTRY_PASSWORD", "wrong")
    with pytest.raises(ColdSnapError) as e:
        push(src, digest, ref, insecure=True)
    assert e.value.code == ErrorCode.REGISTRY and "refused" in e.value.message
    monkeypatch.setenv("COLDSNAP_REGISTRY_PASSWORD", "s3cret")
    assert push(src, digest, ref, insecure=True)["digest"] == digest
    # Credentials from the docker config file.
    monkeypatch.delenv("COLDSNAP_REGISTRY_USER")
    monkeypatch.delenv("COLDSNAP_REGISTRY_PASSWORD")
    cfg = tmp_path / "home" / ".docker" / "config.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(json.dumps({"auths": {str(auth_registry): {"auth": base64.b64encode(b"alice:s3cret").decode()}}}))
    assert pull(dst, f"{auth_registry}/coldsnap/private@{digest}", insecure=True) == digest
    dst.verify(dst.load(digest))


# --- ls / rm / gc -------------------------------------------------------------------------------------------------
def test_ls_rm_gc(src, tmp_path):
    shared = random_layer(src, tmp_path, 2 * MIB)
    own_a, own_b = random_layer(src, tmp_path, MIB), random_layer(src, tmp_path, MIB)
    payload = src.put_bytes(b"native weights payload", "application/octet-stream")
    a, _ = make_capsule(src, tmp_path, [shared, own_a], tag="a", engine="vllm")
    b, _ = make_capsule(src, tmp_path, [shared, own_b], tag="b", engine="sglang",
                        annotations={mt.ANNOTATION_PAYLOAD: payload.digest})
    stray = src.put_bytes(b"unreferenced", "application/octet-stream")

    rows = {r["tag"]: r for r in capsule_gc.list_capsules(src)}
    assert set(rows) == {"a", "b"}
    assert rows["a"]["digest"] == a and rows["a"]["engine"] == "vllm" and rows["a"]["created"]
    assert rows["a"]["size"] == src.blob_path(a).stat().st_size + sum(blob_sizes(src, a).values())
    assert rows["b"]["complete"]

    # Young unreferenced blobs survive the default grace period (a capture in flight writes them first).
    assert capsule_gc.gc(src)["freed_bytes"] == 0 and src.has_blob(stray.digest)

    assert capsule_gc.remove(src, "a") == [a]
    assert [r["tag"] for r in capsule_gc.list_capsules(src)] == ["b"]
    assert src.has_blob(a)  # rm only untags
    with pytest.raises(ColdSnapError) as e:
        capsule_gc.remove(src, "a")
    assert e.value.code == ErrorCode.CAPSULE_NOT_FOUND

    # tmp: an old stray file and an old unlocked partial go; a partial with a live lock and a young file stay.
    tmp = src.root / "tmp"
    old = time.time() - 2 * 3600
    (tmp / "stale.123").write_bytes(b"x" * 10)
    (tmp / ("a" * 64 + ".partial")).write_bytes(b"y" * 20)
    (tmp / ("b" * 64 + ".partial")).write_bytes(b"z" * 30)
    (tmp / "fresh.456").write_bytes(b"w")
    for name in ("stale.123", "a" * 64 + ".partial", "b" * 64 + ".partial"):
        os.utime(tmp / name, (old, old))
    lock = bloblocks.lock_path(src, "sha256:" + "b" * 64)
    fd = bloblocks.acquire_blob_lock(lock)
    try:
        config_a = json.loads(src.blob_path(a).read_bytes())["config"]
        manifest_a_size = src.blob_path(a).stat().st_size
        res = capsule_gc.gc(src, grace_s=0)
    finally:
        bloblocks.release_blob_lock(lock, fd)
    gone = {a, own_a.digest, config_a["digest"], stray.digest}
    assert set(res["removed_blobs"]) == gone
    assert res["tmp_removed"] == 2 and res["tmp_freed_bytes"] == 30
    assert res["freed_bytes"] == 30 + manifest_a_size + own_a.size + config_a["size"] + len(b"unreferenced")
    assert sorted(p.name for p in tmp.iterdir()) == ["b" * 64 + ".partial", "fresh.456"]
    for d in (shared.digest, own_b.digest, payload.digest, b):
        assert src.has_blob(d)
    for d in gone:
        assert not src.has_blob(d)
    src.verify(src.load(b))
    again = capsule_gc.gc(src, grace_s=0)  # nothing left to free but the partial whose lock is gone now
    assert again["removed_blobs"] == [] and again["freed_bytes"] == 30


def test_push_refuses_a_corrupt_local_blob(registry, src, tmp_path):  # noqa: F811
    digest, (layer,) = make_capsule(src, tmp_path, [random_layer(src, tmp_path, 3 * MIB)])
    path = src.blob_path(layer.digest)
    path.write_bytes(os.urandom(layer.size))  # same size, other bytes: only the registry's hash can tell
    with pytest.raises(ColdSnapError) as e:
        push(src, digest, f"{registry}/coldsnap/badlocal:v1", insecure=True)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT and layer.digest in e.value.message
    assert requests.head(f"http://{registry}/v2/coldsnap/badlocal/blobs/{layer.digest}").status_code == 404
    assert requests.get(f"http://{registry}/v2/coldsnap/badlocal/manifests/v1").status_code == 404


@pytest.mark.parametrize("ref", ["noslash:v1", "host/UPPER:v1", "host/repo@sha256:abc", "/repo:v1", "host/repo:b@d"])
def test_bad_references(ref, src, dst):
    with pytest.raises(ColdSnapError) as e:
        pull(dst, ref, insecure=True, allow_unpinned=True)
    assert e.value.code == ErrorCode.INVALID_REQUEST
    assert remote.parse_remote("localhost:5000/a/b-c:v1.2@sha256:" + "0" * 64) == remote.RemoteRef(
        "localhost:5000", "a/b-c", "v1.2", "sha256:" + "0" * 64)


def test_gc_removes_cuda_code_files_nothing_uses(src, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    files = {}
    for name in ("listed", "orphan", "mapped"):
        data = name.encode() * 5000
        files[name] = code / f"sha256-{hashlib.sha256(data).hexdigest()}.cubin"
        files[name].write_bytes(data)
    (code / "notes.txt").write_text("not a code file: left alone")
    listed = CapturedFile(path=str(files["listed"]), size=files["listed"].stat().st_size, mode=0o600)
    src.write_capsule(profile().model_copy(update={"files": [listed]}), [random_layer(src, tmp_path, MIB)],
                      {mt.ANNOTATION_ENGINE: "reference"}, tag="with-code")
    with open(files["mapped"], "rb") as f:
        held = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # a running workload maps it
    try:
        assert capsule_gc.gc(src, grace_s=3600, code_dir=code)["code_removed"] == 0  # young: kept
        res = capsule_gc.gc(src, grace_s=0, code_dir=code)
    finally:
        held.close()
    assert res["code_removed"] == 1 and res["freed_bytes"] >= len(b"orphan" * 5000)
    assert sorted(p.name for p in code.iterdir()) == sorted([files["listed"].name, files["mapped"].name, "notes.txt"])


def test_store_hygiene(registry, src, dst, tmp_path):  # noqa: F811
    from old_capsules import write_payload

    from coldsnap.capsule.store import Descriptor
    from coldsnap.contracts import WeightFile

    # (a) pulling by digest a capsule that is already indexed (under a tag) lists it once
    digest, (layer,) = make_capsule(src, tmp_path, [random_layer(src, tmp_path, MIB)])
    push(src, digest, f"{registry}/coldsnap/hygiene:v1", insecure=True)
    pull(src, f"{registry}/coldsnap/hygiene@{digest}", insecure=True)
    assert [m["digest"] for m in src.index()].count(digest) == 1
    # (b) a pull refused as corrupt leaves no blob behind, not even the weights payload it fetched first
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(os.urandom(MIB))
    wf = WeightFile(path=str(weights), sha256=hashlib.sha256(weights.read_bytes()).hexdigest())
    payload = write_payload(src, [wf])
    with_payload, (player,) = make_capsule(src, tmp_path, [random_layer(src, tmp_path, MIB)], tag="p",
                                           annotations={mt.ANNOTATION_PAYLOAD: payload})
    push(src, with_payload, f"{registry}/coldsnap/hygiene-payload:v1", insecure=True)
    registry_blob_file(registry, player.digest).write_bytes(os.urandom(player.size))
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/hygiene-payload@{with_payload}", insecure=True)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT
    assert store_files(dst) == ([], []) and dst.index() == []
    # (b') a refused weights payload takes the capsule's own blobs, fetched before it, with it
    weights2 = tmp_path / "w2.safetensors"
    weights2.write_bytes(os.urandom(MIB))
    wf2 = WeightFile(path=str(weights2), sha256=hashlib.sha256(weights2.read_bytes()).hexdigest())
    with_payload2, _ = make_capsule(src, tmp_path, [random_layer(src, tmp_path, MIB)], tag="p2",
                                    annotations={mt.ANNOTATION_PAYLOAD: write_payload(src, [wf2])})
    push(src, with_payload2, f"{registry}/coldsnap/hygiene-payload:v2", insecure=True)
    registry_blob_file(registry, "sha256:" + wf2.sha256).write_bytes(os.urandom(MIB))
    seen = []
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/hygiene-payload@{with_payload2}", insecure=True,
             on_blobs=lambda d, m: seen.append(sorted(p.name for p in dst.blobs.iterdir())))
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT
    assert len(seen) == 1 and len(seen[0]) == 3  # profile, layer and manifest were in before the weights came
    assert store_files(dst) == ([], []) and dst.index() == []
    # (c) a tag that names a plain OCI image index (as copy tools rewrite ColdSnap's): one capsule among its
    # manifests is the capsule it names; two are answered for what they are
    other, _ = make_capsule(src, tmp_path, [random_layer(src, tmp_path, MIB)], tag="other")
    push(src, other, f"{registry}/coldsnap/hygiene:other", insecure=True)

    def index_of(*digests):
        return json.dumps({"schemaVersion": 2, "mediaType": mt.INDEX_MEDIA_TYPE, "manifests": [
            {"mediaType": mt.MANIFEST_MEDIA_TYPE, "digest": d, "size": src.blob_path(d).stat().st_size}
            for d in digests]})

    for tag, listed in (("one", [digest]), ("two", [digest, other])):
        assert requests.put(f"http://{registry}/v2/coldsnap/hygiene/manifests/{tag}", data=index_of(*listed),
                            headers={"Content-Type": mt.INDEX_MEDIA_TYPE}).status_code == 201
    assert str(pull(dst, f"{registry}/coldsnap/hygiene:one", insecure=True, allow_unpinned=True)) == digest
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/hygiene:two", insecure=True, allow_unpinned=True)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT and "image index" in e.value.message and digest in e.value.message
    # (d) `ls` lists capsules only: another tool's artifact in the layout (a signature) is no row
    sig = src.put_bytes(json.dumps({"schemaVersion": 2, "mediaType": mt.MANIFEST_MEDIA_TYPE,
                                    "artifactType": "application/vnd.dev.cosign.artifact.sig.v1+json",
                                    "config": {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                                               "digest": "sha256:" + "4" * 64}, "layers": []}).encode(),
                        mt.MANIFEST_MEDIA_TYPE)
    src.add_to_index(Descriptor(mt.MANIFEST_MEDIA_TYPE, sig.digest, sig.size), "sha256-sig")
    assert sig.digest not in {r["digest"] for r in capsule_gc.list_capsules(src)}
    assert digest in {r["digest"] for r in capsule_gc.list_capsules(src)}


def test_a_restores_pull_leaves_the_disk_to_it_until_its_first_token(registry, src, dst, tmp_path,  # noqa: F811
                                                                     monkeypatch):
    """A restore's pull (one that hears of its arrivals) lists the capsule's own blobs before their bytes are
    durable: no fsync of them while admission, the unpack and CRIU use them; once the restore is past its first
    token (allow_sync) they are fsynced, remembered durable, and only then is the capsule listed. A weights blob
    is durable before it is listed, as before. A plain pull fsyncs each blob as it comes."""
    from coldsnap.base import digests
    from coldsnap.capsule.pieces import Arrivals

    monkeypatch.setenv("COLDSNAP_PULL_SYNC_LATER", "1")
    own = random_layer(src, tmp_path, 3 * MIB)
    weights = random_layer(src, tmp_path, 2 * MIB, media_type=mt.LAYER_WEIGHTS)
    digest, _ = make_capsule(src, tmp_path, [own, weights], tag="durable")
    push(src, digest, f"{registry}/coldsnap/durable:v1", insecure=True)
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    def synced_blob(d):
        return any(p in (str(dst.blob_path(d)), str(bloblocks.partial_path(dst, d))) for p in synced)

    arrivals, seen, done = Arrivals(), {}, {}

    def on_blobs(d, manifest):
        seen["own_synced"] = synced_blob(own.digest)
        seen["listed"] = dst.has_blob(own.digest)
        seen["memo"] = digests._memo_entry(str(dst.blob_path(own.digest)), dst.blob_path(own.digest).stat())

    def run():
        try:
            done["result"] = pull(dst, f"{registry}/coldsnap/durable@{digest}", insecure=True, on_blobs=on_blobs,
                                  arrivals=arrivals)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            done["error"] = e

    puller = threading.Thread(target=run)
    puller.start()
    try:
        deadline = time.monotonic() + 60
        while "listed" not in seen and time.monotonic() < deadline and puller.is_alive():
            time.sleep(0.02)
        assert seen["listed"] and not seen["own_synced"] and seen["memo"].get("boot")  # trusted this boot only
        while not arrivals.ended and time.monotonic() < deadline:  # every blob in: the pull waits for the token
            time.sleep(0.02)
        assert arrivals.ended and puller.is_alive() and dst.index() == [] and not synced_blob(own.digest)
        assert synced_blob(weights.digest)  # the weights: durable before they were listed
    finally:
        arrivals.allow_sync()
        puller.join(60)
    assert "error" not in done and str(done["result"]) == digest
    assert synced_blob(own.digest) and [m["digest"] for m in dst.index()] == [digest]
    path = dst.blob_path(own.digest)
    assert "boot" not in digests._memo_entry(str(path), path.stat())
    # a capsule with no weights of its own: nothing is used before the pull ends, so nothing waits for a token
    alone, _ = make_capsule(src, tmp_path, [random_layer(src, tmp_path, MIB)], tag="alone")
    push(src, alone, f"{registry}/coldsnap/durable:alone", insecure=True)
    done.clear()
    alone_store, arrivals = CapsuleStore(tmp_path / "alone").init(), Arrivals()
    puller = threading.Thread(target=lambda: done.update(result=pull(
        alone_store, f"{registry}/coldsnap/durable@{alone}", insecure=True, on_blobs=on_blobs, arrivals=arrivals)))
    puller.start()
    puller.join(60)
    alive = puller.is_alive()
    arrivals.allow_sync()
    puller.join(60)
    assert not alive and str(done["result"]) == alone
    synced.clear()
    plain = CapsuleStore(tmp_path / "plain").init()
    pull(plain, f"{registry}/coldsnap/durable@{digest}", insecure=True)
    assert str(plain.blob_path(own.digest)) in synced or str(bloblocks.partial_path(plain, own.digest)) in synced


def test_a_listed_image_blob_that_does_not_hash_to_its_digest_is_fetched_again(registry, src, dst,  # noqa: F811
                                                                               tmp_path):
    """A capsule's own blob already in the store but not its bytes (torn by a power loss before it was durable,
    say) is hashed before it is taken as present, and fetched again."""
    own = random_layer(src, tmp_path, 2 * MIB)
    digest, _ = make_capsule(src, tmp_path, [own], tag="torn")
    push(src, digest, f"{registry}/coldsnap/torn:v1", insecure=True)
    dst.blob_path(own.digest).write_bytes(bytes(own.size))
    pull(dst, f"{registry}/coldsnap/torn@{digest}", insecure=True)
    assert dst.blob_path(own.digest).read_bytes() == src.blob_path(own.digest).read_bytes()


def test_a_restores_pull_fsyncs_as_it_goes_when_told_to(registry, src, dst, tmp_path, monkeypatch):  # noqa: F811
    """COLDSNAP_PULL_SYNC_LATER=0: the capsule's own blobs are durable before the restore is told they are here,
    as a plain pull's are (the other arm of `coldsnap bench --cold-node --arm`)."""
    from coldsnap.capsule.pieces import Arrivals

    monkeypatch.setenv("COLDSNAP_PULL_SYNC_LATER", "0")
    own = random_layer(src, tmp_path, MIB)
    weights = random_layer(src, tmp_path, MIB, media_type=mt.LAYER_WEIGHTS)
    digest, _ = make_capsule(src, tmp_path, [own, weights], tag="sync-now")
    push(src, digest, f"{registry}/coldsnap/sync-now:v1", insecure=True)
    synced, real_fsync, seen = [], os.fsync, []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    part, path = str(bloblocks.partial_path(dst, own.digest)), str(dst.blob_path(own.digest))
    arrivals = Arrivals()
    arrivals.allow_sync()  # were they deferred, the pull would still end (and the assertion say so)
    pull(dst, f"{registry}/coldsnap/sync-now@{digest}", insecure=True, arrivals=arrivals,
         on_blobs=lambda d, m: seen.append(part in synced or path in synced))
    assert seen == [True]
