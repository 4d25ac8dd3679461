"""Quiesce: capture only when no client connection is open (a restored server must not owe anyone a reply)."""

from __future__ import annotations

import time

from coldsnap.contracts import ColdSnapError, ErrorCode

# /proc/net/tcp states that mean a live connection (not LISTEN 0A, not TIME_WAIT 06 / CLOSE 07, which no fd holds).
LIVE_STATES = {"01", "02", "03", "04", "05", "08", "09", "0B"}


def open_connections(pid: int, port: int | None = None) -> int:
    """Live TCP connections in the workload's network namespace; with `port`, only those to the served port (an
    engine's own loopback connections, e.g. SGLang's TCPStore to itself, live as long as it does)."""
    count = 0
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] in LIVE_STATES and (port is None or int(cols[1].rsplit(":", 1)[1], 16) == port):
                        count += 1
        except (FileNotFoundError, ProcessLookupError):  # no such table, or the workload is gone
            continue
    return count


def wait_no_connections(pid: int, port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while n := open_connections(pid, port):
        if time.monotonic() > deadline:
            raise ColdSnapError(ErrorCode.RESOURCE_BUSY,
                                f"{n} client connection(s) still open to the workload after {timeout:.0f} s; "
                                "capture needs it idle")
        time.sleep(0.02)
