"""The real runc: where it is, and how to hand over to it.

Resolution order: $COLDSNAP_RUNC, then {"runc": PATH} in /etc/coldsnap/runtime.json, then `runc` on $PATH
(skipping this wrapper itself, which may be installed under that name).

/etc/coldsnap/runtime.json may also hold {"env": {"COLDSNAP_HOME": ..., ...}}: container engines start their
runtime with an almost empty environment (podman/conmon pass only PWD and XDG_RUNTIME_DIR), so where ColdSnap
keeps its store, run state and receipts is configured there. Variables already set win."""

from __future__ import annotations

import os
import sys

from coldsnap.base.paths import settings

RUNTIME_CONFIG = "/etc/coldsnap/runtime.json"
WRAPPER_NAMES = ("coldsnap-runtime", "coldsnap-runc")


class RuncNotFound(Exception):
    pass


def _is_self(path: str) -> bool:
    real = os.path.realpath(path)
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return real == me or os.path.basename(real) in WRAPPER_NAMES


_config: dict | None = None


def runtime_config(path: str = RUNTIME_CONFIG) -> dict:
    global _config
    if _config is None:
        _config = {}
        if os.path.exists(path):
            import json

            try:
                with open(path, encoding="utf-8") as f:
                    value = json.load(f)
                _config = value if isinstance(value, dict) else {}
            except (OSError, ValueError):
                pass
    return _config


def _from_config() -> str | None:
    value = runtime_config().get("runc")
    return value if isinstance(value, str) and value else None


def apply_config_env() -> None:
    """COLDSNAP_* settings from runtime.json, for the paths that need them (never the pass-through)."""
    env = runtime_config().get("env")
    if isinstance(env, dict):
        for key, value in env.items():
            if isinstance(key, str) and key.startswith("COLDSNAP_") and isinstance(value, str):
                os.environ.setdefault(key, value)


def find_runc() -> str:
    for candidate in (settings().runc, _from_config()):
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
