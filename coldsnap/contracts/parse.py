"""Parse a request document into its typed model with a one-line error naming the offending field."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from coldsnap.contracts.errors import ColdSnapError, ErrorCode
from coldsnap.contracts.request import OPERATIONS, REQUEST_ADAPTER, CaptureRequest, RestoreRequest, WorkloadRequest

_ALL_TOP_LEVEL = set(CaptureRequest.model_fields) | set(RestoreRequest.model_fields) | set(WorkloadRequest.model_fields)


def _reject(message: str) -> ColdSnapError:
    return ColdSnapError(ErrorCode.INVALID_REQUEST, message)


def _location(loc: tuple[Any, ...]) -> str:
    # pydantic puts the union tag first ("capture", ...): drop it, callers think in document paths.
    parts = [str(p) for p in loc]
    if parts and parts[0] in OPERATIONS:
        parts = parts[1:]
    return ".".join(parts) or "(document)"


def first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = _location(err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    if err["type"] == "missing":
        return f"{where}: required field missing"
    return f"{where}: {err['msg']}"


def parse_request(text: str | bytes):
    """Return CaptureRequest | RestoreRequest | WorkloadRequest or raise ColdSnapError(INVALID_REQUEST)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # json.loads already refuses trailing data ("Extra data"): a second document is not silently ignored.
        raise _reject(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise _reject("a request must be a JSON object")
    unknown = sorted(set(data) - _ALL_TOP_LEVEL)
    if unknown:
        raise _reject(f"{unknown[0]}: unknown field")
    if data.get("format") != 1:
        raise _reject(f"format: unsupported request format {data.get('format')!r} (this ColdSnap reads format 1)")
    op = data.get("operation")
    if op not in OPERATIONS:
        raise _reject(f"operation: must be one of {', '.join(OPERATIONS)} (got {op!r})")
    try:
        return REQUEST_ADAPTER.validate_python(data)
    except ValidationError as e:
        raise _reject(first_error(e)) from None
