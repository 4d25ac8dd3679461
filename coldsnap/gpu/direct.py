"""Weights from the registry straight onto the GPU (COLDSNAP_PULL_DIRECT; by default for a process restore on a GPU
node): the prefetcher of a restore whose pull streams its weights fetches their pieces itself, each on a connection
of its own, received into two pinned buffers in turn, hashed as they fill and copied to the GPU from there, never
kept in host memory. A piece counts once its bytes match its pin; one that does not fails the whole load (the engine
then reads its file, whose pull fails on the same piece: nothing unverified is ever served). The node's own copy of
the blob is fetched by the pull after the first token.

Why: landing 31 GB in fresh host memory first (the pull's spool) costs a third of the rate; received into small
reused buffers the same connections moved 8 GB/s in one process (docs/benchmarks.md).

The job, from the pull (coldsnap.capsule.pieces.Arrivals.offer_direct), offered before any piece is in: {"url",
"authorization" (a header value or null), "hash" (the pins' algorithm), "partial" (the blob's partial file: the file
the engine will read its header from, the pull fetching the head's pieces into it meanwhile), "data_offset" (where
the data section starts, as the registry's first 8 bytes say: checked by the prefetcher against the first piece's
pinned bytes), "pieces": [[offset, length, pin], ...]: every piece of the file}."""

from __future__ import annotations

import functools
import http.client
import queue
import ssl
import threading
from typing import Callable, Iterator, Protocol
from urllib.parse import urljoin, urlsplit

from coldsnap.base.digests import piece_hasher

CHUNK = 16 << 20  # bytes received into a buffer before it is hashed and copied; two buffers per connection
REDIRECTS = 5
TIMEOUT = 300  # seconds a connection may stay silent (as the registry client's)


class DirectError(RuntimeError):
    """A piece could not be fetched, or does not match its pin (the message says which and why)."""


class Connections:
    """One thread's connections, by scheme and host, kept open from one piece to the next."""

    def __init__(self, authorization: str | None) -> None:
        self.authorization = authorization
        self._open: dict[tuple[str, str], http.client.HTTPConnection] = {}

    def get(self, url: str, first: int, last: int) -> http.client.HTTPResponse:
        """GET url's bytes [first, last], following redirects (the authorization goes to the first host only, as
        a registry's redirect to its storage expects); raises DirectError unless the answer is that range."""
        origin = urlsplit(url).netloc
        for _ in range(REDIRECTS + 1):
            parts = urlsplit(url)
            headers = {"Range": f"bytes={first}-{last}"}
            if self.authorization and parts.netloc == origin:
                headers["Authorization"] = self.authorization
            conn = self._connection(parts.scheme, parts.netloc)
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            try:
                conn.request("GET", path, headers=headers)
                r = conn.getresponse()
            except (OSError, http.client.HTTPException):  # a kept connection the server closed: once more, anew
                conn.close()
                conn.request("GET", path, headers=headers)
                r = conn.getresponse()
            if r.status in (301, 302, 303, 307, 308) and r.getheader("Location"):
                r.read()
                url = urljoin(url, r.getheader("Location"))
                continue
            if r.status != 206 or not (r.getheader("Content-Range") or "").startswith(f"bytes {first}-{last}/"):
                r.read()
                raise DirectError(f"the registry answered {r.status} to the range at byte {first}, not that range")
            return r
        raise DirectError(f"more than {REDIRECTS} redirects for the range at byte {first}")

    def _connection(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        key = (scheme, netloc)
        if key not in self._open:
            if scheme == "https":
                self._open[key] = http.client.HTTPSConnection(netloc, timeout=TIMEOUT, context=_tls())
            elif scheme == "http":
                self._open[key] = http.client.HTTPConnection(netloc, timeout=TIMEOUT)
            else:
                raise DirectError(f"no way to fetch a {scheme!r} URL")
        return self._open[key]

    def close(self) -> None:
        for conn in self._open.values():
            conn.close()


@functools.cache
def _tls() -> ssl.SSLContext:
    """The CA bundle the registry client (requests) trusts, so both see the same registries."""
    try:
        import certifi

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()


class Sink(Protocol):
    """Where one connection's bytes go: buffer(k) waits until buffer k (of two) may be filled again and returns it;
    send(k, n, offset) hands its first n bytes, the blob's bytes at offset, onward; finish() waits for what was
    sent and lets go of the buffers (called however the thread's work ended)."""

    def buffer(self, k: int) -> memoryview: ...
    def send(self, k: int, n: int, offset: int) -> None: ...
    def finish(self) -> None: ...


def receive_piece(conns: Connections, url: str, piece: list, algorithm: str, sink: Sink, chunk: int = CHUNK) -> None:
    """One piece, [offset, length, pin]: received into the sink's buffers in turn, each hashed and sent as it
    fills. Raises DirectError when the connection breaks or the bytes do not match the pin."""
    offset, length, pin = int(piece[0]), int(piece[1]), str(piece[2])
    h = piece_hasher(algorithm)
    at, k = 0, 0
    try:
        with conns.get(url, offset, offset + length - 1) as r:
            while at < length:
                view = sink.buffer(k)[:min(chunk, length - at)]
                got = 0
                while got < len(view):
                    n = r.readinto(view[got:])
                    if not n:
                        raise DirectError(f"the registry sent {at + got} of the {length} bytes of the piece at "
                                          f"byte {offset}")
                    got += n
                h.update(view)
                sink.send(k, got, offset + at)
                at, k = at + got, 1 - k
    except (OSError, http.client.HTTPException) as e:
        raise DirectError(f"the piece at byte {offset}: {e}") from None
    if h.hexdigest() != pin:
        raise DirectError(f"the piece at byte {offset} does not match the pin of the capsule's weights")


def receive_pieces(job: dict, threads: int, sink_for: Callable[[], Sink], checked: Callable[[list], None],
                   chunk: int = CHUNK) -> None:
    """Every piece of the job, on `threads` connections at once, each thread with a sink of its own (sink_for,
    called on that thread); checked(piece) once a piece matched its pin and its bytes were sent. The first failure
    stops every thread and is raised."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for piece in job["pieces"]:
        todo.put(piece)
    failed: list[BaseException] = []

    def pieces() -> Iterator[list]:
        while not failed:
            try:
                yield todo.get_nowait()
            except queue.Empty:
                return

    def work() -> None:
        conns = Connections(job.get("authorization"))
        sink = None
        try:
            sink = sink_for()
            for piece in pieces():
                receive_piece(conns, job["url"], piece, job["hash"], sink, chunk)
                checked(piece)
        except BaseException as e:  # noqa: BLE001 - the first one is raised below
            failed.append(e)
        finally:
            try:
                if sink is not None:
                    sink.finish()
            except BaseException as e:  # noqa: BLE001
                failed.append(e)
            conns.close()

    workers = [threading.Thread(target=work, name="coldsnap-direct", daemon=True)
               for _ in range(max(1, min(threads, len(job["pieces"]))))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if failed:
        raise failed[0]
