"""`python -m coldsnap.capsule.fetcher --socket FD`: pieces of one weights blob fetched into a restore's spool by a
process of its own (coldsnap.capsule.pieces starts a few, ahead of their pieces: Fetchers). The restore's own process
admits, stages and runs CRIU meanwhile; pull threads there take its GIL back for every chunk they move, and on the
GPU machine that slowed the restore's own steps several-fold.

It starts (interpreter and imports) before it has work, then reads its job: on stdin, one JSON line {"url",
"authorization" (a header value, or null), "threads", "hash" (the pins': sha256 or blake3), "pieces": [[offset,
length, pin], ...]} (the header travels there, never in arguments or the environment); on FD, an inherited AF_UNIX
SOCK_SEQPACKET socket, the pieces' memfds, in order (SCM_RIGHTS). Each piece is received straight into its memfd's
mapping and hashed there. stdout, one line per piece: `ok OFFSET LENGTH` (in the spool, matching its pin), `bad
OFFSET` (not matching it), `broken OFFSET` (its connection broke ATTEMPTS times); or `noranges` when the registry
does not answer Range requests. It exits once every piece is told, when whoever reads its lines is gone, or at
once when its stdin closes before a job came (the pull did not need it)."""

from __future__ import annotations

import argparse
import http.client
import json
import mmap
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import requests

from coldsnap.base.digests import piece_hasher
from coldsnap.capsule.pieces import ATTEMPTS, BROKEN, FD_BATCH, READ, NoRanges, fetch_piece

TIMEOUT = (30, 300)  # seconds to connect, and between reads (as the registry client's own)
RECEIVE_BROKEN = BROKEN + (OSError, http.client.HTTPException)  # the socket itself, read below requests


class PlainClient:
    """What fetch_piece (and fetch_by_pieces) asks of a registry client, over one requests session, with the pull's
    authorization where it has one."""

    def __init__(self, authorization: str | None = None) -> None:
        self.session = requests.Session()
        self.headers = {"Authorization": authorization} if authorization else {}

    def request(self, method, url, ok, what, headers, stream, not_found):
        return self.session.request(method, url, headers={**self.headers, **headers}, stream=stream, timeout=TIMEOUT)


def receive_piece(client: PlainClient, url: str, fd: int, offset: int, length: int, pin: str,
                  algorithm: str = "sha256") -> bool:
    """One piece of the blob into the memfd `fd` (its own file, from 0), received into the memfd's mapping by
    the socket itself and hashed there: no buffer of its own, no copy under the GIL. Whether it matches its pin.
    Raises NoRanges, or one of RECEIVE_BROKEN."""
    last = offset + length - 1
    r = client.request("GET", url, ok=(200, 206), what="", headers={"Range": f"bytes={offset}-{last}"}, stream=True,
                       not_found=None)
    with r:
        if r.status_code != 206 or not r.headers.get("Content-Range", "").startswith(f"bytes {offset}-{last}/"):
            raise NoRanges()
        body = getattr(r.raw, "_fp", None)  # http.client's response, below urllib3's (which reads, then copies)
        if r.headers.get("Content-Encoding", "identity") != "identity" or not isinstance(body,
                                                                                           http.client.HTTPResponse):
            r.close()  # an encoded body (no registry sends one): decoded on the way, as any other
            return fetch_piece(client, url, fd, offset, length, pin, "", lambda n: None, write_behind=False,
                               base=offset, algorithm=algorithm)
        h, at = piece_hasher(algorithm), 0
        with mmap.mmap(fd, length) as m:
            view = memoryview(m)
            try:
                while at < length:
                    n = body.readinto(view[at:at + READ])
                    if not n:  # http.client returns 0 where its response ends short: a broken connection
                        raise http.client.IncompleteRead(b"", length - at)
                    h.update(view[at:at + n])
                    at += n
            finally:
                view.release()
        if at == length and body.read(1):
            return False  # more than asked for: not this piece
    return at == length and h.hexdigest() == pin


def take_job(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """The job (stdin) and its pieces' descriptors (the socket); None when stdin closes first."""
    line = sys.stdin.readline()
    if not line:
        return None
    job = json.loads(line)
    fds: list[int] = []
    while len(fds) < len(job["pieces"]):
        _, got, _, _ = socket.recv_fds(sock, 1, FD_BATCH)
        if not got:
            raise OSError("the pull closed the socket before every piece's descriptor came")
        fds.extend(got)
    return job, fds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coldsnap.capsule.fetcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", type=int, required=True, help="the inherited socket the job comes on")
    args = parser.parse_args(argv)
    with socket.socket(fileno=args.socket) as sock:
        taken = take_job(sock)
    if taken is None:
        return 0
    job, fds = taken
    lock, local = threading.Lock(), threading.local()

    def say(line: str) -> None:
        try:
            with lock:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            os._exit(1)  # nobody reads: the restore is gone, and with it the spool's use

    def one(k: int) -> None:
        offset, length, pin = int(job["pieces"][k][0]), int(job["pieces"][k][1]), str(job["pieces"][k][2])
        if not hasattr(local, "client"):
            local.client = PlainClient(job.get("authorization"))
        for _ in range(ATTEMPTS):
            try:
                good = receive_piece(local.client, job["url"], fds[k], offset, length, pin, job.get("hash", "sha256"))
            except NoRanges:
                say("noranges")
                return
            except RECEIVE_BROKEN:
                local.client = PlainClient(job.get("authorization"))  # a fresh connection for the next attempt
                continue
            say(f"ok {offset} {length}" if good else f"bad {offset}")
            return
        say(f"broken {offset}")

    with ThreadPoolExecutor(max(1, int(job["threads"]))) as pool:
        list(pool.map(one, range(len(fds))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
