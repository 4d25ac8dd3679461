"""Which capsule a sparkrun launch restores from: the launch's identity, as the executor sees it when sparkrun
starts the server (the container's labels and image, the serve command), hashed into a capsule tag. The capture
of a recipe and every later `sparkrun run` of it compute the same tag; anything that changes what is served (the
model or its revision, the image, the engine, the served name, the port, the devices, any serve flag) changes it."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex

TAG_PREFIX = "sparkrun-"


def flag_value(command: str, flag: str) -> str | None:
    """The value of --flag (or --flag=value) in a shell command line."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(flag + "="):
            return word[len(flag) + 1:]
    return None


def devices(labels: dict[str, str]) -> list:
    """The accelerators sparkrun gave the container (its sparkrun.gpu_allocations label: base64 JSON)."""
    raw = labels.get("sparkrun.gpu_allocations")
    if not raw:
        return []
    try:
        data = json.loads(base64.b64decode(raw + "=" * (-len(raw) % 4)))
    except ValueError:
        return [raw]
    allocations = data.get("allocations") if isinstance(data, dict) else None
    if not isinstance(allocations, list):
        return [raw]
    keep = ("rank", "gpu_index", "gpu_uuid", "vendor")
    return [{k: a.get(k) for k in keep if k in a} for a in allocations if isinstance(a, dict)]


def engine_of(serve_command: str, labels: dict[str, str]) -> str:
    """The ColdSnap engine adapter for a serve command (the reference engine, vLLM or SGLang)."""
    if "coldsnap_reference.server" in serve_command:
        return "reference"
    if re.search(r"\bsglang\b", serve_command) or labels.get("sparkrun.runtime", "").startswith("sglang"):
        return "sglang"
    return "vllm"


def identity(labels: dict[str, str], serve_command: str, image_id: str) -> dict:
    return {
        "model": labels.get("sparkrun.model"),
        "revision": flag_value(serve_command, "--revision"),
        "image": image_id,
        "engine": engine_of(serve_command, labels),
        "runtime": labels.get("sparkrun.runtime"),
        "served_model_name": labels.get("sparkrun.served_model_name"),
        "port": flag_value(serve_command, "--port"),
        "devices": devices(labels),
        "serve_command_sha256": hashlib.sha256(serve_command.strip().encode()).hexdigest(),
    }


def tag_of(ident: dict) -> str:
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return f"{TAG_PREFIX}{key}"
