"""A weights blob that its capsule pins piece by piece is pulled by pieces (coldsnap.capsule.pieces), through a real
registry (Debian's docker-registry 2.8): fetched on several connections, each piece checked against its pin, its
whole digest never computed; a bad piece refused with nothing kept; a broken pull resumed piece by piece; and a
blob in the store serves a capsule only if it is the pieces that capsule pins."""

import hashlib
import json
import os

import pytest
from old_capsules import write_payload
from registry_fixture import ensure_registry, registry  # noqa: F401  (pytest fixture)
from test_registry import no_ambient_credentials, profile, random_layer, registry_blob_file  # noqa: F401

from coldsnap.base import digests
from coldsnap.capsule import CapsuleStore, pieces, remote
from coldsnap.capsule.payload import materialize
from coldsnap.capsule.registry import pull, push
from coldsnap.contracts import ColdSnapError, ErrorCode, Model, WeightFile
from coldsnap.contracts import capsule as mt

MIB = 1 << 20


@pytest.fixture
def stores(tmp_path, monkeypatch):
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    return CapsuleStore(tmp_path / "src").init(), CapsuleStore(tmp_path / "dst").init()


def pinned_capsule(store, tmp_path, data: bytes, pins_of: bytes | None = None, tag="w", by_pieces=True):
    """A capsule whose profile pins a weights file by 1 MiB pieces (of pins_of, if given: a capsule that lies; none
    without by_pieces), with the file in a payload."""
    path = tmp_path / f"model-{os.urandom(3).hex()}.safetensors"
    path.write_bytes(data)
    whole = hashlib.sha256(data).hexdigest()
    chunks = [hashlib.sha256((pins_of or data)[o:o + MIB]).hexdigest() for o in range(0, len(data), MIB)]
    wf = (WeightFile(path=str(path), sha256=whole, size=len(data), chunk_bytes=MIB, chunks=chunks) if by_pieces
          else WeightFile(path=str(path), sha256=whole, size=len(data)))
    payload = write_payload(store, [WeightFile(path=str(path), sha256=whole)])
    prof = profile().model_copy(update={"model": Model(id="m", revision="r", weights=[wf])})
    digest = store.write_capsule(prof, [random_layer(store, tmp_path, MIB)],
                                 {mt.ANNOTATION_ENGINE: "reference", mt.ANNOTATION_PAYLOAD: payload}, tag=tag)
    return digest, wf


def memo(path):
    return json.loads((digests.settings().home / "digests.json").read_text()).get(os.path.abspath(path), {})


def test_pinned_weights_come_by_pieces_on_several_connections(registry, stores, tmp_path, monkeypatch):  # noqa: F811
    src, dst = stores
    data = os.urandom(5 * MIB + 12345)
    digest, wf = pinned_capsule(src, tmp_path, data)
    push(src, digest, f"{registry}/coldsnap/pieces:v1", insecure=True)
    ranges, send = [], remote.Client._send

    def spy(self, method, url, headers=None, **kw):
        if "Range" in (headers or {}) and url.endswith(wf.sha256):
            ranges.append(headers["Range"])
        return send(self, method, url, headers=headers, **kw)

    monkeypatch.setattr(remote.Client, "_send", spy)
    got = pull(dst, f"{registry}/coldsnap/pieces@{digest}", insecure=True)
    blob = dst.blob_path("sha256:" + wf.sha256)
    assert blob.read_bytes() == data
    assert sorted(ranges) == sorted(f"bytes={o}-{min(o + MIB, len(data)) - 1}" for o in range(0, len(data), MIB))
    assert got.payload_bytes == len(data) + 2  # the pieces, and the payload's empty config
    assert memo(blob) == {**memo(blob), "chunks": wf.chunks, "chunk_bytes": MIB} and "sha256" not in memo(blob)
    os.unlink(wf.path)  # a node without the weights file: put back from the blob, checked by its pieces
    assert materialize(dst, dst.load(digest), [wf]) == [wf.path]
    assert open(wf.path, "rb").read() == data and "sha256" not in memo(wf.path)


def test_a_bad_piece_is_refused_and_nothing_kept(registry, stores, tmp_path):  # noqa: F811
    src, dst = stores
    data = os.urandom(4 * MIB)
    digest, wf = pinned_capsule(src, tmp_path, data)
    push(src, digest, f"{registry}/coldsnap/badpiece:v1", insecure=True)
    bad = bytearray(data)
    bad[2 * MIB + 7] ^= 1
    registry_blob_file(registry, "sha256:" + wf.sha256).write_bytes(bytes(bad))
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/badpiece@{digest}", insecure=True)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT and f"byte {2 * MIB}" in e.value.message
    assert sorted(os.listdir(dst.blobs)) == [] and sorted(os.listdir(dst.root / "tmp")) == [] and dst.index() == []


