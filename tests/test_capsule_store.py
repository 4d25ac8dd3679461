"""The local capsule store: atomic writes, digest verification, pinned references, private permissions."""

import json
import os
import stat
import time

import pytest

from coldsnap.capsule import CapsuleStore, pack_dir, parse_reference, unpack_layer
from coldsnap.contracts import CapsuleProfile, ColdSnapError, ErrorCode, HostProfile, NetworkPlan
from coldsnap.contracts import capsule as mt


def profile():
    return CapsuleProfile(
        created="2026-11-29T00:00:00Z", snapshot_driver="criu-process",
        host=HostProfile(arch="x86_64", cpu_model="c", cpu_flags=[], kernel="k", criu_version="4.2.1"),
        engine={"name": "reference"}, weights_mode="native", kv_discarded=False, launch={}, validation={},
        expected_text="t",
        network=NetworkPlan(netns="coldsnap-a", host_veth="csh0", workload_veth="eth0", host_address="169.254.237.1",
                            workload_address="169.254.237.2", port=8000))


@pytest.fixture
def store(tmp_path, coldsnap_home):
    return CapsuleStore(tmp_path / "store").init()


def make_capsule(store, tmp_path, payload=b"criu images"):
    src = tmp_path / "images"
    src.mkdir(exist_ok=True)
    (src / "pages-1.img").write_bytes(payload)
    tar = tmp_path / "layer.tar.zst"
    pack_dir(src, tar)
    layer = store.put_file(tar, mt.LAYER_CRIU)
    return store.write_capsule(profile(), [layer], {"io.coldsnap.engine": "reference"}, tag="demo")


