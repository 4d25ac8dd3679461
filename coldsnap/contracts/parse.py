"""Strict documents: JSON as ColdSnap accepts it from others (requests, annotations, hook state, capsule manifests)
and requests parsed into their typed models, each refusal one line naming the field, echoing at most a short prefix.

Strict means: UTF-8, a size and nesting limit, no duplicate keys (the last one would silently win), no NaN or
Infinity, integers of at most MAX_INT_DIGITS digits, and (pydantic, strict mode) no coercion of types."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from coldsnap.contracts.errors import ColdSnapError, ErrorCode

if TYPE_CHECKING:  # the models load with the first request parsed: strict JSON alone needs none of them
    from pydantic import ValidationError

MAX_BYTES = 1 << 20  # a request or an annotation is small; a manifest too (its layers are blobs of their own)
MAX_DEPTH = 32
MAX_INT_DIGITS = 40
SHORT = 48  # echoed values are cut to this many characters


def _reject(message: str) -> ColdSnapError:
    return ColdSnapError(ErrorCode.INVALID_REQUEST, message)


def short(value: Any, limit: int = SHORT, quote: bool = True) -> str:
    """A value as an error may echo it: repr (a string quoted unless quote=False), cut to a short prefix (input can
    be megabytes)."""
    text = value if isinstance(value, str) else repr(value)
    text = text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"
    if isinstance(value, str) and quote:
        return repr(text)
    # unquoted, still one line: control characters as their escapes (a field name can hold a newline)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Refused(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate key {short(key)}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {short(text)} is out of range")
    return value


def _depth(text: str) -> int:
    """How deeply arrays and objects nest (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def strict_json(raw: str | bytes, what: str = "document", max_bytes: int = MAX_BYTES,
                code: ErrorCode = ErrorCode.INVALID_REQUEST) -> Any:
    """Decode one JSON document strictly; anything else raises ColdSnapError(code) with one line naming `what`."""
    def refuse(why: str) -> ColdSnapError:
        return ColdSnapError(code, f"{what}: {why}")

    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise refuse(f"{size} bytes, more than the {max_bytes} this document may have")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise refuse(f"not UTF-8 (byte {e.start})") from None
    if _depth(raw) > MAX_DEPTH:
        raise refuse(f"nested more than {MAX_DEPTH} levels deep")
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                          parse_int=_bounded_int, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        # json.loads refuses trailing data ("Extra data"): a second document is not silently ignored.
        raise refuse(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (_Refused, RecursionError, ValueError) as e:
        raise refuse(str(e) if isinstance(e, _Refused) else f"not valid JSON: {short(str(e))}") from None


def _location(loc: tuple[Any, ...]) -> str:
    from coldsnap.contracts.request import OPERATIONS

    # pydantic puts the union tag first ("capture", ...): drop it, callers think in document paths.
    parts = [str(p) for p in loc]
    return ".".join(parts[1:] if parts and parts[0] in OPERATIONS else parts) or "(document)"


def first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    what = {"extra_forbidden": "unknown field", "missing": "required field missing"}.get(err["type"], err["msg"])
    return f"{short(_location(err['loc']), 120, quote=False)}: {what}"


def parse_request(text: str | bytes):
    """Return CaptureRequest | RestoreRequest | WorkloadRequest or raise ColdSnapError(INVALID_REQUEST)."""
    from pydantic import ValidationError

    from coldsnap.contracts.request import OPERATIONS, REQUEST_ADAPTER, CaptureRequest, RestoreRequest, WorkloadRequest

    top_level = set(CaptureRequest.model_fields) | set(RestoreRequest.model_fields) | set(WorkloadRequest.model_fields)
    data = strict_json(text, "request")
    if not isinstance(data, dict):
        raise _reject("a request must be a JSON object")
    unknown = sorted(set(data) - top_level)
    if unknown:
        raise _reject(f"{short(unknown[0])}: unknown field")
    fmt = data.get("format")
    if type(fmt) is not int or fmt != 1:  # True == 1 in Python; a JSON true is no format
        raise _reject(f"format: unsupported request format {short(fmt)} (this ColdSnap reads format 1)")
    op = data.get("operation")
    if not isinstance(op, str) or op not in OPERATIONS:
        raise _reject(f"operation: must be one of {', '.join(OPERATIONS)} (got {short(op)})")
    try:
        return REQUEST_ADAPTER.validate_python(data)
    except ValidationError as e:
        raise _reject(first_error(e)) from None
