"""Build, hash and write receipts (0600, one JSON file per operation)."""

from __future__ import annotations

import json
from pathlib import Path

from coldsnap import __version__
from coldsnap.base.files import atomic_write, private_dir
from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorInfo, Receipt, sha256_hex
from coldsnap.flows.spans import Timeline


def _public(result: dict | None) -> dict:
    return {k: v for k, v in (result or {}).items() if not k.startswith("_")}


def build_receipt(request, op_id: str, operation: str, tl: Timeline, state: str, result: dict | None = None,
                  error: ColdSnapError | None = None) -> Receipt:
    return Receipt(
        operation=operation,
        operation_id=op_id,
        request_sha256=sha256_hex(request.model_dump(mode="json")),
        state=state,
        origin=tl.origin,
        spans=tl.spans,
        result=_public(result),
        error=ErrorInfo(code=error.code, message=error.message) if error else None,
        coldsnap_version=__version__,
    )


def write_receipt(receipt: Receipt, path: Path | None = None) -> Path:
    path = path or private_dir(settings().receipts) / f"{receipt.operation_id}.json"
    private_dir(path.parent)
    atomic_write(path, receipt.model_dump_json(indent=1).encode())
    return path


def finish_receipt(request, op_id: str, operation: str, tl: Timeline, state: str, result: dict | None = None,
                   error: ColdSnapError | None = None) -> dict:
    receipt = build_receipt(request, op_id, operation, tl, state, result, error)
    path = write_receipt(receipt)
    data = json.loads(receipt.model_dump_json())
    data["_path"] = str(path)
    if error is not None:
        error.receipt = data  # the entry point prints where the receipt is
    return data
