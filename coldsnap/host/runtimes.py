"""`coldsnap runtime configure --runtime=docker|containerd|podman [--dry-run] [--set-default] [--config PATH]`:
register coldsnap-runtime with a container engine, the way `nvidia-ctk runtime configure` does.

  docker      daemon.json: "runtimes": {"coldsnap": {"path": …}} (+ "default-runtime": "coldsnap")
  containerd  config.toml: a runc-v2 runtime "coldsnap" whose options.BinaryName is coldsnap-runtime, passing
              io.coldsnap.* pod/container annotations through CRI (+ default_runtime_name); and a Kubernetes
              RuntimeClass "coldsnap" (printed; written where runtime_class_path says). Config version 2
              (containerd 1.x: the io.containerd.grpc.v1.cri plugin) or 3 (containerd 2.x:
              io.containerd.cri.v1.runtime), as the file says, or as the installed containerd writes when the file
              is empty
  podman      containers.conf: [engine.runtimes] coldsnap = [path] (+ [engine] runtime = "coldsnap")

Every key already in the file is kept; the file is replaced atomically (same mode) and only when it changes;
dry_run prints the unified diff and writes nothing. TOML is edited as text (the stdlib cannot write TOML) and the
result is parsed back with tomllib before it is written."""

from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from coldsnap.base.files import KEEP_MODE, atomic_write
from coldsnap.contracts import ColdSnapError, ErrorCode

NAME = "coldsnap"
DEFAULTS = {"docker": "/etc/docker/daemon.json", "containerd": "/etc/containerd/config.toml",
            "podman": "/etc/containers/containers.conf"}
CRI = 'plugins."io.containerd.grpc.v1.cri".containerd'  # config version 2 (containerd 1.x)
CRI_V3 = 'plugins."io.containerd.cri.v1.runtime".containerd'  # config version 3 (containerd 2.x)
RUNTIME_CLASS = f"""apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata:
  name: {NAME}
handler: {NAME}
"""


@dataclass
class Configured:
    path: Path
    changed: bool
    diff: str
    written: bool
    notes: list[str]


def default_runtime_path() -> str:
    """coldsnap-runc (the C front door: a pass-through call starts no Python) where it is installed, else the
    coldsnap-runtime script."""
    for name in ("coldsnap-runc", "coldsnap-runtime"):
        beside = Path(sys.prefix) / "bin" / name
        if beside.exists():
            return str(beside)
        found = shutil.which(name)
        if found:
            return found
    return str(Path(sys.prefix) / "bin" / "coldsnap-runtime")


# --- docker ------------------------------------------------------------------------------------------------------
def docker_config(text: str, runtime: str, set_default: bool) -> str:
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError as e:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"daemon.json is not valid JSON ({e}); not touching it") from None
    if not isinstance(data, dict):
        raise ColdSnapError(ErrorCode.ENVIRONMENT, "daemon.json is not a JSON object; not touching it")
    runtimes = data.setdefault("runtimes", {})
    entry = runtimes.get(NAME) if isinstance(runtimes.get(NAME), dict) else {}
    runtimes[NAME] = {**entry, "path": runtime}
    if set_default:
        data["default-runtime"] = NAME
    return json.dumps(data, indent=2) + "\n"


# --- TOML as text ------------------------------------------------------------------------------------------------
_HEADER = re.compile(r"^\s*\[\[?\s*(.+?)\s*\]\]?\s*(#.*)?$")


def _norm(header: str) -> str:
    """A table header's dotted key, spacing and quote style dropped ('a'.b == "a" . b)."""
    return re.sub(r"\s*\.\s*", ".", header.strip()).replace("'", '"')


def _table_span(lines: list[str], table: str) -> tuple[int, int] | None:
    """(header index, end index) of [table], or None."""
    start = None
    for i, line in enumerate(lines):
        if not (m := _HEADER.match(line)):
            continue
        if start is not None:
            return start, i
        if _norm(m.group(1)) == _norm(table):
            start = i
    return (start, len(lines)) if start is not None else None


def set_toml_key(text: str, table: str, key: str, value: str) -> str:
    """key = value (a TOML literal) in [table]; the table is appended when missing."""
    lines = text.splitlines()
    span = _table_span(lines, table)
    if span is None:
        lines += ["", f"[{table}]", f"  {key} = {value}"]
        return "\n".join(lines).lstrip("\n") + "\n"
    start, end = span
    pat = re.compile(rf"^(\s*){re.escape(key)}\s*=")
    for i in range(start + 1, end):
        m = pat.match(lines[i])
        if m:
            lines[i] = f"{m.group(1) or '  '}{key} = {value}"
            return "\n".join(lines) + "\n"
    header = lines[start]
    lines.insert(start + 1, f"{header[:len(header) - len(header.lstrip())]}  {key} = {value}")
    return "\n".join(lines) + "\n"


