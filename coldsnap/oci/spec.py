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


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _string_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def runc_refuses(spec) -> str | None:
    """Why runc would refuse this config.json, judged on the parts ColdSnap reads or changes (runc's Go types:
    annotations map[string]string, process.args/env []string, hooks.<stage> []{path string, args/env []string,
    timeout int}, linux.namespaces []{type, path string}, mounts []object); None when they are well-formed. A spec
    runc refuses goes to runc untouched: runc then says why, as it always would."""
    if not isinstance(spec, dict):
        return "the spec is not a JSON object"
    if spec.get("annotations") is not None and not _string_map(spec["annotations"]):
        return "annotations must map strings to strings"
    process = spec.get("process")
    if process is not None:
        if not isinstance(process, dict):
            return "process must be an object"
        for key in ("args", "env"):
            if process.get(key) is not None and not _strings(process[key]):
                return f"process.{key} must be a list of strings"
    hooks = spec.get("hooks")
    if hooks is not None:
        if not isinstance(hooks, dict):
            return "hooks must be an object"
        for stage, entries in hooks.items():
            if entries is not None and not isinstance(entries, list):
                return f"hooks.{stage} must be a list"
            for hook in entries or []:
                if not isinstance(hook, dict) or not isinstance(hook.get("path"), str):
                    return f"hooks.{stage}: each hook needs a string path"
                if any(hook.get(k) is not None and not _strings(hook[k]) for k in ("args", "env")):
                    return f"hooks.{stage}: args and env must be lists of strings"
                if hook.get("timeout") is not None and type(hook["timeout"]) is not int:
                    return f"hooks.{stage}: timeout must be an integer"
    linux = spec.get("linux")
    if linux is not None:
        if not isinstance(linux, dict):
            return "linux must be an object"
        namespaces = linux.get("namespaces")
        if namespaces is not None and (not isinstance(namespaces, list) or not all(
                isinstance(ns, dict) and isinstance(ns.get("type"), str) and isinstance(ns.get("path", ""), str)
                for ns in namespaces)):
            return "linux.namespaces must be a list of {type, path} objects"
    mounts = spec.get("mounts")
    if mounts is not None and (not isinstance(mounts, list) or not all(isinstance(m, dict) for m in mounts)):
        return "mounts must be a list of objects"
    return None


def annotations_of(spec: dict) -> dict[str, str]:
    """The spec's annotations (a spec runc_refuses() passed: strings only)."""
    value = spec.get("annotations") or {}
    return dict(value) if _string_map(value) else {}


# For engines that cannot set OCI annotations on a container (Docker before 24 has no `run --annotation`), the
# same settings are read from the container's environment. An annotation wins over its variable.
ENV_ANNOTATIONS = {
    "COLDSNAP_CAPSULE": "io.coldsnap.capsule",
    "COLDSNAP_POLICY": "io.coldsnap.policy",
    "COLDSNAP_VALIDATION": "io.coldsnap.validation",
    "COLDSNAP_IMAGE_DIGEST": "io.coldsnap.image-digest",
}


# Kubernetes pods: the sandbox (pause) container gets the pod's annotations too; it is never restored.
SANDBOX_MARKS = {"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri-o.ContainerType": "sandbox"}


def root_path(spec: dict, bundle: str | os.PathLike) -> str | None:
    """The container's root filesystem on the host: root.path, relative to the bundle unless absolute."""
    root = spec["root"].get("path") if isinstance(spec.get("root"), dict) else None
    if not isinstance(root, str) or not root:
        return None
    return root if os.path.isabs(root) else os.path.join(str(bundle), root)


def is_pod_sandbox(spec: dict) -> bool:
    return bool(SANDBOX_MARKS.items() & annotations_of(spec).items())


def coldsnap_annotations(spec: dict) -> dict[str, str]:
    """The spec's annotations, completed with io.coldsnap.* settings given as COLDSNAP_* process env vars."""
    ann = annotations_of(spec)
    for entry in (spec.get("process") or {}).get("env") or []:
        name, sep, value = entry.partition("=")
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
    namespaces = (spec.get("linux") or {}).get("namespaces") or []
    return next((ns.get("path") or None for ns in namespaces if ns.get("type") == "network"), None)


def apply_launch(spec: dict, argv: list[str], env: dict[str, str], cwd: str | None = None, binds=()) -> dict:
    """Make the spec's process an engine launch (an adapter's prepare_container()): argv, its environment (the
    spec's own variables are kept unless the launch sets them), cwd; and a bind mount per contracts.Mount
    (source, target, readonly) whose target the spec does not mount yet. Returns the spec."""
    proc = spec.setdefault("process", {})
    proc["args"] = list(argv)
    merged = dict(str(entry).partition("=")[::2] for entry in proc.get("env") or [])
    proc["env"] = [f"{k}={v}" for k, v in {**merged, **env}.items()]
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
