"""Weights pinned piece by piece (coldsnap.base.digests): chunk digests match hashlib's and blake3's, verification
in parallel finds a changed byte or a changed length, the verdict is remembered until the file changes, and a
restore's weights check (capsule.pinned.verify_weights) uses them."""

import hashlib
import os

import pytest

from coldsnap.base import digests
from coldsnap.capsule.pinned import verify_weights
from coldsnap.contracts import ColdSnapError, WeightFile

MIB = 1 << 20


@pytest.fixture
def weights(tmp_path, monkeypatch):
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(digests, "SETTLED_NS", 0)  # remember at once (the file was just written)
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(5 * MIB + 12345))
    return path


def after_clock_tick(path):
    """Wait until a write would stamp a later ctime than the file's: file timestamps come from a coarse clock."""
    probe = path.with_suffix(".tick")
    while True:
        probe.write_bytes(b"")
        if probe.stat().st_ctime_ns > path.stat().st_ctime_ns:
            return


def expected(path, size, algorithm="sha256"):
    import blake3

    data = path.read_bytes()
    new = hashlib.sha256 if algorithm == "sha256" else blake3.blake3
    return [new(data[o:o + size]).hexdigest() for o in range(0, len(data), size)]


def test_chunks_are_the_pieces_digests_and_the_pin_is_the_whole_files(weights, monkeypatch):
    """A capture pins the pieces by blake3 (the default) or sha256 (COLDSNAP_PIN_PIECE_HASH); the whole file by
    sha256 either way (its OCI digest)."""
    assert digests.chunk_digests(weights, MIB) == expected(weights, MIB)
    assert digests.chunk_digests(weights, MIB, "blake3") == expected(weights, MIB, "blake3")
    pinned = digests.pinned_digests(weights, MIB)
    assert pinned.sha256 == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (pinned.chunks, pinned.chunk_digest, pinned.chunk_bytes) == (expected(weights, MIB, "blake3"), "blake3", MIB)
    one = digests.pinned_digests(weights, 64 * MIB)  # one piece: the whole-file digest is enough
    assert (one.chunks, one.chunk_bytes, one.chunk_digest) == ([], None, "sha256")
    monkeypatch.setenv("COLDSNAP_PIN_PIECE_HASH", "sha256")  # the memo holds blake3's pieces: hashed again
    pinned = digests.pinned_digests(weights, MIB)
    assert (pinned.chunks, pinned.chunk_digest) == (expected(weights, MIB), "sha256")
    assert WeightFile(path=str(weights), size=weights.stat().st_size, **pinned.fields()).chunk_digest == "sha256"
    monkeypatch.setenv("COLDSNAP_PIN_PIECE_HASH", "md5")
    with pytest.raises(ValueError, match="COLDSNAP_PIN_PIECE_HASH"):
        digests.pinned_digests(weights, MIB)


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_verification_finds_a_changed_byte_or_length_and_remembers_a_match(weights, monkeypatch, algorithm):
    chunks = expected(weights, MIB, algorithm)
    assert digests.checked_chunks(weights, chunks, MIB, algorithm)
    other = "blake3" if algorithm == "sha256" else "sha256"
    assert not digests.checked_chunks(weights, chunks, MIB, other)  # the same hex, read by the other hash
    assert digests.checked_chunks(weights, chunks, MIB, algorithm)
    calls, real = [], digests.chunk_digests
    monkeypatch.setattr(digests, "chunk_digests", lambda *a: calls.append(a) or [])
    assert digests.checked_chunks(weights, chunks, MIB, algorithm) and calls == []  # remembered: nothing hashed
    monkeypatch.setattr(digests, "chunk_digests", real)
    after_clock_tick(weights)  # the test remembered at once (SETTLED_NS 0): a write in the same tick keeps the ctime
    with open(weights, "r+b") as f:
        f.seek(3 * MIB + 7)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    assert not digests.checked_chunks(weights, chunks, MIB, algorithm)  # changed since: hashed again, and it differs
    assert not digests.checked_chunks(weights, chunks[:-1], MIB, algorithm)  # the length does not fit the pieces


