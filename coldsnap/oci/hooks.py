"""OCI hooks: the ColdSnap hooks a restored container needs (added to config.json at create, as
nvidia-container-runtime adds its own), and running a stage's hooks the way runc does (the container state JSON
on stdin, only the hook's own env, its timeout) for the `start` the shim answers itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from coldsnap.oci.spec import ensure_hook, hooks

HOOK_NAME = "coldsnap-hook"
DEFAULT_HOOK = "/usr/local/bin/coldsnap-hook"
PASSED_ENV = ("COLDSNAP_HOME", "COLDSNAP_STORE", "COLDSNAP_RUN", "COLDSNAP_RECEIPTS", "COLDSNAP_CRIU_PREFIX",
              "COLDSNAP_CRIU", "COLDSNAP_DEBUG")


def hook_binary() -> str:
    """coldsnap-hook beside this runtime (its venv or install dir), else on PATH, else /usr/local/bin."""
    here = sys.argv[0] if sys.argv and sys.argv[0] else ""
    for directory in (os.path.dirname(here), os.path.dirname(os.path.realpath(here)), os.path.dirname(sys.executable)):
        candidate = os.path.join(directory, HOOK_NAME)
        if directory and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which(HOOK_NAME) or DEFAULT_HOOK


def hook_env() -> list[str]:
    """runc gives a hook only the env its spec names: pass on where ColdSnap keeps things."""
    env = [f"PATH={os.environ.get('PATH', '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin')}"]
    return env + [f"{k}={os.environ[k]}" for k in PASSED_ENV if k in os.environ]


def add_coldsnap_hooks(spec: dict) -> bool:
    """createRuntime (`lo` up before CRIU restores loopback connections), poststart (validate, receipt) and
    poststop (clean up), each unless a coldsnap-hook is already configured for it (podman/CRI-O inject them from
    oci-hooks.d). True when the spec changed."""
    path = hook_binary()
    changed = False
    for stage in ("createRuntime", "poststart", "poststop"):
        changed |= ensure_hook(spec, stage, {"path": path, "args": [HOOK_NAME, stage], "env": hook_env()})
    return changed


def run_stage(spec: dict, stage: str, state_json: str) -> str | None:
    """Run a stage's hooks in order; the first failure's message, or None."""
    for hook in hooks(spec, stage):
        args = hook.get("args") or [hook["path"]]
        env = dict(e.split("=", 1) for e in hook.get("env") or [] if "=" in e)
        try:
            r = subprocess.run(args, executable=hook["path"], input=state_json, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=hook.get("timeout"))
        except subprocess.TimeoutExpired:
            return f"{stage} hook {hook['path']} timed out after {hook.get('timeout')} s"
        except OSError as e:
            return f"{stage} hook {hook['path']}: {e.strerror}"
        if r.stderr:
            sys.stderr.write(r.stderr)
            sys.stderr.flush()
        if r.returncode != 0:
            detail = (r.stderr or r.stdout).strip().splitlines()
            return f"{stage} hook {hook['path']} failed (exit {r.returncode})" + (f": {detail[-1]}" if detail else "")
    return None
