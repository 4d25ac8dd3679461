"""Fuzzing (hypothesis), bounded in time: what others hand ColdSnap — runc argv, annotations, requests, hook state,
capsule manifests and index, tar+zstd layers — never ends in a traceback, never writes outside the directory it
was given, and is refused in one line with a stable code. Each fuzzer first replays its seeds in tests/fuzz_corpus/
(hostile cases found so far; tests/fuzz_corpus/make_corpus.py writes the tar ones), then explores. FUZZ_SCALE
multiplies the number of generated examples (default 1: about a minute in all on a 2-core machine)."""

import hashlib
import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from coldsnap.capsule import CapsuleStore, unpack_layer
from coldsnap.contracts import ColdSnapError, ErrorCode, parse_request
from coldsnap.contracts import capsule as mt
from coldsnap.flows.container_restore import request_from_annotations
from coldsnap.oci.argv import parse_runc_argv, valid_container_id
from coldsnap.oci.records import Outcome, ShimRecord
from coldsnap.oci.spec import runc_refuses
from coldsnap.shim.main import PASS_THROUGH, decide

CORPUS = Path(__file__).parent / "fuzz_corpus"
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))


def budget(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


def seeds(kind: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((CORPUS / kind).iterdir()) if p.is_file() and p.suffix != ".py"]


def refused_in_one_line(e: ColdSnapError, *codes: ErrorCode) -> None:
    assert e.code in codes, e
    text = str(e)
    assert "\n" not in text and len(text) < 700, text[:800]


# --- runc argv ---------------------------------------------------------------------------------------------------
TOKENS = st.one_of(st.sampled_from(["create", "run", "start", "delete", "state", "exec", "-b", "--bundle", "--root",
                                    "-d", "--detach", "--", "--log", "--log-format=json", "--pid-file", "c1", "..",
                                    "../x", "-", "", "=", "--bundle=", "kill", "KILL"]),
                   st.text(max_size=12))


def _decide_any(argv: list[str]) -> None:
    parsed = parse_runc_argv(argv)
    assert parsed.argv == tuple(argv)  # the parse never changes what the caller wrote
    action, _ = decide(parsed, spec_of=lambda b: {"annotations": {mt.ANNOTATION_CAPSULE: "sha256:" + "a" * 64}},
                       record_of=lambda c: ShimRecord(outcome=Outcome.RESTORED, id=c, root=parsed.root, bundle="/b"))
    if not valid_container_id(parsed.container_id):
        assert action == PASS_THROUGH  # no path is ever built from an id runc refuses
    if parsed.command_index >= 0:
        assert list(argv[:parsed.command_index]) == parsed.global_argv()


@pytest.mark.parametrize("seed", seeds("argv"), ids=lambda s: s[:30].decode(errors="replace"))
def test_argv_seeds(seed):
    _decide_any(json.loads(seed))


@budget(8000)
@given(st.lists(TOKENS, max_size=12))
def test_fuzz_runc_argv(argv):
    _decide_any(argv)


# --- annotations, specs, requests, hook state ------------------------------------------------------------------
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                       lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids,
                                                                                  max_size=4), max_leaves=20)
KEYS = st.sampled_from([*mt.CONTAINER_ANNOTATIONS, "io.coldsnap.polcy", "io.coldsnap.", "other", "io.coldsnapx"])


def _annotations_any(ann: dict) -> None:
    try:
        request_from_annotations(ann)
    except ColdSnapError as e:
        refused_in_one_line(e, ErrorCode.INVALID_REQUEST)


@pytest.mark.parametrize("seed", seeds("annotations"))
def test_annotation_seeds(seed):
    _annotations_any(json.loads(seed))


@budget(4000)
@given(st.dictionaries(KEYS, st.one_of(st.text(max_size=40), JSONISH.map(json.dumps),
                                       st.sampled_from(['{"fallback_to_cold": "no"}', '{"port": 8000.0}',
                                                        '{"a": 1, "a": 2}', "[" * 64, "sha256:" + "a" * 64])),
                       max_size=5))
@example({"io.coldsnap.capsule": "", "io.coldsnap.policy": '{"\\n": null}'})  # an unknown field named by a newline
def test_fuzz_annotations(ann):
    _annotations_any(ann)


@budget(3000)
@given(JSONISH)
def test_fuzz_spec_shapes(spec):
    assert runc_refuses(spec) is None or isinstance(runc_refuses(spec), str)  # never raises on any shape


def _request_any(raw: bytes) -> None:
    try:
        parse_request(raw)
    except ColdSnapError as e:
        refused_in_one_line(e, ErrorCode.INVALID_REQUEST)


@pytest.mark.parametrize("seed", seeds("request"), ids=lambda s: s[:30].decode(errors="replace"))
def test_request_seeds(seed):
    _request_any(seed)


@budget(5000)
@given(st.one_of(st.binary(max_size=200), JSONISH.map(lambda v: json.dumps(v).encode()),
                 st.fixed_dictionaries({"format": JSONISH, "operation": st.sampled_from(["capture", "restore", "x"])},
                                       optional={"policy": JSONISH, "validation": JSONISH, "capsule": JSONISH,
                                                 "launch": JSONISH}).map(lambda v: json.dumps(v).encode())))
