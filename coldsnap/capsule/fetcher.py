"""`python -P coldsnap/capsule/fetcher.py --socket FD`: a fetching process of a restore's pull (coldsnap.capsule.pieces
starts a few, ahead of their work: Fetcher). The restore's own process admits, stages and runs CRIU meanwhile; pull
threads there take its GIL back for every chunk they move, and on the GPU machine that slowed the restore's own steps
several-fold. This file imports nothing of ColdSnap (run by its path, not as a module of the package), so that a
process starts in about a tenth of a second instead of the package's third: it is ready before the capsule's own
blobs are.

It starts (interpreter and imports) before it has work, then reads its job: on stdin, one JSON line; on FD, an
inherited AF_UNIX SOCK_SEQPACKET socket, the job's descriptors, in order (SCM_RIGHTS). The authorization header
travels in the job, never in arguments or the environment. Two kinds of job:

- pieces of one weights blob into a restore's spool: {"url", "authorization" (a header value, or null), "threads",
  "hash" (the pins': sha256 or blake3), "pieces": [[offset, length, pin], ...]} and the pieces' memfds. Each piece is
  hashed as it arrives and written into its memfd (receiving into the memfd's mapping instead measured the same:
  bench/results/pull-variants-h100.json). A line per piece: `ok OFFSET LENGTH` (in the spool, matching its pin),
  `bad OFFSET` (not matching it), `broken OFFSET` (its connection broke ATTEMPTS times); or `noranges` when the
  registry does not answer Range requests.
- one whole blob into a new partial file: {"url", "authorization", "blob": SIZE, "every": BYTES} and the file's
  descriptor (the capsule's CRIU images, which a restore unpacks while they arrive). It is written from byte 0 and
  hashed (sha256) as it comes; lines `at N` (the first N bytes are in the file, at least every BYTES and at its
  end), then `whole N HEX` (N bytes came, hashing to HEX: whoever reads it compares with the digest), or `status
  CODE` (the registry answered that), `broken N` (the connection broke after N bytes), `long` (more than SIZE came).

It exits once its job is told, when whoever reads its lines is gone, or at once when its stdin closes before a job
came (the pull did not need it)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

READ = 1 << 20
ATTEMPTS = 3  # a piece whose connection breaks is fetched again, this many times in all
FD_BATCH = 200  # descriptors per message to a fetching process (the kernel takes at most 253)
TIMEOUT = (30, 300)  # seconds to connect, and between reads (as the registry client's own)


def broken() -> tuple[type[BaseException], ...]:
    """The errors of a connection that broke. requests is imported where it is used, so that a restore from the
    node's own store, which imports this module through coldsnap.capsule.pieces, does not load it (0.06 s)."""
    import requests

    return requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError, requests.exceptions.Timeout


class NoRanges(Exception):
    """The registry does not answer Range requests as asked: fetch the blob as one stream instead."""


def fetch_piece(client, url: str, fd: int, offset: int, length: int, pin: str, what: str,
                counted: Callable[[int], None], wrote: Callable[[int], None] | None = None, base: int = 0,
                algorithm: str = "sha256", not_found=None) -> bool:
    """One piece into the file at its offset (less base: a spool's piece is a file of its own from 0); whether its
    bytes match the pin (a digest by `algorithm`). wrote: told of each chunk written (a write-behind); not_found:
    the client's error for a missing blob."""
    last = offset + length - 1
    r = client.request("GET", url, ok=(200, 206), what=what, headers={"Range": f"bytes={offset}-{last}"},
                       stream=True, not_found=not_found)
    with r:
        if r.status_code != 206 or not r.headers.get("Content-Range", "").startswith(f"bytes {offset}-{last}/"):
            raise NoRanges()
        at = offset
        h: Any = hashlib.sha256()
        if algorithm == "blake3":  # the pins' hash, as coldsnap.base.digests.piece_hasher (the pull checked it)
            import blake3

            h = blake3.blake3()
        for chunk in r.iter_content(READ):
            if at + len(chunk) > offset + length:
                return False  # more than asked for: not this piece
            h.update(chunk)
            os.pwrite(fd, chunk, at - base)
            if wrote is not None:
                wrote(len(chunk))
            at += len(chunk)
            counted(len(chunk))
    return at == offset + length and h.hexdigest() == pin


