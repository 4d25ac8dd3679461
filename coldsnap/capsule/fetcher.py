"""`python -m coldsnap.capsule.fetcher --socket FD`: pieces of one weights blob fetched into a restore's spool by a
process of its own (coldsnap.capsule.pieces starts a few, ahead of their pieces: Fetchers). The restore's own process
admits, stages and runs CRIU meanwhile; pull threads there take its GIL back for every chunk they move, and on the
GPU machine that slowed the restore's own steps several-fold.

It starts (interpreter and imports) before it has work, then reads its job: on stdin, one JSON line {"url",
"authorization" (a header value, or null), "threads", "hash" (the pins': sha256 or blake3), "pieces": [[offset,
length, pin], ...]} (the header travels there, never in arguments or the environment); on FD, an inherited AF_UNIX
SOCK_SEQPACKET socket, the pieces' memfds, in order (SCM_RIGHTS). Each piece is hashed as it arrives and written
into its memfd (receiving into the memfd's mapping instead measured the same: bench/results/pull-variants-h100.json).
stdout, one line per piece: `ok OFFSET LENGTH` (in the spool, matching its pin), `bad OFFSET` (not matching it),
`broken OFFSET` (its connection broke ATTEMPTS times); or `noranges` when the registry does not answer Range
requests. It exits once every piece is told, when whoever reads its lines is gone, or at once when its stdin
closes before a job came (the pull did not need it)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import requests

from coldsnap.capsule.pieces import ATTEMPTS, BROKEN, FD_BATCH, NoRanges, fetch_piece

TIMEOUT = (30, 300)  # seconds to connect, and between reads (as the registry client's own)


class PlainClient:
    """What fetch_piece (and fetch_by_pieces) asks of a registry client, over one requests session, with the pull's
    authorization where it has one."""

    def __init__(self, authorization: str | None = None) -> None:
        self.session = requests.Session()
        self.headers = {"Authorization": authorization} if authorization else {}

    def request(self, method, url, ok, what, headers, stream, not_found):
        return self.session.request(method, url, headers={**self.headers, **headers}, stream=stream, timeout=TIMEOUT)


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
                good = fetch_piece(local.client, job["url"], fds[k], offset, length, pin,
                                   f"fetching the piece at byte {offset}", lambda n: None, write_behind=False,
                                   base=offset, algorithm=job.get("hash", "sha256"))
            except NoRanges:
                say("noranges")
                return
            except BROKEN:
                continue
            say(f"ok {offset} {length}" if good else f"bad {offset}")
            return
        say(f"broken {offset}")

    with ThreadPoolExecutor(max(1, int(job["threads"]))) as pool:
        list(pool.map(one, range(len(fds))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
