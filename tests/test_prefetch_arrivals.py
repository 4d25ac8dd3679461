"""Weights loaded onto the GPU while a streamed pull brings them: which bytes a prefetcher may load and when.

The copies themselves need a GPU (packaging/device/cold-node.sh runs them); what decides them runs here: a pull's
Arrivals announce only pieces checked against their pins, and SectionArrivals turns those file ranges into pieces of
the safetensors data section, holding back what comes before the file's head."""

from __future__ import annotations

import json
import random
import struct
import threading

import pytest

from coldsnap.capsule.pieces import Arrivals
from coldsnap.gpu.prefetch import SectionArrivals


def safetensors_bytes(data_len: int) -> bytes:
    header = json.dumps({"w": {"dtype": "U8", "shape": [data_len], "data_offsets": [0, data_len]}}).encode()
    return struct.pack("<Q", len(header)) + header + random.Random(0).randbytes(data_len)


def test_pieces_before_the_head_are_held_and_the_section_is_covered_exactly_once():
    blob = safetensors_bytes(5000)
    base = 8 + struct.unpack("<Q", blob[:8])[0]
    ranges = [(o, min(64, len(blob) - o)) for o in range(0, len(blob), 64)]
    random.Random(1).shuffle(ranges)
    if ranges[0][0] == 0:  # a piece after the head comes first
        ranges[0], ranges[1] = ranges[1], ranges[0]
    section = SectionArrivals(len(blob), lambda: struct.unpack("<Q", blob[:8])[0])
    loaded = bytearray(len(blob) - base)
    given = []
    for offset, length in ranges:
        pieces = section.add(offset, length)
        if section.base is None:
            assert pieces == []  # nothing before the head is here: the section's start is unknown
        for start, width, rows, pitch in pieces:
            assert rows == 1 and width == pitch
            given.append((start, width))
            loaded[start:start + width] = blob[base + start:base + start + width]
    assert section.base == base and section.complete
    assert sum(w for _, w in given) == len(blob) - base and bytes(loaded) == blob[base:]


def test_a_section_not_wholly_arrived_is_not_complete():
    blob = safetensors_bytes(1000)
    section = SectionArrivals(len(blob), lambda: struct.unpack("<Q", blob[:8])[0])
    for offset in range(0, len(blob) - 64, 64):  # the last piece never comes
        section.add(offset, 64)
    assert section.base is not None and not section.complete


def test_arrivals_announce_checked_pieces_as_they_come_and_stop_when_the_pull_ends():
    arrivals = Arrivals()
    got: list[tuple[int, int]] = []
    reader = threading.Thread(target=lambda: got.extend(arrivals.pieces("sha256:a", timeout=30)))
    reader.start()
    arrivals.sized("sha256:a", __file__)  # type: ignore[arg-type]
    for offset in (256, 0, 512):
        arrivals.checked("sha256:a", offset, 256)
    arrivals.checked("sha256:b", 0, 256)  # another blob's pieces are not this one's
    assert not arrivals.whole("sha256:a", timeout=0)
    arrivals.complete("sha256:a")
    reader.join(10)
    assert got == [(256, 256), (0, 256), (512, 256)] and arrivals.whole("sha256:a")

    failed = Arrivals()
    left: list[tuple[int, int]] = []
    reader = threading.Thread(target=lambda: left.extend(failed.pieces("sha256:a", timeout=30)))
    reader.start()
    failed.checked("sha256:a", 0, 256)
    failed.end()  # the pull ended (a piece failed its pin): the reader stops, and the blob is not whole
    reader.join(10)
    assert not reader.is_alive() and left == [(0, 256)] and not failed.whole("sha256:a")
    assert failed.partial("sha256:a", timeout=0) is None


def pinned_blob(tmp_path, data_len: int, piece: int = 4096):
    """A safetensors blob and the WeightFile that pins it by sha256 pieces of `piece` bytes."""
    import hashlib

    from coldsnap.contracts import WeightFile

    blob = safetensors_bytes(data_len)
    pins = [hashlib.sha256(blob[o:o + piece]).hexdigest() for o in range(0, len(blob), piece)]
    return blob, WeightFile(path=str(tmp_path / "w.safetensors"), sha256=hashlib.sha256(blob).hexdigest(),
                            size=len(blob), chunks=pins, chunk_bytes=piece)