def test_a_restore_checks_weights_by_their_pieces(weights):
    pinned = digests.pinned_digests(weights, MIB)
    chunks = pinned.chunks
    wf = WeightFile(path=str(weights), size=weights.stat().st_size, **pinned.fields())
    verify_weights([wf])
    verify_weights([WeightFile(path=str(weights), sha256=pinned.sha256, chunk_bytes=MIB,  # pinned before blake3
                               chunks=expected(weights, MIB))])
    bad = wf.model_copy(update={"chunks": [chunks[0], "0" * 64, *chunks[2:]]})
    with pytest.raises(ColdSnapError) as e:
        verify_weights([bad])
    assert "a piece does not match" in e.value.message


def test_a_capture_packs_weights_checked_by_their_pieces(weights, tmp_path):
    """put_weights checks the store's link of a weights file by its pins (in parallel, not one sha256 stream),
    and a file changed since it was pinned is refused with nothing left in the store."""
    from coldsnap.capsule.payload import put_weights
    from coldsnap.capsule.store import CapsuleStore

    store = CapsuleStore(tmp_path / "store").init()
    pinned = digests.pinned_digests(weights, MIB)
    whole = pinned.sha256
    wf = WeightFile(path=str(weights), size=weights.stat().st_size, **pinned.fields())
    put_weights(store, [wf])
    assert store.has_blob("sha256:" + whole)
    store.blob_path("sha256:" + whole).unlink()
    with open(weights, "r+b") as f:  # changed after it was pinned
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    with pytest.raises(ColdSnapError) as e:
        put_weights(store, [wf])
    assert "changed since it was pinned" in e.value.message and not store.has_blob("sha256:" + whole)
    assert not [p for p in (tmp_path / "store").rglob("*.payload")]


def test_a_file_hashed_as_it_was_written_is_not_read_again_until_it_changes(tmp_path, monkeypatch):
    """A pull hashes a blob as it streams in (and a payload's weights file is that blob's inode): remembered at once,
    so the restore right after the pull does not read 31 GB again; a later write is hashed again."""
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(3 * MIB))
    truth = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    digests.remember_hashed(path, truth, chunks=expected(path, MIB), chunk_bytes=MIB)
    calls, real = [], digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p: calls.append(p) or real(p))
    assert digests.checked_sha256(path) == (truth, 3 * MIB) and calls == []
    assert digests.checked_chunks(path, expected(path, MIB), MIB)
    path.write_bytes(b"changed")
    assert digests.checked_sha256(path)[0] == "sha256:" + hashlib.sha256(b"changed").hexdigest() and calls


def test_a_file_remembered_before_it_was_durable_is_trusted_in_this_boot_only(tmp_path, monkeypatch):
    """A restore's pull lists the capsule's own blobs before their bytes reach the disk: their digests are trusted
    without reading them again in this boot (a killed process leaves its writes in the page cache), hashed again
    after a reboot (a power loss can keep a file's size and times but not its bytes), and trusted in any boot once
    remembered durable."""
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(MIB))
    truth = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    calls, real = [], digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p: calls.append(p) or real(p))
    digests.remember_hashed(path, truth, durable=False)
    assert digests.checked_sha256(path) == (truth, MIB) and calls == []
    monkeypatch.setattr(digests, "boot_id", lambda: "a-later-boot")
    assert digests.checked_sha256(path)[0] == truth and len(calls) == 1  # read again: then remembered (this boot)
    digests.remember_hashed(path, truth)  # fsynced since: durable
    monkeypatch.setattr(digests, "boot_id", lambda: "yet-another-boot")
    assert digests.checked_sha256(path)[0] == truth and len(calls) == 1


def test_a_file_pinned_in_the_background_is_not_read_again(weights, monkeypatch):
    """A capture pins weights that exist before the engine starts while it starts (digests.pin_in_background):
    pinning them for real afterwards finds the digest remembered."""
    wait = digests.pin_in_background([str(weights), str(weights.with_name("absent.safetensors"))])
    wait()
    whole = hashlib.sha256(weights.read_bytes()).hexdigest()

    def no_second_read(path):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(digests, "sha256_file", no_second_read)
    assert digests.pinned_digests(weights).sha256 == whole
    digests.pin_in_background([])()  # nothing to pin: nothing waits
