"""`python -m coldsnap.capsule.fetcher`: pieces of one weights blob fetched into a restore's spool by a process of
its own (coldsnap.capsule.pieces starts a few). The restore's own process admits, stages and runs CRIU meanwhile;
pull threads there take its GIL back for every chunk they move, and on the GPU machine that slowed the restore's own
steps several-fold.

stdin: one JSON line {"url", "authorization" (a header value, or null), "threads", "pieces": [[offset, length, pin,
fd], ...]}, each fd an inherited descriptor of the piece's memfd; the header travels on stdin, never in arguments
or the environment. stdout, one line per piece: `ok OFFSET LENGTH` (in the spool, matching its pin), `bad OFFSET`
(not matching it), `broken OFFSET` (its connection broke ATTEMPTS times); or `noranges` when the registry does not
answer Range requests. It exits once every piece is told, or when whoever reads its lines is gone."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import requests

from coldsnap.capsule.pieces import ATTEMPTS, BROKEN, NoRanges, fetch_piece

TIMEOUT = (30, 300)  # seconds to connect, and between reads (as the registry client's own)


class PlainClient:
    """What fetch_piece (and fetch_by_pieces) asks of a registry client, over one requests session, with the pull's
    authorization where it has one."""

    def __init__(self, authorization: str | None = None) -> None:
        self.session = requests.Session()
        self.headers = {"Authorization": authorization} if authorization else {}

    def request(self, method, url, ok, what, headers, stream, not_found):
        return self.session.request(method, url, headers={**self.headers, **headers}, stream=stream, timeout=TIMEOUT)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m coldsnap.capsule.fetcher", description=__doc__.split("\n\n")[0]) \
        .parse_args(argv)
    job = json.loads(sys.stdin.readline())
    lock, local = threading.Lock(), threading.local()

    def say(line: str) -> None:
        try:
            with lock:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            os._exit(1)  # nobody reads: the restore is gone, and with it the spool's use

    def one(piece: list) -> None:
        offset, length, pin, fd = int(piece[0]), int(piece[1]), str(piece[2]), int(piece[3])
        if not hasattr(local, "client"):
            local.client = PlainClient(job.get("authorization"))
        for _ in range(ATTEMPTS):
            try:
                good = fetch_piece(local.client, job["url"], fd, offset, length, pin,
                                   f"fetching the piece at byte {offset}", lambda n: None, write_behind=False,
                                   base=offset)
            except NoRanges:
                say("noranges")
                return
            except BROKEN:
                continue
            say(f"ok {offset} {length}" if good else f"bad {offset}")
            return
        say(f"broken {offset}")

    with ThreadPoolExecutor(max(1, int(job["threads"]))) as pool:
        list(pool.map(one, job["pieces"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
