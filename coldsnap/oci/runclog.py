"""Errors the way runc reports them, so containerd, podman and dockerd read ours like runc's: the message goes
to the --log file in --log-format (json: {"level":"error","msg":...,"time":...}; text: logrus key=value) and to
stderr, and the exit status is 1."""

from __future__ import annotations

import json
import sys
import time

from coldsnap.oci.argv import RuncArgv


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


def format_line(level: str, msg: str, log_format: str) -> str:
    if log_format == "json":
        return json.dumps({"level": level, "msg": msg, "time": _now()})
    return f'time="{_now()}" level={level} msg={json.dumps(msg)}'


MAX_MESSAGE = 2000  # one line, whatever a message quotes


def _one_line(msg: str) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= MAX_MESSAGE else msg[:MAX_MESSAGE] + "…"


def log(parsed: RuncArgv, level: str, msg: str) -> None:
    """Append one line to runc's --log file (when one is set and is not stderr)."""
    if not parsed.log or parsed.log in ("/dev/stderr", "/proc/self/fd/2"):
        return
    try:
        with open(parsed.log, "a", encoding="utf-8") as f:
            f.write(format_line(level, _one_line(msg), parsed.log_format) + "\n")
    except OSError:
        pass


def fail(parsed: RuncArgv, msg: str) -> int:
    log(parsed, "error", msg)
    print(_one_line(msg), file=sys.stderr, flush=True)
    return 1