def test_a_broken_pull_keeps_its_good_pieces(registry, stores, tmp_path):  # noqa: F811
    src, dst = stores
    data = os.urandom(6 * MIB)
    digest, wf = pinned_capsule(src, tmp_path, data)
    push(src, digest, f"{registry}/coldsnap/piecesresume:v1", insecure=True)
    part = dst.root / "tmp" / f"{wf.sha256}.partial"
    part.write_bytes(data[:2 * MIB] + os.urandom(MIB) + data[3 * MIB:4 * MIB])  # pieces 0, 1 and 3 are good
    payload = json.loads(src.blob_path(digest).read_bytes())["annotations"][mt.ANNOTATION_PAYLOAD]
    got = pull(dst, f"{registry}/coldsnap/piecesresume@{payload}", insecure=True,
               artifact_type=mt.PAYLOAD_ARTIFACT_TYPE, pins={"sha256:" + wf.sha256: wf})
    assert got.resumed_bytes == 3 * MIB and got.bytes_transferred == 3 * MIB + 2
    assert dst.blob_path("sha256:" + wf.sha256).read_bytes() == data and not part.exists()


def test_a_registry_without_ranges_sends_the_blob_whole(registry, stores, tmp_path, monkeypatch):  # noqa: F811
    src, dst = stores
    data = os.urandom(3 * MIB + 1)
    digest, wf = pinned_capsule(src, tmp_path, data)
    push(src, digest, f"{registry}/coldsnap/piecesnorange:v1", insecure=True)
    send = remote.Client._send
    monkeypatch.setattr(remote.Client, "_send", lambda self, method, url, headers=None, **kw: send(
        self, method, url, headers={k: v for k, v in (headers or {}).items() if k != "Range"}, **kw))
    pull(dst, f"{registry}/coldsnap/piecesnorange@{digest}", insecure=True)
    blob = dst.blob_path("sha256:" + wf.sha256)
    assert blob.read_bytes() == data and memo(blob)["sha256"] == "sha256:" + wf.sha256  # hashed whole, as it came


def test_a_stored_blob_serves_only_the_capsules_whose_pieces_it_is(registry, stores, tmp_path):  # noqa: F811
    """A blob fetched by pieces was checked against one capsule's pins, not its digest: another capsule naming
    the same digest checks its own pins, and where they differ the whole digest decides who is wrong."""
    src, dst = stores
    data = os.urandom(3 * MIB)
    honest, wf = pinned_capsule(src, tmp_path, data, tag="honest")
    push(src, honest, f"{registry}/coldsnap/honest:v1", insecure=True)
    blob = dst.blob_path("sha256:" + wf.sha256)
    # (a) the store holds other bytes under the honest digest, kept by pieces for a capsule that pinned them
    other = os.urandom(len(data))
    dst.blobs.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(other)
    digests.remember_pieces(blob, [hashlib.sha256(other[o:o + MIB]).hexdigest() for o in range(0, len(other), MIB)],
                            MIB)
    pull(dst, f"{registry}/coldsnap/honest@{honest}", insecure=True)
    assert blob.read_bytes() == data  # not this capsule's pieces, nor its digest: fetched again
    # (b) a capsule that names the honest digest with other pieces is refused; the honest blob stays
    liar, _ = pinned_capsule(src, tmp_path, data, pins_of=other, tag="liar")
    push(src, liar, f"{registry}/coldsnap/liar:v1", insecure=True)
    with pytest.raises(ColdSnapError) as e:
        pull(dst, f"{registry}/coldsnap/liar@{liar}", insecure=True)
    assert e.value.code == ErrorCode.CAPSULE_CORRUPT and "not that blob's pieces" in e.value.message
    assert blob.read_bytes() == data
    # (c) a capsule that pins no pieces trusts the digest: a blob only ever checked by pieces is hashed whole first
    blob.write_bytes(other)
    digests.remember_pieces(blob, [hashlib.sha256(other[o:o + MIB]).hexdigest() for o in range(0, len(other), MIB)],
                            MIB)
    plain, _ = pinned_capsule(src, tmp_path, data, tag="plain", by_pieces=False)
    push(src, plain, f"{registry}/coldsnap/plain:v1", insecure=True)
    pull(dst, f"{registry}/coldsnap/plain@{plain}", insecure=True)
    assert blob.read_bytes() == data and memo(blob)["sha256"] == "sha256:" + wf.sha256


def test_pins_cover_the_blob_exactly():
    wf = WeightFile(path="/w", sha256="0" * 64, chunk_bytes=MIB, chunks=["0" * 64] * 3)
    assert pieces.covers(wf, 3 * MIB) and pieces.covers(wf, 2 * MIB + 1)
    assert not pieces.covers(wf, 2 * MIB) and not pieces.covers(wf, 3 * MIB + 1)