class RangeServer:
    """A real HTTP server on loopback answering Range requests for one blob (as a registry does)."""

    def __init__(self, blob: bytes, ranges: bool = True, short: bool = False) -> None:
        import http.server

        self.authorizations: list = []  # the Authorization header of each request, None where it had none
        seen = self.authorizations

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                seen.append(self.headers.get("Authorization"))
                if not ranges:  # a registry that ignores Range: the whole blob (short: its first half)
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(blob)))
                    self.end_headers()
                    self.wfile.write(blob[:len(blob) // 2] if short else blob)
                    self.close_connection = short
                    return
                first, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {first}-{last}/{len(blob)}")
                self.send_header("Content-Length", str(last - first + 1))
                self.end_headers()
                # short: the connection breaks halfway through the body
                self.wfile.write(blob[first:first + (last - first + 1) // 2] if short else blob[first:last + 1])
                self.close_connection = short

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/blob"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()



def test_spooled_pieces_reach_the_file_only_when_asked_and_the_head_at_once(tmp_path, monkeypatch):
    """A pull a restore reads while it streams: each checked piece lands in the spool (memory: a memfd a piece, put
    there by a fetching process of its own) and is announced;
    the partial on disk gets the file's head at once (engines read their header from the file) and the rest only
    once someone asks (file_now) or the restore is past its first token; then it is the whole blob."""

    from coldsnap.capsule.fetcher import PlainClient
    from coldsnap.capsule.pieces import fetch_by_pieces
    from coldsnap.gpu.prefetch import PrefetchError, spool_reader

    monkeypatch.setenv("COLDSNAP_PULL_SPOOL", "1")
    blob, wf = pinned_blob(tmp_path, 40_000)
    cb, pins = wf.chunk_bytes, wf.chunks
    server, arrivals, part = RangeServer(blob), Arrivals(), tmp_path / "blob.partial"
    done: dict = {}
    pull = threading.Thread(target=lambda: done.update(r=fetch_by_pieces(PlainClient, server.url, part, len(blob), wf,
                                                                          "test", arrivals=arrivals, digest="d")))
    pull.start()
    try:
        assert arrivals.whole("d", timeout=30) and arrivals.partial("d", 0) == part and "d" in arrivals.spooled
        spool = arrivals.spool("d")
        assert spool is not None and spool.piece_bytes == cb and len(spool.fds) == len(pins)  # a memfd a piece
        try:
            read = spool_reader(spool.fds, spool.piece_bytes)  # as a prefetcher reads it
            got = bytearray(len(blob))
            for o in range(0, len(blob), cb):
                read(memoryview(got)[o:o + cb], o)
            assert bytes(got) == blob  # every piece in memory, checked
            with pytest.raises(PrefetchError):  # a read across two pieces is a bug, not garbage
                read(memoryview(got)[:cb], cb // 2)
        finally:
            spool.close()
        head = 8 + int.from_bytes(blob[:8], "little")
        on_disk = part.read_bytes()
        assert on_disk[:head] == blob[:head]  # the head is there for the engine's own reads
        assert on_disk[cb:] == bytes(len(blob) - cb)  # the rest is not, until asked
        assert not arrivals.filed("d", timeout=0) or part.read_bytes() == blob  # asking starts it
        assert arrivals.filed("d", timeout=30) and part.read_bytes() == blob
        assert arrivals.spool("d") is None  # closed once filed
    finally:
        arrivals.allow_sync()
        pull.join(30)
        server.close()
    assert not pull.is_alive() and done["r"] == (len(blob), 0)


def test_fetching_processes_started_ahead_take_the_pieces_and_those_left_end_with_the_pull(tmp_path, monkeypatch):
    """A restore's pull starts its fetching processes while the capsule's own blobs come (their interpreter and
    imports off the weights' path): the spooled pull hands its pieces to those very processes (received into the
    spool, each checked), and processes no blob took end with the pull, without work."""

    from coldsnap.capsule import pieces
    from coldsnap.capsule.fetcher import PlainClient

    monkeypatch.setenv("COLDSNAP_PULL_SPOOL", "1")
    blob, wf = pinned_blob(tmp_path, 64_000)
    server, arrivals = RangeServer(blob), Arrivals()
    started: list = []
    real = pieces.Fetcher.__init__

    def counted(self) -> None:
        real(self)
        started.append(self.proc)

    monkeypatch.setattr(pieces.Fetcher, "__init__", counted)
    try:
        arrivals.start_fetchers()
        ahead = list(started)
        assert len(ahead) == pieces.fetcher_count() and all(p.poll() is None for p in ahead)  # waiting for work
        done: dict = {}
        pull = threading.Thread(target=lambda: done.update(r=pieces.fetch_by_pieces(
            PlainClient, server.url, tmp_path / "part", len(blob), wf, "test", arrivals=arrivals, digest="d")))
        pull.start()
        assert arrivals.whole("d", timeout=30)
        arrivals.allow_sync()
        pull.join(30)
        assert done["r"] == (len(blob), 0) and (tmp_path / "part").read_bytes() == blob
        assert started == ahead and all(p.wait(10) == 0 for p in ahead)  # no other process fetched
        left = Arrivals()  # a pull that needs none: they end with it
        left.start_fetchers()
        spare = started[len(ahead):]
        assert spare and all(p.poll() is None for p in spare)
        left.end()
        assert all(p.wait(10) == 0 for p in spare)
    finally:
        server.close()
    plain, unused = RangeServer(blob, ranges=False), Arrivals()  # no ranges: one stream, and the fetchers end
    try:
        unused.start_fetchers()
        spare = started[len(ahead) + len(spare):]
        with pytest.raises(pieces.NoRanges):
            pieces.fetch_by_pieces(PlainClient, plain.url, tmp_path / "part2", len(blob), wf, "test",
                                   arrivals=unused, digest="d2")
        assert spare and all(p.wait(10) == 0 for p in spare) and unused.take_fetchers() == []
    finally:
        plain.close()


def test_a_piece_whose_connection_breaks_is_fetched_again_not_refused(tmp_path):
    """A fetching process puts a piece into its memfd as it arrives: a connection that ends before the piece does
    is a broken one (fetched again, up to ATTEMPTS times), never a piece that fails its pin."""
    import hashlib
    import os

    from coldsnap.capsule.fetcher import PlainClient, broken, fetch_piece

    blob = os.urandom(64_000)
    pin = hashlib.sha256(blob[4096:8192]).hexdigest()
    fd = os.memfd_create("piece")
    os.ftruncate(fd, 4096)
    cut, whole = RangeServer(blob, short=True), RangeServer(blob)
    try:
        with pytest.raises(broken()):
            fetch_piece(PlainClient(), cut.url, fd, 4096, 4096, pin, "test", lambda n: None, base=4096)
        assert fetch_piece(PlainClient(), whole.url, fd, 4096, 4096, pin, "test", lambda n: None, base=4096)
        assert os.pread(fd, 4096, 0) == blob[4096:8192]
    finally:
        os.close(fd)
        cut.close()
        whole.close()


def test_a_restore_from_the_nodes_own_store_does_not_load_the_http_client():
    """The restore's modules reach the fetcher (pieces' types), but only a pull talks HTTP: a restore of a capsule
    already on the node does not pay for importing requests (0.06 s on the CPU machine), nor oras."""
    import subprocess
    import sys

    code = ("import sys, coldsnap.cli.main, coldsnap.flows.restore, coldsnap.flows.container_restore; "
            "print(sorted(m for m in ('requests', 'urllib3', 'oras') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


def test_a_fetching_process_brings_a_whole_blob_hashed_and_says_how_far_it_is(tmp_path):
    """A restore's pull fetches the capsule's CRIU images in processes of their own (a GIL each, started ahead), a
    stream per blob: the process writes the blob into the partial file from byte 0, says how far it is as it goes
    (the restore unpacks behind it) and the sha256 of what came, for the pull to compare with the digest; a broken
    connection is told with how far it got (the pull resumes from there), more bytes than the blob's size as such."""
    import hashlib
    import os

    from coldsnap.capsule import pieces

    blob = os.urandom((3 << 20) + 12345)

    def fetched(server: RangeServer, size: int) -> tuple[list[list[str]], bytes]:
        part = tmp_path / f"part{server.url.split(':')[-1].split('/')[0]}"
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fetcher = pieces.Fetcher()
        try:
            fetcher.give({"url": server.url, "authorization": None, "blob": size, "every": 1 << 20}, [fd])
            assert fetcher.proc.stdout is not None
            lines = [line.decode().split() for line in fetcher.proc.stdout]
            assert fetcher.ended() is None
        finally:
            os.close(fd)
            server.close()
        return lines, part.read_bytes()

    lines, got = fetched(RangeServer(blob, ranges=False), len(blob))
    assert got == blob and lines[-1] == ["whole", str(len(blob)), hashlib.sha256(blob).hexdigest()]
    told = [int(n) for word, n in lines[:-1] if word == "at"]
    assert len(told) == len(lines) - 1 >= 3 and told == sorted(told) and told[-1] == len(blob)  # as it went

    lines, got = fetched(RangeServer(blob, ranges=False, short=True), len(blob))
    assert lines[-1][0] == "broken" and 0 < int(lines[-1][1]) < len(blob) and got == blob[:int(lines[-1][1])]

    lines, got = fetched(RangeServer(blob, ranges=False), len(blob) - 1)
    assert lines[-1] == ["long"]  # never hashed as the blob


@pytest.mark.parametrize("ahead, fetchers, direct, cores, expected", [
    ("", "", "", 16, False),       # by default the images come on the restore's threads, the weights after them
    ("", "2", "", 16, True),       # auto: the images by processes, so the weights go beside them
    ("auto", "4", "0", 2, True),   # whatever the cores
    ("auto", "0", "0", 16, False),  # auto follows the images' fetchers
    ("auto", "0", "1", 16, True),  # and the direct way (its head beside the images, its orders at the profile)
    ("0", "2", "1", 16, False),
    ("1", "0", "", 2, True),
])
def test_the_weights_start_beside_the_images_where_the_images_come_by_processes(monkeypatch, ahead, fetchers,
                                                                                direct, cores, expected):
    from coldsnap.capsule import pieces

    monkeypatch.setenv("COLDSNAP_PULL_WEIGHTS_AHEAD", ahead)
    monkeypatch.setenv("COLDSNAP_PULL_IMAGE_FETCHERS", fetchers)
    monkeypatch.setenv("COLDSNAP_PULL_DIRECT", direct)
    monkeypatch.setattr(pieces.os, "cpu_count", lambda: cores)
    assert pieces.weights_ahead() is expected
    assert pieces.weights_ahead(choosing=True) is (ahead != "0")  # a restore choosing the direct way at the profile


class HostSink:
    """A stand-in for the GPU's sink (coldsnap.gpu.prefetch._GpuSink, which needs a GPU: packaging/device runs it):
    its "device memory" is a bytearray, each buffer's bytes copied there at their offset in the file."""

    def __init__(self, device: bytearray, chunk: int) -> None:
        self.device, self.bufs, self.sent = device, [bytearray(chunk), bytearray(chunk)], 0

    def buffer(self, k: int) -> memoryview:
        return memoryview(self.bufs[k])

    def send(self, k: int, n: int, offset: int) -> None:
        self.device[offset:offset + n] = self.bufs[k][:n]
        self.sent += 1

    def finish(self) -> None:
        pass


def _direct_pull(tmp_path, monkeypatch, served: bytes | None = None, **server):
    """A pull with COLDSNAP_PULL_DIRECT=1 a restore reads while it streams, on its thread: (blob, wf, server,
    arrivals, partial, thread, its outcome). served: what the registry serves instead of the pinned blob."""
    from coldsnap.capsule.fetcher import PlainClient
    from coldsnap.capsule.pieces import fetch_by_pieces

    monkeypatch.setenv("COLDSNAP_PULL_DIRECT", "1")
    blob, wf = pinned_blob(tmp_path, 40_000)
    srv, arrivals, part = RangeServer(served or blob, **server), Arrivals(), tmp_path / "blob.partial"
    done: dict = {}

    def run() -> None:
        try:
            done["r"] = fetch_by_pieces(PlainClient, srv.url, part, len(blob), wf, "test", arrivals=arrivals,
                                        digest="d")
        except BaseException as e:  # noqa: BLE001 - the test reads it
            done["error"] = e
        finally:
            arrivals.end()

    pull = threading.Thread(target=run)
    pull.start()
    return blob, wf, srv, arrivals, part, pull, done


def test_a_direct_pull_offers_every_piece_at_once_and_fetches_them_itself_only_after_the_first_token(
        tmp_path, monkeypatch):
    """Direct: the pull offers every piece of the file to a prefetcher before any is here, with where the data
    section starts (the registry's first 8 bytes); the prefetcher fetches each piece from the registry itself,
    hashed against its pin as it arrives, into two buffers in turn (here a stand-in sink in host memory); the pull
    fetches the file's head into the partial meanwhile (the engine reads its header from the file), and the other
    pieces for the node's copy only once the restore is past its first token."""
    from coldsnap.gpu.direct import receive_pieces

    blob, wf, srv, arrivals, part, pull, done = _direct_pull(tmp_path, monkeypatch)
    try:
        job = arrivals.direct("d", timeout=30)
        assert job is not None and job["url"] == srv.url and job["hash"] == wf.chunk_digest
        cb, head = wf.chunk_bytes, 8 + int.from_bytes(blob[:8], "little")
        assert job["data_offset"] == head and job["partial"] == str(part)
        assert [p[0] for p in job["pieces"]] == list(range(0, len(blob), cb))
        assert [p[2] for p in job["pieces"]] == wf.chunks and sum(p[1] for p in job["pieces"]) == len(blob)
        device, checked, sinks = bytearray(len(blob)), [], []

        def sink() -> HostSink:
            sinks.append(HostSink(device, 1000))
            return sinks[-1]

        receive_pieces(job, 3, sink, checked.append, chunk=1000)
        assert bytes(device) == blob and sorted(map(tuple, checked)) == sorted(map(tuple, job["pieces"]))
        assert sum(s.sent for s in sinks) == sum(-(-p[1] // 1000) for p in job["pieces"])  # chunk by chunk
        first = -(-head // cb) * cb  # the head's pieces end here
        assert arrivals.head_in("d", timeout=30)
        pull.join(0.5)
        on_disk = part.read_bytes()
        assert pull.is_alive() and on_disk[:first] == blob[:first]  # the head, for the engine
        assert on_disk[first:] == bytes(len(blob) - first)  # the rest not until the token
        arrivals.allow_sync()
        pull.join(30)
        assert done["r"] == (len(blob), 0) and part.read_bytes() == blob  # the node's copy, whole and checked
    finally:
        arrivals.allow_sync()
        pull.join(30)
        srv.close()


def test_a_direct_piece_that_does_not_match_its_pin_fails_the_load_and_the_pull(tmp_path, monkeypatch):
    """The registry serves a piece that is not the pinned one: the prefetcher's load fails on it (the engine then
    reads its file), and the pull, asked for the files, refuses the blob (CAPSULE_CORRUPT) and keeps nothing."""
    from coldsnap.contracts import ColdSnapError, ErrorCode
    from coldsnap.gpu.direct import DirectError, receive_pieces

    blob = safetensors_bytes(40_000)
    bad = bytearray(blob)
    bad[-5] ^= 0xFF  # in the last piece, past the head
    _, _, srv, arrivals, part, pull, done = _direct_pull(tmp_path, monkeypatch, served=bytes(bad))
    try:
        job = arrivals.direct("d", timeout=30)
        assert job is not None
        device = bytearray(len(blob))
        with pytest.raises(DirectError, match=f"the piece at byte {job['pieces'][-1][0]} does not match the pin"):
            receive_pieces(job, 2, lambda: HostSink(device, 4096), lambda piece: None)
        assert not arrivals.filed("d", timeout=30)  # asked for them: the pull fetches, and refuses
        pull.join(30)
        assert isinstance(done.get("error"), ColdSnapError) and done["error"].code == ErrorCode.CAPSULE_CORRUPT
        assert not part.exists()
    finally:
        arrivals.allow_sync()
        pull.join(30)
        srv.close()


def test_a_direct_pull_nobody_takes_fetches_its_pieces_at_once(tmp_path, monkeypatch):
    """No prefetcher takes the offer (no GPU, no room, several ranks): the restore declines (file_now) and the pull
    fetches the rest into the partial without waiting for the first token; the offer is then gone."""
    blob, _, srv, arrivals, part, pull, done = _direct_pull(tmp_path, monkeypatch)
    try:
        assert arrivals.direct("d", timeout=30) is not None
        arrivals.file_now()
        assert arrivals.direct("d", timeout=0) is None
        assert arrivals.filed("d", timeout=30) and part.read_bytes() == blob
    finally:
        arrivals.allow_sync()
        pull.join(30)
        srv.close()
    assert done["r"] == (len(blob), 0)


def test_a_direct_fetch_follows_the_registry_redirect_without_its_authorization(tmp_path):
    """A registry that redirects its blobs to storage elsewhere: the prefetcher follows, sending the pull's
    authorization to the registry only (a presigned URL must not carry it)."""
    import http.server

    from coldsnap.gpu.direct import receive_pieces

    blob, wf = pinned_blob(tmp_path, 20_000)
    seen: list = []

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(("registry", self.headers.get("Authorization")))
            self.send_response(307 if self.headers.get("Authorization") == "Bearer t" else 401)
            self.send_header("Location", storage.url + "?sig=1")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    storage = RangeServer(blob)
    registry = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=registry.serve_forever, daemon=True).start()
    try:
        cb = wf.chunk_bytes
        job = {"url": f"http://127.0.0.1:{registry.server_address[1]}/v2/r/blobs/x", "authorization": "Bearer t",
               "hash": wf.chunk_digest, "pieces": [[o, min(cb, len(blob) - o), wf.chunks[o // cb]]
                                                   for o in range(cb, len(blob), cb)]}
        device = bytearray(len(blob))
        receive_pieces(job, 2, lambda: HostSink(device, cb), lambda piece: None)
        assert bytes(device[cb:]) == blob[cb:] and seen and all(a == "Bearer t" for _, a in seen)
        assert storage.authorizations and not any(storage.authorizations)  # storage never saw it
    finally:
        registry.shutdown()
        registry.server_close()
        storage.close()


def test_a_direct_job_must_cover_the_file_without_a_gap():
    """The prefetcher loads a direct job only when its pieces run from the file's first byte to its last."""
    from coldsnap.gpu.prefetch import PrefetchError, direct_extent

    assert direct_extent([[100, 200, "b"], [0, 100, "a"]]) == 300
    for pieces, why in (([[0, 100, "a"], [150, 100, "b"]], "a gap at byte 100"),
                        ([[20, 280, "a"]], "a gap at byte 0")):
        with pytest.raises(PrefetchError, match=why):
            direct_extent(pieces)


class HostDriver:
    """A stand-in for the CUDA driver (coldsnap.gpu.vmm.Driver), for the calls the prefetcher's copies make: pinned
    memory is host memory, an async copy to the device is a memmove done at once, streams and events do nothing.
    The real driver runs the same code on the device machine (tests/test_gpu_prefetch.py)."""

    def __init__(self) -> None:
        self.held: dict[int, object] = {}
        self.calls: list[str] = []
        self.lib = self

    def call(self, fn: str, *args) -> None:
        import ctypes

        self.calls.append(fn)
        if fn == "cuMemHostAlloc":
            mem = ctypes.create_string_buffer(args[1])
            args[0]._obj.value = ctypes.addressof(mem)
            self.held[ctypes.addressof(mem)] = mem
        elif fn in ("cuStreamCreate", "cuEventCreate"):
            args[0]._obj.value = 1
        elif fn == "cuMemcpyHtoDAsync_v2":
            ctypes.memmove(args[0], args[1], args[2])

    def use_primary_context(self, device: int) -> int:
        return 1

    def cuMemFreeHost(self, p) -> None:  # noqa: N802 - the driver's name
        self.held.pop(p.value)

    def cuStreamSynchronize(self, s) -> None:  # noqa: N802
        pass

    def cuEventDestroy_v2(self, e) -> None:  # noqa: N802
        pass

    def cuStreamDestroy_v2(self, s) -> None:  # noqa: N802
        pass


def test_the_gpu_sink_puts_each_pieces_bytes_at_its_place_in_the_data_section(tmp_path):
    """The sink the prefetcher gives each connection (two pinned buffers, each copied to the GPU buffer at its
    bytes' place in the data section, the header's bytes skipped), on a stand-in driver whose "device" is host
    memory: the data section comes out whole, the file's first 8 bytes are kept for the header's check, the buffers
    waited for before reuse and freed at the end."""
    import ctypes

    from coldsnap.gpu import direct
    from coldsnap.gpu.prefetch import _GpuSink

    blob, wf = pinned_blob(tmp_path, 40_000)
    cb = wf.chunk_bytes
    base = 8 + int.from_bytes(blob[:8], "little")
    assert 64 < base < 96  # with 32-byte buffers: two of header, one across the data section's start
    device = (ctypes.c_char * (len(blob) - base))()
    driver, server, head = HostDriver(), RangeServer(blob), {}
    try:
        job = {"url": server.url, "authorization": None, "hash": wf.chunk_digest,
               "pieces": [[o, min(cb, len(blob) - o), wf.chunks[o // cb]] for o in range(0, len(blob), cb)]}
        direct.receive_pieces(job, 2, lambda: _GpuSink(driver, None, ctypes.addressof(device), base, head),
                              lambda piece: None, chunk=32)
    finally:
        server.close()
    assert bytes(device) == blob[base:] and head["first"] == blob[:8] and not driver.held  # every buffer freed
    assert driver.calls.count("cuEventSynchronize") > 0 and driver.calls.count("cuStreamSynchronize") == 2


def test_the_buffered_fill_and_the_spooled_arrivals_reach_the_gpu_whole_on_a_stand_in_driver(tmp_path):
    """The prefetcher's two other ways onto the GPU, on the stand-in driver: the file read through pinned buffers
    (fill_buffered, two threads, several 16 MiB jobs each), and a streamed pull's pieces read from its spool (a
    memfd a piece) as they are announced (fill_arriving): the data section comes out whole, every buffer freed."""
    import ctypes
    import os

    from coldsnap.capsule.pieces import Spool
    from coldsnap.gpu.prefetch import fill_arriving, fill_buffered, spool_reader, whole_section

    blob = safetensors_bytes(40 << 20)
    base = 8 + int.from_bytes(blob[:8], "little")
    path = tmp_path / "w.safetensors"
    path.write_bytes(blob)
    driver = HostDriver()
    device = (ctypes.c_char * (len(blob) - base))()
    fd = os.open(path, os.O_RDONLY)
    try:
        fill_buffered(driver, 0, ctypes.addressof(device), fd, base, whole_section(len(blob) - base), 2)
    finally:
        os.close(fd)
    assert bytes(device) == blob[base:] and not driver.held
    piece = 4 << 20
    spool = Spool(len(blob), piece)
    try:
        for o in range(0, len(blob), piece):
            os.pwrite(spool.fds[o // piece], blob[o:o + piece], 0)
        section = SectionArrivals(len(blob), lambda: base - 8)
        arrived = [p for o in reversed(range(0, len(blob), piece))  # in any order: the head's piece last
                   for p in section.add(o, min(piece, len(blob) - o))]
        device = (ctypes.c_char * (len(blob) - base))()
        fill_arriving(driver, 0, ctypes.addressof(device), spool_reader(spool.fds, piece), base, iter(arrived), 2)
    finally:
        spool.close()
    assert section.complete and bytes(device) == blob[base:] and not driver.held


def test_a_direct_prefetch_is_ordered_by_whichever_of_its_standby_and_the_profile_comes_second(monkeypatch):
    """streaming.PrefetchAhead: the standby prefetcher (the restore's thread) and the capsule's profile (the pull's)
    come in either order; the second gives the orders, once; at admission the restore takes that prefetch, orders
    it then if the profile came no sooner, or dismisses the standby where there is nothing to order. A capsule no
    single prefetcher can take declines the direct way as its profile comes, before its weights move."""
    from types import SimpleNamespace

    from coldsnap.flows import streaming

    ordered: list = []
    fits = {"sha256:a": True, "sha256:tp": False}
    monkeypatch.setattr(streaming, "direct_fits", lambda capsule: fits[capsule.digest])

    def prefetch_ahead(capsule, arrivals, gpu_map, standby):
        ordered.append((capsule.digest, arrivals, standby))
        return lambda: f"prefetch of {capsule.digest}"

    monkeypatch.setattr(streaming, "prefetch_ahead", prefetch_ahead)

    class Standby:  # stand-in: a real one (tests/test_gpu_prefetch.py) runs its orders only on a GPU machine
        dismissed = False

        def dismiss(self):
            self.dismissed = True

    a = SimpleNamespace(digest="sha256:a")
    for profile_first in (True, False):
        ordered.clear()
        ahead, standby, pulling = streaming.PrefetchAhead({}), Standby(), Arrivals()
        if profile_first:
            ahead.profile_in(a, pulling)
            assert ordered == []  # no prefetcher to order yet
            ahead.stand_by(standby)
        else:
            ahead.stand_by(standby)
            assert ordered == []
            ahead.profile_in(a, pulling)
        assert ordered == [("sha256:a", pulling, standby)] and pulling.direct_chosen is True
        assert ahead.taken(a, SimpleNamespace(pieces=Arrivals()))() == "prefetch of sha256:a"
        assert len(ordered) == 1 and not standby.dismissed
    ordered.clear()
    late, standby, later = streaming.PrefetchAhead({}), Standby(), Arrivals()  # its profile came with the images
    late.stand_by(standby)
    assert late.taken(a, SimpleNamespace(pieces=later))() == "prefetch of sha256:a"
    assert ordered == [("sha256:a", later, standby)]
    local, standby = streaming.PrefetchAhead({}), Standby()  # nothing pulled: nothing to order
    local.stand_by(standby)
    assert local.taken(a, None) is None and standby.dismissed
    tp, pulling = streaming.PrefetchAhead({}), Arrivals()  # weights for two GPUs: spooled, not direct
    tp.profile_in(SimpleNamespace(digest="sha256:tp"), pulling)
    assert pulling.direct_chosen is False


@pytest.mark.parametrize("mode, driver, prefetch, wanted, unchosen", [
    ("", True, "", True, False),        # auto, by default: a node with an NVIDIA driver, once a restore chooses it
    ("auto", False, "", False, False),  # none: no prefetcher could take the pieces
    ("auto", True, "0", False, False),  # the prefetch turned off
    ("1", False, "", True, True),       # on: whoever does not say no
    ("0", True, "", False, False),
])
def test_the_direct_way_is_taken_where_a_gpu_prefetcher_can_take_the_pieces(monkeypatch, mode, driver, prefetch,
                                                                           wanted, unchosen):
    """COLDSNAP_PULL_DIRECT: whether a restore may go direct (direct_wanted), and whether a pull does
    (Arrivals.goes_direct): as its restore chose at the profile, or, where none chose (a container's pull), only
    when it is 1."""
    from coldsnap.capsule import pieces

    monkeypatch.setenv("COLDSNAP_PULL_DIRECT", mode)
    monkeypatch.setenv("COLDSNAP_PREFETCH", prefetch)
    real = pieces.os.path.exists
    monkeypatch.setattr(pieces.os.path, "exists", lambda p: driver if p == "/dev/nvidiactl" else real(p))
    assert pieces.direct_wanted() is wanted
    assert Arrivals().goes_direct() is unchosen
    chosen, declined = Arrivals(), Arrivals()
    chosen.choose_direct(True)  # one file for one GPU
    declined.choose_direct(False)  # a capsule no single prefetcher takes
    assert chosen.goes_direct() is wanted and declined.goes_direct() is False