def test_layout_and_permissions(store, tmp_path):
    digest = make_capsule(store, tmp_path)
    assert json.loads((store.root / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((store.root / "index.json").read_text())
    assert index["manifests"][0]["digest"] == digest
    assert index["manifests"][0]["artifactType"] == mt.ARTIFACT_TYPE
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    for blob in store.blobs.iterdir():
        assert stat.S_IMODE(blob.stat().st_mode) == 0o600
    cap = store.load(digest)
    assert cap.manifest["artifactType"] == mt.ARTIFACT_TYPE
    assert cap.profile == profile()
    store.verify(cap)


def test_layer_round_trip(store, tmp_path):
    digest = make_capsule(store, tmp_path, payload=os.urandom(3 << 20))
    cap = store.load(digest)
    out = tmp_path / "out"
    unpack_layer(store.blob_path(cap.layer(mt.LAYER_CRIU).digest), out)
    assert (out / "pages-1.img").read_bytes() == (tmp_path / "images" / "pages-1.img").read_bytes()


def test_a_large_layer_is_frames_unpacked_on_several_cores_and_a_cut_one_is_refused(tmp_path):
    from coldsnap.capsule.pack import FRAME, _frames

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    big = os.urandom(1 << 20) * 20 + bytes(8 << 20) + os.urandom(5 << 20) + bytes(3 << 20)  # 36 MiB, zero runs
    (src / "pages-1.img").write_bytes(big)
    (src / "sub" / "small").write_bytes(b"x" * 700)
    (src / "empty").write_bytes(b"")
    layer = tmp_path / "layer.tar.zst"
    pack_dir(src, layer)
    with open(layer, "rb") as f:
        frames = _frames(f.fileno(), os.path.getsize(layer))
    assert frames is not None and len(frames) == -(-(len(big) + 3 * 1024) // FRAME)  # one per FRAME of tar
    out = tmp_path / "out"
    unpack_layer(layer, out)
    assert (out / "pages-1.img").read_bytes() == big and (out / "sub" / "small").read_bytes() == b"x" * 700
    assert (out / "empty").read_bytes() == b""
    assert os.stat(out / "pages-1.img").st_blocks * 512 < len(big)  # the zero runs are holes
    bad = tmp_path / "bad.tar.zst"  # cut inside its second frame (a layer's digest is checked before; this is
    bad.write_bytes(layer.read_bytes()[:frames[1][0] + frames[1][1] // 2])  # what unpack itself must refuse)
    with pytest.raises(ColdSnapError) as e:
        unpack_layer(bad, tmp_path / "bad-out")
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT


def arriving(blob: bytes, part, growing, stop_at: int | None = None):
    """A thread writing blob into part a MiB at a time, as a pull does, telling growing; stop_at: it breaks there."""
    import threading

    def write() -> None:
        with open(part, "wb") as f:
            growing.started(part, len(blob), 0)
            for at in range(0, len(blob), 1 << 20):
                if stop_at is not None and at >= stop_at:
                    growing.broke()
                    return
                f.write(blob[at:at + (1 << 20)])
                f.flush()
                growing.wrote(min(at + (1 << 20), len(blob)))
                time.sleep(0.01)
        growing.ended(True)
    t = threading.Thread(target=write)
    t.start()
    return t


def test_a_layer_is_unpacked_while_it_arrives_and_a_broken_stream_stops_the_follower(tmp_path):
    """A restore unpacks its CRIU images while their blob is still being written (coldsnap.capsule.growing): frame
    by frame, each once its bytes are in the file, to the same files as an unpack of the whole blob; a stream that
    breaks (a retry, a failed pull) stops the follower, which never waits for bytes that are not coming."""
    from coldsnap.capsule.growing import Growing, StopFollowing

    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(1 << 20) * 24  # 24 MiB: several frames
    (src / "pages-1.img").write_bytes(data)
    (src / "core.img").write_bytes(b"c" * 4000)
    layer = tmp_path / "layer.tar.zst"
    pack_dir(src, layer)
    blob = layer.read_bytes()

    growing = Growing()
    writer = arriving(blob, tmp_path / "part", growing)
    unpack_layer(tmp_path / "part", tmp_path / "out", following=growing)
    writer.join()
    assert growing.verified(timeout=0)
    assert (tmp_path / "out" / "pages-1.img").read_bytes() == data
    assert (tmp_path / "out" / "core.img").read_bytes() == b"c" * 4000

    broken = Growing()
    writer = arriving(blob, tmp_path / "part2", broken, stop_at=len(blob) // 2)
    t0 = time.monotonic()
    with pytest.raises(StopFollowing):
        unpack_layer(tmp_path / "part2", tmp_path / "out2", following=broken)
    writer.join()
    assert time.monotonic() - t0 < 30 and not broken.verified(timeout=0)


def test_corrupt_blob_is_refused(store, tmp_path):
    digest = make_capsule(store, tmp_path)
    cap = store.load(digest)
    blob = store.blob_path(cap.layer(mt.LAYER_CRIU).digest)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ColdSnapError) as e:
        store.verify(cap)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT
    blob.unlink()
    with pytest.raises(ColdSnapError) as e:
        store.verify(cap)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT and "missing" in e.value.message


def test_a_checked_blob_is_hashed_again_only_when_it_changes(store, tmp_path, monkeypatch):
    from coldsnap.base import digests

    digest = make_capsule(store, tmp_path, payload=os.urandom(1 << 20))
    cap = store.load(digest)
    hashed = []
    real = digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(digests, "SETTLED_NS", 50_000_000)
    time.sleep(0.1)  # the blob was written more than SETTLED_NS ago: its check is remembered
    store.verify(cap)
    store.verify(cap)
    blob = store.blob_path(cap.layer(mt.LAYER_CRIU).digest)
    assert hashed == [str(blob)]  # the second check trusted the memo: the blob had not changed
    memo = digests._memo_path()
    assert stat.S_IMODE(memo.stat().st_mode) == 0o600 and str(blob) in json.loads(memo.read_text())

    before = blob.stat()
    time.sleep(0.05)  # the next clock tick: a change now moves the ctime
    with open(blob, "r+b") as f:  # same size, and the mtime put back: only the ctime tells
        f.seek(100)
        f.write(b"\0tampered\0")
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ColdSnapError) as e:
        store.verify(cap)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT and len(hashed) == 2


def test_a_blob_changed_just_before_its_check_is_not_remembered(store, tmp_path):
    from coldsnap.base import digests

    digest = make_capsule(store, tmp_path)
    store.verify(store.load(digest))  # written a moment ago: a change in the same clock tick could hide
    assert not digests._memo_path().exists()


def test_corrupt_manifest_and_config_are_refused(store, tmp_path):
    digest = make_capsule(store, tmp_path)
    path = store.blob_path(digest)
    manifest = json.loads(path.read_text())
    config = store.blob_path(manifest["config"]["digest"])
    config.write_text(config.read_text().replace("reference", "referencX"))
    with pytest.raises(ColdSnapError) as e:
        store.load(digest)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT
    path.write_text(path.read_text() + " ")
    with pytest.raises(ColdSnapError) as e:
        store.load(digest)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT


def test_references_must_be_pinned(store, tmp_path):
    digest = make_capsule(store, tmp_path)
    assert store.resolve(digest) == digest
    assert store.resolve(f"demo@{digest}") == digest
    with pytest.raises(ColdSnapError) as e:
        store.resolve("demo")
    assert e.value.code == ErrorCode.CAPSULE_UNPINNED
    assert store.resolve("demo", allow_unpinned=True) == digest
    with pytest.raises(ColdSnapError) as e:
        store.resolve("sha256:" + "0" * 64)
    assert e.value.code == ErrorCode.CAPSULE_NOT_FOUND
    assert parse_reference("x@sha256:" + "1" * 64) == ("x", "sha256:" + "1" * 64)
    with pytest.raises(ColdSnapError):
        parse_reference("x@sha256:short")


def test_a_tag_moves_to_the_newest_capsule(store, tmp_path):
    first = make_capsule(store, tmp_path, b"one")
    second = make_capsule(store, tmp_path, b"two")
    assert first != second
    assert store.resolve("demo", allow_unpinned=True) == second
    assert {m["digest"] for m in store.list()} == {second}


def test_no_partial_blob_is_visible_after_a_failed_write(store, tmp_path, monkeypatch):
    src = tmp_path / "big"
    src.write_bytes(b"x" * 1000)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("coldsnap.capsule.store.shutil.copyfile", boom)
    with pytest.raises(OSError):
        store.put_file(src, mt.LAYER_CRIU)
    assert list(store.blobs.iterdir()) == []


def test_unpack_refuses_escaping_members(tmp_path):
    import tarfile

    import zstandard

    evil = tmp_path / "evil.tar.zst"
    payload = tmp_path / "p"
    payload.write_text("x")
    with open(evil, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as zw:
        with tarfile.open(fileobj=zw, mode="w|") as tar:
            tar.add(payload, arcname="../escaped")
    with pytest.raises(ColdSnapError) as e:
        unpack_layer(evil, tmp_path / "dest")
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT
    assert not (tmp_path / "escaped").exists()


def test_gc_spares_blobs_a_live_capture_wrote_or_reuses_and_refreshes_their_age(store, tmp_path):
    from coldsnap.base.journal import Blob, Journal
    from coldsnap.capsule.gc import discard, gc

    written = store.put_bytes(b"a layer a capture in flight just wrote", "x")
    reused = store.put_bytes(b"a layer it reuses", "y")
    old = time.time() - 7200
    os.utime(store.blob_path(reused.digest), (old, old))
    journal = Journal.begin("capture", workload="gc-race")  # this test process is the capture, alive
    journal.add(Blob(written.digest))
    assert store.put_bytes(b"a layer it reuses", "y").digest == reused.digest  # reuse: its age starts again
    assert time.time() - store.blob_path(reused.digest).stat().st_mtime < 60
    out = gc(store, grace_s=0)  # even with no grace period
    assert store.has_blob(written.digest) and written.digest not in out["removed_blobs"]
    journal.close()  # the capture failed and is gone: its blobs are garbage now
    assert written.digest in gc(store, grace_s=0)["removed_blobs"]
    # a failed capture removes what it wrote itself, unless something else uses it
    mine = Journal.begin("capture", workload="discard")
    kept = make_capsule(store, tmp_path)
    orphan = store.put_bytes(b"only the failed capture wrote this", "z")
    layer = store.load(kept).layers[0]
    assert discard(store, [orphan.digest, layer.digest], mine) == orphan.size
    assert not store.has_blob(orphan.digest) and store.has_blob(layer.digest)
    mine.close()


def _stage_fake(digest: str, nbytes: int, used_at: float) -> None:
    from coldsnap.capsule import staged

    d = staged.path_of(digest)
    (d / "images").mkdir(parents=True)
    (d / "images" / "pages-1.img").write_bytes(os.urandom(nbytes))
    (d / ".complete").write_text(digest)
    os.utime(d / ".complete", (used_at, used_at))


def test_staging_is_bounded_listed_and_freed_by_rm_and_gc(store, tmp_path, monkeypatch):
    from coldsnap.capsule import staged
    from coldsnap.capsule.gc import gc, list_capsules, remove

    monkeypatch.setenv("COLDSNAP_STAGED", str(tmp_path / "staged"))
    monkeypatch.setenv("COLDSNAP_STORE", str(store.root))  # the staging area is this store's
    other = make_capsule(store, tmp_path, payload=b"other images")
    store.write_capsule(profile(), store.load(other).layers, {}, tag="other")
    other = store.resolve("other", allow_unpinned=True)
    kept = make_capsule(store, tmp_path)  # tagged demo
    gone = "sha256:" + "e" * 64  # staged, but no index entry names it
    now = time.time()
    _stage_fake(kept, 300_000, now - 100)
    _stage_fake(other, 200_000, now - 200)
    _stage_fake(gone, 100_000, now - 300)
    rows = {r["digest"]: r for r in list_capsules(store)}
    assert rows[kept]["staged_bytes"] >= 300_000 and rows[other]["staged_bytes"] >= 200_000
    mirror = CapsuleStore(tmp_path / "mirror").init()
    assert gc(mirror)["staged_removed"] == []  # another store's gc leaves the home's staging area alone
    assert staged.path_of(gone).exists()
    out = gc(store)  # the unindexed capsule's images go; the cap (a quarter of the disk) keeps the others
    assert out["staged_removed"] == [gone] and out["staged_freed_bytes"] >= 100_000
    assert not staged.path_of(gone).exists() and staged.path_of(kept).exists()
    monkeypatch.setenv("COLDSNAP_STAGED_MAX_GIB", str(400_000 / 2**30))  # room for one: the least recent goes
    assert gc(store)["staged_removed"] == [other]
    assert staged.path_of(kept).exists() and not staged.path_of(other).exists()
    remove(store, "demo")  # rm: untagged and no other entry names it: its staged images go at once
    assert not staged.path_of(kept).exists()


def reachable_from_index(store) -> set[str]:
    """Every blob a descriptor reaches from index.json: manifests, their configs and layers."""
    seen, todo = set(), [m["digest"] for m in store.index()]
    while todo:
        digest = todo.pop()
        if digest in seen:
            continue
        seen.add(digest)
        try:
            doc = json.loads(store.blob_path(digest).read_bytes())
        except (ValueError, UnicodeDecodeError):
            continue  # a layer
        if isinstance(doc, dict):
            todo += [d["digest"] for d in [doc.get("config") or {}, *(doc.get("layers") or [])] if d.get("digest")]
    return seen


def test_weights_that_travel_apart_are_layers_every_blob_reachable_and_put_back(store, tmp_path):
    """A capsule's weight files are layers of its own manifest (path and mode annotated): any tool that copies the
    capsule copies them, nothing in the store hides behind an annotation, and a host without the file gets it back
    from the blob, with its mode. The capsule's size is its own, without the weights."""
    import hashlib

    from coldsnap.capsule.assemble import pack_capsule
    from coldsnap.capsule.payload import materialize
    from coldsnap.contracts import Model, WeightFile

    weights = tmp_path / "model" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(os.urandom(1 << 20))
    weights.chmod(0o640)
    wf = WeightFile(path=str(weights), sha256=hashlib.sha256(weights.read_bytes()).hexdigest(), size=1 << 20)
    images = tmp_path / "images"
    images.mkdir()
    (images / "pages-1.img").write_bytes(b"criu images")
    recovery = profile().model_copy(update={"weights_mode": "recovery",
                                            "model": Model(id="m", revision="r", weights=[wf])})
    packed = pack_capsule(store, images, [], recovery, "demo", weights_apart=True)
    cap = store.load(packed.digest)
    layers = [d for d in cap.layers if d.media_type == mt.LAYER_WEIGHTS]
    assert [(d.digest, d.size) for d in layers] == [("sha256:" + wf.sha256, 1 << 20)]
    assert layers[0].annotations[mt.ANNOTATION_PATH] == str(weights)
    assert layers[0].annotations[mt.ANNOTATION_MODE] == "0o640"
    assert cap.payload is None and mt.ANNOTATION_PAYLOAD not in cap.annotations
    assert packed.size == sum(d.size for d in cap.layers if d.media_type != mt.LAYER_WEIGHTS)
    blobs = {"sha256:" + p.name for p in store.blobs.iterdir()}
    assert blobs == reachable_from_index(store)  # nothing unreachable: an OCI copy of the layout is whole
    weights.unlink()
    assert materialize(store, cap, [wf]) == [str(weights)]
    assert weights.read_bytes() == store.blob_path("sha256:" + wf.sha256).read_bytes()
    assert stat.S_IMODE(weights.stat().st_mode) == 0o640


def _images(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    pages = os.urandom(1 << 20) * 5 + bytes(4 << 20) + os.urandom(1 << 20) * 3 + b"tail"  # 12 MiB and 4 bytes
    (src / "core-1.img").write_bytes(b"c" * 3000)
    (src / "pages-1.img").write_bytes(pages)
    (src / "pages-2.img").write_bytes(os.urandom(3 << 20))
    (src / "sub" / "small").write_bytes(b"s" * 10)
    (src / "zz-empty").write_bytes(b"")
    return src


def _members(layer):
    import tarfile

    import zstandard

    with open(layer, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as zr:
        return [(m.name, m.size, dict(m.pax_headers)) for m in tarfile.open(fileobj=zr, mode="r|")]


def test_images_packed_as_several_layers_unpack_side_by_side_into_the_same_files(tmp_path):
    """pack_parts cuts the images into layers of about equal bytes, a big file across two of them (each part a
    member with its offset and the file's size); unpack_layers puts them together, holes kept, from layers given
    in any order."""
    from coldsnap.capsule import pack_parts, unpack_layers
    from coldsnap.capsule.pack import PART_OFFSET, PART_SIZE

    src = _images(tmp_path)
    layers = pack_parts(src, tmp_path / "layers", 3)
    assert len(layers) == 3
    members = [_members(layer) for layer in layers]
    parts = [(name, size, pax) for layer in members for name, size, pax in layer if PART_OFFSET in pax]
    assert parts and all(pax[PART_SIZE] == str((src / name).stat().st_size) for name, _, pax in parts)
    assert all(int(pax[PART_OFFSET]) % (1 << 20) == 0 for _, _, pax in parts)  # cut at whole MiBs of the file
    assert sum(size for name, size, _ in parts if name == "pages-1.img") == (src / "pages-1.img").stat().st_size
    sizes = [layer.stat().st_size for layer in layers]
    assert max(sizes) < 2 * min(sizes)  # about equal shares (random bytes: compressed as they are)
    out = tmp_path / "out"
    unpack_layers(list(reversed(layers)), out)
    for f in ("core-1.img", "pages-1.img", "pages-2.img", "sub/small", "zz-empty"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    assert os.stat(out / "pages-1.img").st_blocks * 512 < (src / "pages-1.img").stat().st_size  # zeros: holes
    assert len(pack_parts(src, tmp_path / "one", 1)) == 1 and not any(
        PART_OFFSET in pax for _, _, pax in _members(tmp_path / "one" / "0.tar.zst"))


def test_layers_whose_parts_do_not_fit_together_are_refused(tmp_path):
    """A layer left out (a gap), or one given twice (parts overlapping, a file named twice): refused as corrupt."""
    from coldsnap.capsule import pack_parts, unpack_layers

    layers = pack_parts(_images(tmp_path), tmp_path / "layers", 3)
    for i, chosen in enumerate(([layers[0], layers[2]], [layers[0], layers[1]], [layers[0], layers[0], *layers[1:]])):
        with pytest.raises(ColdSnapError) as e:
            unpack_layers(chosen, tmp_path / f"out{i}")
        assert e.value.code == ErrorCode.CAPSULE_CORRUPT


def test_several_layers_unpack_while_they_arrive_and_one_broken_stream_stops_them_all(tmp_path):
    from coldsnap.capsule import pack_parts, unpack_layers
    from coldsnap.capsule.growing import Growing, StopFollowing

    src = _images(tmp_path)
    layers = pack_parts(src, tmp_path / "layers", 3)

    for broken in (None, 1):
        growing = [Growing() for _ in layers]
        parts = [tmp_path / f"part{broken}-{i}" for i in range(len(layers))]
        writers = [arriving(layer.read_bytes(), part, g, 1 << 20 if i == broken else None)
                   for i, (layer, part, g) in enumerate(zip(layers, parts, growing))]
        out = tmp_path / f"out{broken}"
        if broken is None:
            unpack_layers(parts, out, following=growing)
            assert (out / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()
        else:
            with pytest.raises(StopFollowing):
                unpack_layers(parts, out, following=growing)
        for w in writers:
            w.join()


@pytest.mark.parametrize("pax", [{"COLDSNAP.part.offset": "-1", "COLDSNAP.part.size": "8"},
                                 {"COLDSNAP.part.offset": "4", "COLDSNAP.part.size": "6"},  # runs past its file
                                 {"COLDSNAP.part.offset": "0", "COLDSNAP.part.size": str(1 << 41)},  # 2 TiB
                                 {"COLDSNAP.part.offset": "x", "COLDSNAP.part.size": "8"},
                                 {"COLDSNAP.part.size": "8"}], ids=["negative", "past-end", "huge", "nan", "no-offset"])
def test_a_part_that_cannot_fit_its_file_is_refused(tmp_path, pax):
    import io
    import tarfile

    import zstandard

    from coldsnap.capsule import unpack_layers

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pages-1.img")
        info.size, info.pax_headers = 4, pax
        tar.addfile(info, io.BytesIO(b"abcd"))
    layer = tmp_path / "layer.tar.zst"
    layer.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    with pytest.raises(ColdSnapError) as e:
        unpack_layers([layer], tmp_path / "out")
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT
    assert not (tmp_path / "out" / "pages-1.img").exists()  # refused before the file was made
