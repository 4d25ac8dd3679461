"""The real runc: where it is, and how to hand over to it.

Resolution order: $COLDSNAP_RUNC, then {"runc": PATH} in /etc/coldsnap/runtime.json, then `runc` on $PATH
(skipping this wrapper itself, which may be installed under that name)."""

from __future__ import annotations

import os
import sys

RUNTIME_CONFIG = "/etc/coldsnap/runtime.json"
WRAPPER_NAMES = ("coldsnap-runtime",)


class RuncNotFound(Exception):
    pass


def _is_self(path: str) -> bool:
    real = os.path.realpath(path)
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return real == me or os.path.basename(real) in WRAPPER_NAMES


def _from_config(path: str = RUNTIME_CONFIG) -> str | None:
    if not os.path.exists(path):
        return None
    import json

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("runc")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def find_runc() -> str:
    for candidate in (os.environ.get("COLDSNAP_RUNC"), _from_config()):
        if candidate:
            if os.access(candidate, os.X_OK) and not _is_self(candidate):
                return candidate
            raise RuncNotFound(f"runc {candidate!r} (from $COLDSNAP_RUNC or {RUNTIME_CONFIG}) is not an executable "
                               "other than coldsnap-runtime")
    for directory in os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").split(":"):
        candidate = os.path.join(directory or ".", "runc")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and not _is_self(candidate):
            return candidate
    raise RuncNotFound("no runc found: set COLDSNAP_RUNC, write {\"runc\": PATH} to " + RUNTIME_CONFIG
                       + ", or put runc on PATH")


def exec_runc(runc: str, argv: list[str] | tuple[str, ...]) -> None:
    """Become runc with the caller's argv, unchanged (stdio, environment and fds are inherited as they are)."""
    os.execv(runc, [runc, *argv])
