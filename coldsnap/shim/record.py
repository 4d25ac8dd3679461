"""What a container's annotations ask for, and what `create` hands on to `start` and the poststart hook.

Annotations (keys in coldsnap.contracts.capsule):
  io.coldsnap.capsule     capsule reference, pinned (sha256:… or NAME@sha256:…)
  io.coldsnap.policy      JSON of contracts.Policy fields, e.g. {"fallback_to_cold": true, "compatibility": "strict"}
  io.coldsnap.validation  JSON: {"host": ..., "port": ...} (where the server answers; default: 127.0.0.1 inside
                          the container's network namespace, port as captured) plus any contracts.Validation
                          field to override the validation recorded at capture (e.g. "ready_timeout_s")
  io.coldsnap.image-digest  (optional) the container image's digest; must equal the capsule's when both are set
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pydantic import ValidationError

from coldsnap.contracts import ColdSnapError, ErrorCode, Origin, Policy, RestoreRequest, Span, Validation
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.capsule import ANNOTATION_IMAGE_DIGEST  # noqa: F401  (re-exported)
from coldsnap.contracts.parse import first_error
from coldsnap.flows.receipts import finish_receipt
from coldsnap.flows.spans import Timeline


@dataclass
class ContainerRequest:
    request: RestoreRequest  # what the receipt's request_sha256 is taken over
    validation_overrides: dict = field(default_factory=dict)
    host: str | None = None
    port: int | None = None
    image_digest: str | None = None

    def validation(self, recorded: Validation) -> Validation:
        return Validation.model_validate({**recorded.model_dump(), **self.validation_overrides})


def _json_annotation(ann: dict[str, str], key: str) -> dict:
    raw = ann.get(key)
    if raw is None or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotation {key}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotation {key}: must be a JSON object")
    return value


def request_from_annotations(ann: dict[str, str]) -> ContainerRequest:
    ref = ann.get(mt.ANNOTATION_CAPSULE, "").strip()
    policy = _json_annotation(ann, mt.ANNOTATION_POLICY)
    val = _json_annotation(ann, mt.ANNOTATION_VALIDATION)
    host, port = val.pop("host", None), val.pop("port", None)
    if host is not None and not isinstance(host, str):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotation {mt.ANNOTATION_VALIDATION}: host must be a string")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotation {mt.ANNOTATION_VALIDATION}: port must be 1-65535")
    try:
        request = RestoreRequest(operation="restore", capsule=ref, policy=Policy.model_validate(policy),
                                 validation=Validation.model_validate(val) if val else None)
    except ValidationError as e:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"annotations: {first_error(e)}") from None
    return ContainerRequest(request=request, validation_overrides=val, host=host or None, port=port,
                            image_digest=ann.get(ANNOTATION_IMAGE_DIGEST) or None)


# --- the timeline travels from the shim (create) to the hook (poststart) in the record ------------------------
def timeline_to_dict(tl: Timeline) -> dict:
    return {"t0": tl.t0, "origin": tl.origin.model_dump(), "spans": [s.model_dump() for s in tl.spans]}


def timeline_from_dict(data: dict) -> Timeline:
    tl = Timeline()
    tl.t0 = data["t0"]
    tl.origin = Origin.model_validate(data["origin"])
    tl.spans = [Span.model_validate(s) for s in data["spans"]]
    return tl


def write_receipt(request: RestoreRequest, container_id: str, tl: Timeline, state: str, result: dict | None = None,
                  error: ColdSnapError | None = None) -> dict:
    """The container's receipt: <receipts>/<container-id>.json, operation "restore"."""
    return finish_receipt(request, container_id, "restore", tl, state, result=result, error=error)
