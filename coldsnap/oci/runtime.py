"""The real runc: where it is, and how to hand over to it.

Resolution order: $COLDSNAP_RUNC, then {"runc": PATH} in /etc/coldsnap/runtime.json, then `runc` on $PATH
(skipping this wrapper itself, which may be installed under that name).

/etc/coldsnap/runtime.json may also hold {"env": {"COLDSNAP_HOME": ..., ...}}: container engines start their
runtime with an almost empty environment (podman/conmon pass only PWD and XDG_RUNTIME_DIR), so where ColdSnap
keeps its store, run state and receipts is configured there. Variables already set win."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from coldsnap.oci.argv import RuncArgv

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


def apply_config_env() -> None:
    """COLDSNAP_* settings from runtime.json, for the paths that need them (never the pass-through)."""
    env = runtime_config().get("env")
    if isinstance(env, dict):
        for key, value in env.items():
            if isinstance(key, str) and key.startswith("COLDSNAP_") and isinstance(value, str):
                os.environ.setdefault(key, value)


def find_runc() -> str:
    # read here, not through base.paths.settings(): the pass-through path imports nothing of ours but oci/
    for candidate in (os.environ.get("COLDSNAP_RUNC"), runtime_config().get("runc")):
        if isinstance(candidate, str) and candidate:
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


@dataclass(frozen=True)
class Runc:
    """The real runc and the global flags its commands run with (--root, --systemd-cgroup, …): every runc command
    line ColdSnap runs is built here (as nvidia-container-toolkit's oci.Runtime does), and the caller's own argv
    goes to runc unchanged."""

    binary: str
    global_flags: tuple[str, ...] = ()

    @classmethod
    def at_root(cls, binary: str, root: str | os.PathLike) -> "Runc":
        return cls(binary, ("--root", os.fspath(root)))

    @classmethod
    def for_call(cls, binary: str, parsed: RuncArgv, drop: tuple[str, ...] = ("log", "log-format")) -> "Runc":
        """Our commands beside a caller's: its global flags (its --root above all), less those in drop."""
        return cls(binary, tuple(parsed.global_argv(drop=drop)))

    def argv(self, *args: str) -> list[str]:
        return [self.binary, *self.global_flags, *args]

    def quietly(self, *args: str, timeout: float | None = 60) -> int:
        """A cleanup command (delete, kill): its output discarded, its exit status returned."""
        return subprocess.run(self.argv(*args), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout).returncode

    def delete_force(self, container_id: str) -> int:
        return self.quietly("delete", "--force", container_id)

    def kill(self, container_id: str, signal: str = "KILL") -> int:
        return self.quietly("kill", container_id, signal)

    def state(self, container_id: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv("state", container_id), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True)

    def call(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
        """The caller's argv, as given (no globals of ours added): stdio and every fd inherited."""
        return subprocess.call([self.binary, *argv], env=env, close_fds=False)


def exec_runc(runc: str, argv: Sequence[str]) -> NoReturn:
    """Become runc with the caller's argv, unchanged (stdio, environment and fds are inherited as they are)."""
    os.execv(runc, [runc, *argv])