def test_fuzz_requests(raw):
    _request_any(raw)


# --- capsule manifests and the store's index --------------------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    return CapsuleStore(tmp_path / "store").init()


def _load_any(store: CapsuleStore, raw: bytes) -> None:
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    store.blob_path(digest).write_bytes(raw)
    try:
        store.load(digest)
    except ColdSnapError as e:
        refused_in_one_line(e, ErrorCode.CAPSULE_CORRUPT, ErrorCode.CAPSULE_NOT_FOUND)


@pytest.mark.parametrize("seed", seeds("manifest"), ids=lambda s: s[:30].decode(errors="replace"))
def test_manifest_seeds(store, seed):
    _load_any(store, seed)


MANIFESTS = st.fixed_dictionaries(
    {"artifactType": st.sampled_from([mt.ARTIFACT_TYPE, "x"])},
    optional={"config": JSONISH | st.fixed_dictionaries({"mediaType": JSONISH, "digest": st.sampled_from(
        ["sha256:" + "0" * 64, "sha256:x", 5]), "size": JSONISH}), "layers": JSONISH, "annotations": JSONISH})


@budget(4000)
@given(st.one_of(st.binary(max_size=100), MANIFESTS.map(lambda m: json.dumps(m).encode())))
def test_fuzz_manifests(store, raw):
    _load_any(store, raw)


@budget(2000)
@given(st.one_of(st.binary(max_size=100), JSONISH.map(lambda v: json.dumps(v).encode()),
                 st.lists(JSONISH, max_size=3).map(lambda m: json.dumps({"manifests": m}).encode())))
def test_fuzz_store_index(store, raw):
    (store.root / "index.json").write_bytes(raw)
    try:
        store.index()
        store.resolve("some-tag", allow_unpinned=True)
    except ColdSnapError as e:
        refused_in_one_line(e, ErrorCode.CAPSULE_CORRUPT, ErrorCode.CAPSULE_NOT_FOUND)


# --- tar+zstd layers --------------------------------------------------------------------------------------------
def _unpack_any(work: Path, layer_bytes: bytes) -> None:
    """Unpack into work/dest: refused in one line or unpacked, and nothing anywhere in work but the layer and dest."""
    layer = work / "layer.tar.zst"
    layer.write_bytes(layer_bytes)
    dest = work / "dest"
    try:
        unpack_layer(layer, dest)
    except ColdSnapError as e:
        refused_in_one_line(e, ErrorCode.CAPSULE_CORRUPT)
    assert sorted(p.name for p in work.iterdir()) == ["dest", "layer.tar.zst"]
    for p in dest.rglob("*"):
        assert p.is_dir() or p.is_file() and not p.is_symlink(), p  # nothing but plain files and directories
    assert not Path("/tmp/coldsnap-fuzz-escape").exists()


@pytest.mark.parametrize("seed", sorted((CORPUS / "tar").iterdir()), ids=lambda p: p.name)
def test_layer_seeds(tmp_path, seed):
    _unpack_any(tmp_path, seed.read_bytes())


NAMES = st.one_of(st.sampled_from(["a", "a/b", "./a", "../a", "a/../../b", "/abs", "a//b", ".", "", "images",
                                   "images/core.img", "a\\b"]), st.text(max_size=12))
KINDS = st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE,
                         tarfile.BLKTYPE, tarfile.FIFOTYPE])


def _tar(members: list[tuple[str, bytes, int, str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, link in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


@budget(4000)
@given(st.lists(st.tuples(NAMES, KINDS, st.binary(max_size=64), NAMES), max_size=6),
       st.sampled_from(["whole", "truncated", "garbage"]))
def test_fuzz_layers(tmp_path_factory, members, damage):
    work = tmp_path_factory.mktemp("layer")
    try:
        raw = _tar(members)
    except (ValueError, UnicodeError, tarfile.TarError):
        return  # not a tar the tarfile module can write: nothing to feed
    data = zstandard.ZstdCompressor().compress(raw)
    data = {"whole": data, "truncated": data[: len(data) // 2], "garbage": data[:4] + os.urandom(32)}[damage]
    _unpack_any(work, data)


def test_a_zip_bomb_never_fills_the_disk(tmp_path):
    started = time.monotonic()
    _unpack_any(tmp_path, (CORPUS / "tar" / "bomb.tar.zst").read_bytes())  # 512 MiB of zeros: a hole
    zeros = tmp_path / "dest" / "zeros"
    assert zeros.stat().st_size == 512 << 20 and zeros.stat().st_blocks * 512 < 1 << 20
    assert time.monotonic() - started < 60
    # a bomb of data (not zeros) is refused once it passes the ratio
    (tmp_path / "dest").rename(tmp_path / "first")
    import shutil

    shutil.rmtree(tmp_path / "first")
    raw = _tar([("data", tarfile.REGTYPE, b"coldsnap" * (16 << 20), "")])  # 128 MiB of one pattern
    with pytest.raises(ColdSnapError, match="expands beyond") as e:
        layer = tmp_path / "bomb2.tar.zst"
        layer.write_bytes(zstandard.ZstdCompressor(level=19).compress(raw))
        unpack_layer(layer, tmp_path / "dest")
    refused_in_one_line(e.value, ErrorCode.CAPSULE_CORRUPT)
