"""A bundle's config.json (OCI runtime spec) as a plain dict: every field we do not know is kept as it was.

Writes are atomic (temp file in the bundle + fsync + rename) and keep the file's mode: the runtime that reads
the spec next must see either the old document or the new one, never half of one."""

from __future__ import annotations

import json
import os

CONFIG = "config.json"


def load_spec(bundle: str | os.PathLike) -> dict:
    path = os.path.join(bundle, CONFIG)
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    if not isinstance(spec, dict):
        raise ValueError(f"{path} is not a JSON object")
    return spec


def write_spec(bundle: str | os.PathLike, spec: dict) -> None:
    from coldsnap.base.files import KEEP_MODE, atomic_write  # not on the pass-through path

    data = json.dumps(spec, indent=1, ensure_ascii=False).encode("utf-8")
    atomic_write(os.path.join(bundle, CONFIG), data, KEEP_MODE)


def annotations_of(spec: dict) -> dict[str, str]:
    value = spec.get("annotations") or {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


# For engines that cannot set OCI annotations on a container (Docker before 24 has no `run --annotation`), the
# same settings are read from the container's environment. An annotation wins over its variable.
ENV_ANNOTATIONS = {
    "COLDSNAP_CAPSULE": "io.coldsnap.capsule",
    "COLDSNAP_POLICY": "io.coldsnap.policy",
    "COLDSNAP_VALIDATION": "io.coldsnap.validation",
    "COLDSNAP_IMAGE_DIGEST": "io.coldsnap.image-digest",
}


def coldsnap_annotations(spec: dict) -> dict[str, str]:
    """The spec's annotations, completed with io.coldsnap.* settings given as COLDSNAP_* process env vars."""
    ann = annotations_of(spec)
    for entry in (spec.get("process") or {}).get("env") or []:
        name, sep, value = str(entry).partition("=")
        key = ENV_ANNOTATIONS.get(name)
        if sep and key and key not in ann:
            ann[key] = value
    return ann


def hooks(spec: dict, stage: str) -> list[dict]:
    """The hooks of one stage (poststart, poststop, createRuntime, ...), [] when none."""
    value = (spec.get("hooks") or {}).get(stage) or []
    return [h for h in value if isinstance(h, dict) and h.get("path")]


def ensure_hook(spec: dict, stage: str, hook: dict) -> bool:
    """Append hook to the stage unless a hook with the same executable name is already there. True if added."""
    name = os.path.basename(hook["path"])
    if any(os.path.basename(h["path"]) == name for h in hooks(spec, stage)):
        return False
    spec.setdefault("hooks", {}).setdefault(stage, []).append(hook)
    return True


def netns_path(spec: dict) -> str | None:
    """The network namespace path the spec joins, or None when the runtime creates a fresh one (or none)."""
    for ns in (spec.get("linux") or {}).get("namespaces") or []:
        if ns.get("type") == "network":
            return ns.get("path") or None
    return None


def apply_launch(spec: dict, argv: list[str], env: dict[str, str], cwd: str | None = None, binds=()) -> dict:
    """Make the spec's process an engine launch (an adapter's prepare_container()): argv, its environment (the
    spec's own variables are kept unless the launch sets them), cwd; and a bind mount per contracts.Mount
    (source, target, readonly) whose target the spec does not mount yet. Returns the spec."""
    proc = spec.setdefault("process", {})
    proc["args"] = list(argv)
    merged = {}
    for entry in proc.get("env") or []:
        name, _, value = str(entry).partition("=")
        merged[name] = value
    merged.update(env)
    proc["env"] = [f"{k}={v}" for k, v in merged.items()]
    if cwd:
        proc["cwd"] = cwd
    mounts = spec.setdefault("mounts", [])
    taken = {os.path.normpath(m.get("destination", "")) for m in mounts}
    for bind in binds:
        if os.path.normpath(bind.target) in taken:
            continue
        for mount in host_bind(bind.source, bind.target, bind.readonly):
            if os.path.normpath(mount["destination"]) not in taken:
                mounts.append(mount)
                taken.add(os.path.normpath(mount["destination"]))
    return spec


def host_bind(source: str, target: str, readonly: bool = True) -> list[dict]:
    """The spec mounts that bind a host directory at target: the directory itself, not recursively, then each host
    submount below it as a bind of its own (see base.files.submounts: runc makes only the spec's binds external)."""
    from coldsnap.base.files import submounts  # not on the pass-through path

    mode = "ro" if readonly else "rw"
    return [{"destination": target, "type": "bind", "source": source, "options": ["bind", mode]}] + [
        {"destination": os.path.join(target, os.path.relpath(sub, source)), "type": "bind", "source": sub,
         "options": ["bind", mode]} for sub in submounts(source)]