def _parse_toml(text: str, what: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"{what} is not valid TOML ({e}); not touching it") from None


def _dig(data: dict, dotted: str):
    for part in re.findall(r'"[^"]*"|[^.]+', dotted):
        data = data.get(part.strip('"'), {}) if isinstance(data, dict) else {}
    return data


# --- containerd --------------------------------------------------------------------------------------------------
def installed_containerd_major() -> int | None:
    binary = shutil.which("containerd")
    if not binary:
        return None
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\s v?(\d+)\.\d+", out)
    return int(m.group(1)) if m else None


def containerd_config(text: str, runtime: str, set_default: bool) -> str:
    data = _parse_toml(text, "config.toml")
    version = data.get("version")
    if not text.strip():
        version = 3 if (installed_containerd_major() or 1) >= 2 else 2
        text = f"version = {version}\n"
    if version not in (2, 3):
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"config.toml is config version {version or 1}: ColdSnap writes "
                            "config versions 2 (containerd 1.x) and 3 (containerd 2.x); migrate it with `containerd "
                            "config migrate` first; not touching it")
    cri = CRI_V3 if version == 3 else CRI
    table = f"{cri}.runtimes.{NAME}"
    text = set_toml_key(text, table, "runtime_type", '"io.containerd.runc.v2"')
    text = set_toml_key(text, table, "pod_annotations", '["io.coldsnap.*"]')
    text = set_toml_key(text, table, "container_annotations", '["io.coldsnap.*"]')
    text = set_toml_key(text, f"{table}.options", "BinaryName", json.dumps(runtime))
    if set_default:
        text = set_toml_key(text, cri, "default_runtime_name", json.dumps(NAME))
    data = _parse_toml(text, "the new config.toml")
    assert _dig(data, f"{table}.options").get("BinaryName") == runtime
    return text


# --- podman ------------------------------------------------------------------------------------------------------
def podman_config(text: str, runtime: str, set_default: bool) -> str:
    _parse_toml(text, "containers.conf")
    text = set_toml_key(text, "engine.runtimes", NAME, json.dumps([runtime]))
    if set_default:
        text = set_toml_key(text, "engine", "runtime", json.dumps(NAME))
    data = _parse_toml(text, "the new containers.conf")
    assert data["engine"]["runtimes"][NAME] == [runtime]
    return text


EDITORS: dict[str, Callable[[str, str, bool], str]] = {
    "docker": docker_config, "containerd": containerd_config, "podman": podman_config}
RESTART = {"docker": "restart dockerd", "containerd": "restart containerd",
           "podman": "nothing to restart (podman reads containers.conf per command)"}


def configure(runtime: str, *, dry_run: bool = False, set_default: bool = False, config: str | Path | None = None,
              runtime_path: str | None = None, runtime_class_path: str | Path | None = None,
              out: Callable[[str], None] = print) -> Configured:
    if runtime not in EDITORS:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST,
                            f"--runtime must be one of {', '.join(EDITORS)} (got {runtime!r})")
    path = Path(config or DEFAULTS[runtime])
    try:
        old = path.read_text(encoding="utf-8") if path.exists() else ""
    except OSError as e:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"cannot read {path}: {e.strerror}") from None
    new = EDITORS[runtime](old, runtime_path or default_runtime_path(), set_default)
    diff = "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        f"{path} (current)", f"{path} (with coldsnap)"))
    changed = new != old
    notes = []
    if runtime == "containerd":
        if runtime_class_path and not dry_run:
            atomic_write(Path(runtime_class_path), RUNTIME_CLASS.encode("utf-8"), KEEP_MODE)
            notes.append(f"RuntimeClass written to {runtime_class_path}")
        out(RUNTIME_CLASS.rstrip())
    if dry_run:
        out(diff.rstrip() or f"{path}: already configured")
    elif changed:
        atomic_write(path, new.encode("utf-8"), KEEP_MODE)
        notes.append(f"{path} updated; {RESTART[runtime]}")
    return Configured(path=path, changed=changed, diff=diff, written=changed and not dry_run, notes=notes)