class PlainClient:
    """What fetch_piece (and fetch_by_pieces) asks of a registry client, over one requests session, with the pull's
    authorization where it has one."""

    def __init__(self, authorization: str | None = None) -> None:
        import requests

        self.session = requests.Session()
        self.headers = {"Authorization": authorization} if authorization else {}

    def request(self, method, url, ok, what, headers, stream, not_found):
        return self.session.request(method, url, headers={**self.headers, **headers}, stream=stream, timeout=TIMEOUT)


def take_job(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """The job (stdin) and its descriptors (the socket); None when stdin closes first."""
    line = sys.stdin.readline()
    if not line:
        return None
    job = json.loads(line)
    want = 1 if "blob" in job else len(job["pieces"])
    fds: list[int] = []
    while len(fds) < want:
        _, got, _, _ = socket.recv_fds(sock, 1, FD_BATCH)
        if not got:
            raise OSError("the pull closed the socket before every descriptor came")
        fds.extend(got)
    return job, fds


def fetch_pieces(job: dict, fds: list[int], say: Callable[[str], None]) -> None:
    local = threading.local()

    def one(k: int) -> None:
        offset, length, pin = int(job["pieces"][k][0]), int(job["pieces"][k][1]), str(job["pieces"][k][2])
        if not hasattr(local, "client"):
            local.client = PlainClient(job.get("authorization"))
        for _ in range(ATTEMPTS):
            try:
                good = fetch_piece(local.client, job["url"], fds[k], offset, length, pin,
                                   f"fetching the piece at byte {offset}", lambda n: None, base=offset,
                                   algorithm=job.get("hash", "sha256"))
            except NoRanges:
                say("noranges")
                return
            except broken():
                continue
            say(f"ok {offset} {length}" if good else f"bad {offset}")
            return
        say(f"broken {offset}")

    with ThreadPoolExecutor(max(1, int(job["threads"]))) as pool:
        list(pool.map(one, range(len(fds))))


def fetch_blob(job: dict, fd: int, say: Callable[[str], None]) -> None:
    """The whole blob into fd from byte 0, hashed as it comes: one stream (its digest is of the whole)."""
    size, every = int(job["blob"]), max(1, int(job.get("every") or READ))
    h, at, told = hashlib.sha256(), 0, 0
    try:
        client = PlainClient(job.get("authorization"))
        with client.request("GET", job["url"], ok=None, what="", headers={}, stream=True, not_found=None) as r:
            if r.status_code != 200:
                say(f"status {r.status_code}")
                return
            for chunk in r.iter_content(READ):
                if at + len(chunk) > size:
                    say("long")
                    return
                h.update(chunk)
                view = memoryview(chunk)
                while view:
                    wrote = os.pwrite(fd, view, at)
                    view, at = view[wrote:], at + wrote
                if at - told >= every or at == size:
                    say(f"at {at}")
                    told = at
    except broken():
        say(f"broken {at}")
        return
    say(f"whole {at} {h.hexdigest()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P coldsnap/capsule/fetcher.py",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--socket", type=int, required=True, help="the inherited socket the job comes on")
    args = parser.parse_args(argv)
    import requests  # noqa: F401 - now, while no job is here yet (it is started ahead of its work)

    with socket.socket(fileno=args.socket) as sock:
        taken = take_job(sock)
    if taken is None:
        return 0
    job, fds = taken
    lock = threading.Lock()

    def say(line: str) -> None:
        try:
            with lock:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            os._exit(1)  # nobody reads: the restore is gone, and with it the use of what this fetches

    if "blob" in job:
        fetch_blob(job, fds[0], say)
    else:
        fetch_pieces(job, fds, say)
    return 0


if __name__ == "__main__":
    sys.exit(main())
