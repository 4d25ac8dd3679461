"""The plugin's settings, and ColdSnap's CLI as the plugin calls it (`--json`, one line of error otherwise).

Settings live in sparkrun's config.yaml under `plugins.coldsnap` (each can also come from the environment):

  cli             the coldsnap command (COLDSNAP_CLI; default: the one installed beside this interpreter, else PATH)
  docker_runtime  the docker runtime name coldsnap-runtime is registered under (default "coldsnap")
  docker_exec_root  dockerd's exec root, where its runc state lives (COLDSNAP_DOCKER_EXEC_ROOT; default /run/docker)
  cpu_slot        give a host without accelerators one CPU slot in sparkrun's planning (CPU inference servers)
  fallback_to_cold  a restore that fails starts the server cold (default true)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from coldsnap.base.paths import settings as settings_of_coldsnap

MODE_ENV = "COLDSNAP_SPARKRUN_MODE"  # capture: the launch `sparkrun coldsnap capture` makes (cold, recorded)
RECORD_ENV = "COLDSNAP_SPARKRUN_RECORD"  # where that launch's executor writes what it started


@dataclass
class Settings:
    cli: str
    docker_runtime: str = "coldsnap"
    docker_exec_root: str = "/run/docker"
    cpu_slot: bool = False
    fallback_to_cold: bool = True


def _sparkrun_settings() -> dict:
    try:
        from sparkrun.core.config import SparkrunConfig

        return SparkrunConfig().plugin_settings("coldsnap")
    except Exception:  # noqa: BLE001 - outside sparkrun, or an unreadable config: the defaults
        return {}


def settings() -> Settings:
    raw = _sparkrun_settings()
    beside = Path(sys.prefix) / "bin" / "coldsnap"
    cli = settings_of_coldsnap().cli or raw.get("cli") or (str(beside) if beside.exists() else None) \
        or shutil.which("coldsnap") or "coldsnap"
    return Settings(cli=str(cli), docker_runtime=str(raw.get("docker_runtime") or "coldsnap"),
                    docker_exec_root=settings_of_coldsnap().docker_exec_root or str(
                        raw.get("docker_exec_root") or "/run/docker"),
                    cpu_slot=bool(raw.get("cpu_slot", False)),
                    fallback_to_cold=bool(raw.get("fallback_to_cold", True)))


class ColdSnapFailed(Exception):
    """A coldsnap command that exited non-zero: its one-line error and exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def coldsnap(*args: str, timeout: float = 3600) -> dict:
    """Run `coldsnap ARGS --json` and return what it printed."""
    r = subprocess.run([settings().cli, *args, "--json"], capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        lines = [line for line in r.stderr.strip().splitlines() if line.startswith("coldsnap: ")]
        raise ColdSnapFailed(lines[-1] if lines else (r.stderr.strip() or f"exited {r.returncode}")[-400:],
                             r.returncode)
    out = r.stdout.strip()
    return json.loads(out) if out else {}


def capsule_for(tag: str) -> str | None:
    """The newest capsule tagged `tag` in the local store, as TAG@sha256:…, or None."""
    rows = [c for c in coldsnap("ls").get("capsules", []) if c.get("tag") == tag]
    if not rows:
        return None
    newest = max(rows, key=lambda c: c.get("created") or "")
    return f"{tag}@{newest['digest']}"


def home() -> Path:
    """Where the plugin keeps its records: ColdSnap's run directory (COLDSNAP_RUN), under sparkrun/."""
    from coldsnap.base.paths import settings as paths

    path = paths().run / "sparkrun"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def runc_root_of(container_id: str) -> str | None:
    """The runc root under dockerd's exec root that holds this container's state."""
    base = Path(settings().docker_exec_root)
    for root in sorted(base.glob("runtime-*/moby")):
        if (root / container_id / "state.json").exists():
            return str(root)
    return None
